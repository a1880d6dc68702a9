"""Bucket assignment and the GradBucket API, in one process."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ddpkit.parallel.buckets import UNBATCHED_BESIDE_BYTES, Bucket, GradBucket, assign_buckets


def floats(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype)


def test_a_bucket_closes_once_it_reaches_its_cap_with_the_crossing_tensor_inside() -> None:
    # 4-byte floats; first cap 40 bytes, then 100 bytes (torch's Reducer rule: spread=0)
    tensors = [floats(2), floats(20), floats(5), floats(20), floats(1)]
    assert assign_buckets(tensors, cap_bytes=100, first_cap_bytes=40, spread=0) == [[0, 1], [2, 3], [4]]


def test_caps_after_the_first_double_up_to_the_cap() -> None:
    # 40-byte tensors; caps 40, 80, then 100 (160 capped)
    tensors = [floats(10) for _ in range(10)]
    assert assign_buckets(tensors, cap_bytes=100, first_cap_bytes=40, growing=True, spread=0) == [
        [0], [1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert assign_buckets(tensors, cap_bytes=100, first_cap_bytes=40, spread=0) == [[0], [1, 2, 3], [4, 5, 6],
                                                                                    [7, 8, 9]]


def test_a_mid_sized_model_gets_a_bucket_for_about_every_sixteenth_of_its_bytes_so_the_wire_starts_early() -> None:
    # The 8 x 1024 MLP's weights (4 MiB each, 32 MiB in all): not torch's [[0], [1, ..., 7]], whose
    # second bucket is complete only when backward ends (benchmarks/links.py, mlp384).
    weights = [floats(1024 * 1024) for _ in range(8)]
    assert assign_buckets(weights, spread=0) == [[0], [1, 2, 3, 4, 5, 6, 7]]
    assert assign_buckets(weights) == [[index] for index in range(8)]
    # 64 tensors of 1 MiB: buckets of 4 MiB (a 16th) after the first.
    assert assign_buckets([floats(256 * 1024) for _ in range(64)])[:3] == [[0], [1, 2, 3, 4], [5, 6, 7, 8]]
    # Never below the first cap (a small model is not cut into tiny messages), never above cap_bytes.
    assert assign_buckets([floats(64 * 1024) for _ in range(16)]) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                                                      [12, 13, 14, 15]]
    # 160 tensors of 16 MiB (2.5 GiB, on the meta device: no memory): a 16th is above the 25 MB default.
    large = [torch.empty(4 * 1024 * 1024, device="meta") for _ in range(160)]
    assert assign_buckets(large)[1:3] == [[1, 2], [3, 4]]
    assert assign_buckets(large, cap_bytes=64 * 1024 * 1024)[1:3] == [[1, 2, 3, 4], [5, 6, 7, 8]]  # the user's cap


def test_gradients_on_a_gpu_keep_torchs_caps_for_each_launch_costs_the_host_time() -> None:
    # The same 8 x 1024 MLP's weights as CUDA tensors (fake ones: no GPU needed): torch's two buckets.
    with FakeTensorMode():
        weights = [torch.empty(1024 * 1024, device="cuda") for _ in range(8)]
    assert assign_buckets(weights) == [[0], [1, 2, 3, 4, 5, 6, 7]]
    assert assign_buckets(weights, growing=True) == [[0], [1], [2], [3, 4], [5, 6, 7]]  # a 16-bit hook's caps


def test_growing_caps_give_a_mid_sized_model_small_buckets_so_a_slow_wire_never_waits_for_a_large_one() -> None:
    # Under torch's caps (spread=0) a 16-bit hook's wire has sent bucket 0 long before backward
    # fills the second bucket (benchmarks/links.py): caps that double.
    weights = [floats(1024 * 1024) for _ in range(8)]
    assert assign_buckets(weights, growing=True, spread=0) == [[0], [1], [2], [3, 4], [5, 6, 7]]
    # Larger tensors fill the doubling caps sooner: 16 MiB layers go one a bucket, 8 MiB ones up to four.
    assert assign_buckets([floats(4 * 1024 * 1024) for _ in range(6)], growing=True, spread=0) == [
        [0], [1], [2], [3], [4], [5]]
    assert assign_buckets([floats(2 * 1024 * 1024) for _ in range(12)], growing=True, spread=0) == [
        [0], [1], [2], [3], [4, 5], [6, 7, 8, 9], [10, 11]]
    # With the model's share as well, the smaller of the two caps: 1, 2, 4 MiB, then a 16th of 96 MiB, 6 MiB.
    assert assign_buckets([torch.empty(256 * 1024, device="meta") for _ in range(96)], growing=True)[:5] == [
        [0], [1, 2], [3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18]]


def test_buckets_hold_one_dtype_each_and_follow_the_launch_order() -> None:
    tensors = [floats(4), floats(4, torch.float64), floats(4), floats(4, torch.float64)]
    assert assign_buckets(tensors, cap_bytes=1 << 20, first_cap_bytes=1 << 20) == [[0, 2], [1, 3]]


def test_caps_must_be_positive() -> None:
    with pytest.raises(ValueError, match="cap_bytes=0"):
        assign_buckets([floats(1)], cap_bytes=0)
    with pytest.raises(ValueError, match="spread=-1"):
        assign_buckets([floats(1)], spread=-1)


def test_bucket_views_flags_and_grad_bucket_api() -> None:
    parameters = [torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.ones(4))]
    bucket = Bucket.build(3, parameters, ["a", "b"])
    assert bucket.buffer.numel() == 6 + 4 + 2  # gradients, then one flag per parameter
    assert [tuple(v.shape) for v in bucket.views] == [(2, 3), (4,)]
    bucket.views[1].fill_(7)
    assert bucket.grads[6:].tolist() == [7.0] * 4 and bucket.flags.tolist() == [0.0, 0.0]

    grad_bucket = GradBucket(bucket, is_last=True)
    assert grad_bucket.index() == 3 and grad_bucket.is_last()
    assert grad_bucket.buffer() is bucket.grads and grad_bucket.get_tensors() == [bucket.grads]
    assert grad_bucket.parameters() == parameters
    assert [g.data_ptr() for g in grad_bucket.gradients()] == [v.data_ptr() for v in bucket.views]

    half = grad_bucket.buffer().to(torch.float16)
    grad_bucket.set_buffer(half)  # torch's wrappers swap in a compressed copy
    assert grad_bucket.buffer() is half and grad_bucket.buffer().dtype == torch.float16
    with pytest.raises(ValueError, match="needs 10 elements"):
        grad_bucket.set_buffer(torch.zeros(3))


def test_small_parameters_lie_first_and_contiguous_so_one_pass_covers_them() -> None:
    sizes = [50, 3, 40, 2]  # slots 1 and 3 are below the batching threshold of 10 elements
    parameters = [torch.nn.Parameter(torch.ones(n)) for n in sizes]
    bucket = Bucket.build(0, parameters, ["a", "b", "c", "d"], batch_below_numel=10)
    assert bucket.batched_slots == [1, 3]
    assert bucket.batched_parameters == [parameters[1], parameters[3]]
    assert bucket.batched_region.numel() == 5
    for slot in (1, 3):
        bucket.views[slot].fill_(slot)
    assert bucket.grads[:5].tolist() == [1.0] * 3 + [3.0] * 2  # the region, in slot order
    bucket.views[0].fill_(-1)
    bucket.views[2].fill_(-2)
    assert bucket.grads[5:55].tolist() == [-1.0] * 50 and bucket.grads[55:].tolist() == [-2.0] * 40
    assert [v.data_ptr() for v in bucket.batched_views] == [bucket.views[1].data_ptr(), bucket.views[3].data_ptr()]


def test_a_bucket_with_a_gradient_of_a_mebibyte_or_more_batches_nothing() -> None:
    # Small gradients kept until the launch would pin the holes that the large ones leave in the heap.
    large = torch.nn.Parameter(torch.ones(UNBATCHED_BESIDE_BYTES // 4))
    small = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    bucket = Bucket.build(0, [small[0], large, small[1]], ["a", "b", "c"], batch_below_numel=10)
    assert bucket.batched_slots == [] and bucket.batched_region.numel() == 0
    just_below = torch.nn.Parameter(torch.ones(UNBATCHED_BESIDE_BYTES // 4 - 1))
    assert Bucket.build(0, [small[0], just_below], ["a", "b"], batch_below_numel=10).batched_slots == [0]
