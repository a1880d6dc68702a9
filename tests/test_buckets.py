"""Bucket assignment and the GradBucket API, in one process."""

from __future__ import annotations

import pytest
import torch

from ddpkit.buckets import Bucket, GradBucket, assign_buckets


def floats(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype)


def test_a_bucket_closes_once_it_reaches_its_cap_with_the_crossing_tensor_inside() -> None:
    # 4-byte floats; first cap 40 bytes, then 100 bytes (torch's Reducer rule)
    tensors = [floats(2), floats(20), floats(5), floats(20), floats(1)]
    assert assign_buckets(tensors, cap_bytes=100, first_cap_bytes=40) == [[0, 1], [2, 3], [4]]


def test_buckets_hold_one_dtype_each_and_follow_the_launch_order() -> None:
    tensors = [floats(4), floats(4, torch.float64), floats(4), floats(4, torch.float64)]
    assert assign_buckets(tensors, cap_bytes=1 << 20, first_cap_bytes=1 << 20) == [[0, 2], [1, 3]]


def test_caps_must_be_positive() -> None:
    with pytest.raises(ValueError, match="cap_bytes=0"):
        assign_buckets([floats(1)], cap_bytes=0)


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
