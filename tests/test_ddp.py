"""ddpkit.DistributedDataParallel on 2 and 3 Gloo ranks, against one process on the concatenated batch."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from helpers import BATCH_PER_RANK, global_batch, grads_of, make_mlp, sgd_on_shards, shard
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.checkpoint import checkpoint

from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.testing import WorkerPool


def reference_grads(world_size: int, make=make_mlp, step: int = 0) -> dict[str, torch.Tensor | None]:  # type: ignore[no-untyped-def]
    model = make()
    x, y = global_batch(world_size, step)
    nn.functional.mse_loss(model(x), y).backward()
    return grads_of(model)


def assert_close_grads(actual: dict, expected: dict, rtol: float = 1e-6, scale_tol: float = 0.0) -> None:  # type: ignore[type-arg]
    """``scale_tol``: an absolute tolerance as a fraction of the tensor's largest magnitude, for
    low-precision formats whose error is relative to the values summed, not to each element."""
    assert actual.keys() == expected.keys()
    for name in expected:
        if expected[name] is None:
            assert actual[name] is None, name
        else:
            atol = max(1e-7, scale_tol * expected[name].abs().max().item())
            torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol)


def train_on_global_batches(model: nn.Module, world_size: int, steps: int) -> None:
    """The single-process reference: SGD on the concatenation of every rank's batch, step by step."""
    sgd_on_shards(model, model, world_size, None, steps)


# --- gradients ---------------------------------------------------------------------------------


def one_step(bucket_cap_mb: float, as_view: bool) -> dict[str, torch.Tensor | None]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(make_mlp(seed=rank), bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=as_view)
    x, y = global_batch(world)
    nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
    return grads_of(model.module)


@pytest.mark.parametrize(("bucket_cap_mb", "as_view"), [(25, False), (0.0005, False), (0.0005, True)],
                         ids=["one-bucket", "many-buckets", "many-buckets-as-views"])
def test_gradients_equal_single_process_on_concatenated_batch(pool: WorkerPool, bucket_cap_mb: float,
                                                              as_view: bool) -> None:
    expected = reference_grads(pool.world_size)  # rank seeds differ: construction must broadcast rank 0's
    for grads in pool.run(one_step, bucket_cap_mb, as_view, timeout=60):
        assert_close_grads(grads, expected)


def complex_step(negotiate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # construction must broadcast rank 0's values
    model = DistributedDataParallel(nn.Linear(4, 3, dtype=torch.complex64), negotiate_grads=negotiate)
    x = torch.randn(BATCH_PER_RANK * world, 4, dtype=torch.complex64, generator=torch.Generator().manual_seed(7))
    model(shard(x, rank)).abs().pow(2).sum().div(BATCH_PER_RANK).backward()
    return model.module.weight.grad, model.module.bias.grad


@pytest.mark.parametrize("negotiate", [True, False], ids=["negotiated", "static"])
def test_complex_parameters_are_averaged(pool: WorkerPool, negotiate: bool) -> None:
    torch.manual_seed(0)
    reference = nn.Linear(4, 3, dtype=torch.complex64)
    x = torch.randn(BATCH_PER_RANK * pool.world_size, 4, dtype=torch.complex64, generator=torch.Generator().manual_seed(7))
    reference(x).abs().pow(2).sum().div(BATCH_PER_RANK * pool.world_size).backward()
    for weight, bias in pool.run(complex_step, negotiate, timeout=60):
        torch.testing.assert_close(weight, reference.weight.grad)
        torch.testing.assert_close(bias, reference.bias.grad)


def train_steps(steps: int, use_torch_ddp: bool) -> list[torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    module = make_mlp()
    model = nn.parallel.DistributedDataParallel(module) if use_torch_ddp else DistributedDataParallel(module)
    return sgd_on_shards(model, module, world, rank, steps)


def train_steps_keeping_grads(steps: int, as_view: bool | None, set_to_none: bool) -> tuple[list[torch.Tensor], bool]:
    """Parameters after SGD steps, and whether every .grad lies in a bucket (stored once)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    module = make_mlp()
    options = {} if as_view is None else {"gradient_as_bucket_view": as_view}
    model = DistributedDataParallel(module, **options)
    parameters = sgd_on_shards(model, module, world, rank, steps, set_to_none=set_to_none)
    buffers = {bucket.buffer.untyped_storage().data_ptr() for bucket in model._reducer.buckets}
    in_buckets = all(p.grad is not None and p.grad.untyped_storage().data_ptr() in buffers for p in module.parameters())
    return parameters, in_buckets


@pytest.mark.parametrize("set_to_none", [True, False], ids=["zero_grad-set_to_none", "zero_grad-zeros"])
@pytest.mark.parametrize("as_view", [None, False], ids=["default-views", "copies"])
def test_twenty_sgd_steps_match_single_process(pool: WorkerPool, as_view: bool | None, set_to_none: bool) -> None:
    """Gradients live in the buckets by default (gradient_as_bucket_view=True) and stay right with
    either kind of zero_grad; with False each .grad keeps storage of its own."""
    reference = make_mlp()
    train_on_global_batches(reference, pool.world_size, 20)
    for params, in_buckets in pool.run(train_steps_keeping_grads, 20, as_view, set_to_none, timeout=60):
        for actual, expected in zip(params, reference.parameters()):
            torch.testing.assert_close(actual, expected.detach(), rtol=0, atol=1e-5)
        assert in_buckets is (as_view is None)


def test_bit_identical_to_torch_ddp_on_two_ranks(pool2: WorkerPool) -> None:
    ours = pool2.run(train_steps, 20, False, timeout=60)
    theirs = pool2.run(train_steps, 20, True, timeout=60)
    for rank in range(2):
        for a, b in zip(ours[rank], theirs[rank]):
            assert torch.equal(a, b)


# --- dynamic graphs, no_sync, frozen parameters, checkpointing -------------------------------------


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(6, 3)
        self.odd_only = nn.Linear(6, 3)
        self.never = nn.Linear(6, 3)
        self.frozen = nn.Linear(6, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, use_odd: bool) -> torch.Tensor:
        out = self.shared(x) + self.frozen(x)
        return out + self.odd_only(x) if use_odd else out


def dynamic_graph_step(step: int, with_hook: bool) -> dict[str, torch.Tensor | None]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(Branches(), bucket_cap_mb=0.0001)
    if with_hook:  # hooks see only gradients, so negotiation takes its own small all-reduce
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    x, y = global_batch(world, step)
    use_odd = (rank + step) % 2 == 1  # which ranks use the branch changes from step to step
    nn.functional.mse_loss(model(shard(x, rank)[:, :6], use_odd), shard(y, rank)).backward()
    return grads_of(model.module)


def dynamic_reference(world: int, step: int) -> dict[str, torch.Tensor | None]:
    """Each rank's loss is a mean over its shard; DDP averages the ranks' gradients."""
    model = Branches()
    x, y = global_batch(world, step)
    total = sum(nn.functional.mse_loss(model(shard(x, r), (r + step) % 2 == 1), shard(y, r)) for r in range(world))
    (total / world).backward()
    return grads_of(model)


@pytest.mark.parametrize("with_hook", [False, True], ids=["flags-in-buckets", "comm-hook"])
@pytest.mark.parametrize("step", [0, 1])
def test_dynamic_graph_missing_gradients_count_as_zero_and_unused_stay_none(pool: WorkerPool, step: int,
                                                                            with_hook: bool) -> None:
    expected = dynamic_reference(pool.world_size, step)
    assert expected["never.weight"] is None and expected["frozen.weight"] is None
    for grads in pool.run(dynamic_graph_step, step, with_hook, timeout=60):
        assert_close_grads(grads, expected)


def host_reads_in_backward(use_every_parameter: bool) -> int:
    """How many tensors the synchronised backward reads back to the host (``Tensor.tolist``)."""
    rank = dist.get_rank()
    model = DistributedDataParallel(Branches(), bucket_cap_mb=0.0001)
    use_odd = use_every_parameter or rank == 1
    loss = model(torch.randn(4, 6), use_odd).sum() + model.module.never(torch.randn(4, 6)).sum()
    reads = []

    def count(frame: object, event: str, function: object) -> None:
        if event == "c_call" and getattr(function, "__name__", "") == "tolist":
            reads.append(function)

    sys.setprofile(count)
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
    return len(reads)


def test_the_gradient_flags_are_read_only_when_a_parameter_lacks_a_gradient(pool2: WorkerPool) -> None:
    """On a GPU, reading the flags back stalls the CPU until the reduction ends: when every
    parameter has a gradient on this rank, the summed flags are positive without looking."""
    assert pool2.run(host_reads_in_backward, True) == [0, 0]
    missing_here, everything_here = pool2.run(host_reads_in_backward, False)  # only rank 1 uses odd_only
    assert missing_here > 0 and everything_here == 0


def no_sync_accumulation() -> dict[str, torch.Tensor | None]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(make_mlp())
    for step in range(3):
        x, y = global_batch(world, step)
        loss = nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank))  # forward outside no_sync
        if step < 2:
            with model.no_sync():
                assert not model.require_backward_grad_sync
                loss.backward()
            assert model.require_backward_grad_sync  # restored on leaving no_sync
        else:
            loss.backward()
    return grads_of(model.module)


def test_no_sync_accumulates_then_averages(pool: WorkerPool) -> None:
    model = make_mlp()
    for step in range(3):
        x, y = global_batch(pool.world_size, step)
        nn.functional.mse_loss(model(x), y).backward()
    expected = grads_of(model)
    for grads in pool.run(no_sync_accumulation, timeout=60):
        assert_close_grads(grads, expected, rtol=1e-5)


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = make_mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def checkpointed_two_forwards() -> dict[str, torch.Tensor | None]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(Checkpointed())
    x, y = global_batch(world)
    half = BATCH_PER_RANK // 2
    xs, ys = shard(x, rank), shard(y, rank)
    first = nn.functional.mse_loss(model(xs[:half]), ys[:half])
    second = nn.functional.mse_loss(model(xs[half:]), ys[half:])
    ((first + second) / 2).backward()
    return {name.removeprefix("inner."): g for name, g in grads_of(model.module).items()}


def test_checkpointing_and_several_forwards_before_one_backward(pool2: WorkerPool) -> None:
    expected = reference_grads(2)
    for grads in pool2.run(checkpointed_two_forwards, timeout=60):
        assert_close_grads(grads, expected, rtol=1e-5)


# --- buffers -----------------------------------------------------------------------------------


class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.BatchNorm1d(6)
        self.linear = nn.Linear(6, 3)
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen_calls = self.calls.item()  # what this forward found
        self.calls = self.calls + 1 + dist.get_rank()  # reassigned, not modified in place; differs per rank
        return self.linear(self.norm(x))


def buffers_after_steps() -> dict[str, list[float]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(WithBuffers())
    x, y = global_batch(world)
    nn.functional.mse_loss(model(shard(x, rank) * (rank + 1)), shard(y, rank)).backward()
    after_backward = {"mean": model.module.norm.running_mean.tolist(), "calls": model.module.calls.tolist()}
    model.eval()
    with torch.no_grad():
        model(shard(x, rank) * (rank + 1))  # eval-only step: buffers diverge (calls) ...
        model(shard(x, rank))  # ... and are synced before the next forward
    return {**after_backward, "seen_by_forward_after_eval": model.module.seen_calls}


def test_buffers_are_broadcast_from_the_first_rank(pool: WorkerPool) -> None:
    results = pool.run(buffers_after_steps, timeout=60)
    assert all(r == results[0] for r in results)
    assert results[0]["calls"] == [1.0]  # rank 0's value after the training step: 0 + 1 + 0
    assert results[0]["seen_by_forward_after_eval"] == 2.0  # rank 0's value after its eval step: 1 + 1 + 0


# --- construction ------------------------------------------------------------------------------


class Reordered(nn.Module):
    """Registers the same layers in a different order on odd ranks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        first, second = nn.Linear(6, 16), nn.Linear(16, 3)
        if dist.get_rank() % 2:
            self.b = second
            self.a = first
        else:
            self.a = first
            self.b = second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def reordered_step() -> dict[str, torch.Tensor | None]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(Reordered(), bucket_cap_mb=0.0001)
    x, y = global_batch(world)
    nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
    return grads_of(model.module)


def test_registration_order_may_differ_between_ranks(pool: WorkerPool) -> None:
    reference = Reordered.__new__(Reordered)
    nn.Module.__init__(reference)
    torch.manual_seed(0)
    reference.a, reference.b = nn.Linear(6, 16), nn.Linear(16, 3)
    x, y = global_batch(pool.world_size)
    nn.functional.mse_loss(Reordered.forward(reference, x), y).backward()
    for grads in pool.run(reordered_step, timeout=60):
        assert_close_grads(grads, grads_of(reference))


def mismatched_shapes() -> str:
    rank = dist.get_rank()
    try:
        DistributedDataParallel(nn.Linear(6, 3 + rank))
    except ValueError as error:
        return str(error)
    return "no error"


def test_shape_mismatch_raises_on_every_rank_naming_both_shapes(pool2: WorkerPool) -> None:
    for message in pool2.run(mismatched_shapes, timeout=30):
        assert "'bias' has shape (3,)" in message and "rank 0" in message and "shape (4,)" in message


def state_dict_and_module() -> tuple[list[str], bool]:
    model = DistributedDataParallel(make_mlp())
    keys = list(model.state_dict())
    model.load_state_dict(make_mlp(seed=5).state_dict())
    loaded = torch.equal(model.module[0].weight, make_mlp(seed=5)[0].weight)
    return keys, loaded


def test_state_dict_has_no_module_prefix(pool2: WorkerPool) -> None:
    keys, loaded = pool2.run(state_dict_and_module, timeout=30)[0]
    assert keys == list(make_mlp().state_dict()) and loaded


def unknown_kwarg_warning() -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DistributedDataParallel(make_mlp(), check_reduction=True, bucket_cap_mb=1, mixed_precision=None)
    return [str(w.message) for w in caught]


def test_ignored_torch_kwargs_warn_by_name(pool2: WorkerPool) -> None:
    messages = pool2.run(unknown_kwarg_warning, timeout=30)[0]
    assert messages == ["ddpkit.DistributedDataParallel ignores these torch DDP arguments: check_reduction, mixed_precision."]


def no_trainable_parameters() -> str:
    frozen = make_mlp().requires_grad_(False)
    try:
        DistributedDataParallel(frozen)
    except ValueError as error:
        return str(error)
    return "no error"


def test_module_without_trainable_parameters_is_refused(pool2: WorkerPool) -> None:
    assert all("no parameters that require grad" in m for m in pool2.run(no_trainable_parameters, timeout=30))


def test_wrapping_before_connecting_is_refused() -> None:
    with pytest.raises(RuntimeError, match="needs a process group.*init_dist_connection"):
        DistributedDataParallel(make_mlp())


# --- custom functions, hooks, subgroups ---------------------------------------------------------


def custom_functions() -> tuple[int, int, dict[str, torch.Tensor | None]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    calls = {"reduce": 0, "broadcast": 0}

    def reduce_function(tensors, group):  # type: ignore[no-untyped-def]
        calls["reduce"] += 1
        for tensor in tensors:
            dist.all_reduce(tensor, group=group)
            tensor.div_(dist.get_world_size(group))

    def broadcast_function(tensors, group):  # type: ignore[no-untyped-def]
        calls["broadcast"] += 1
        for tensor in tensors:
            dist.broadcast(tensor, src=0, group=group)

    model = DistributedDataParallel(make_mlp(seed=rank), reduce_function=reduce_function,
                                    broadcast_function=broadcast_function)
    x, y = global_batch(world)
    nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
    return calls["reduce"], calls["broadcast"], grads_of(model.module)


def test_reduce_and_broadcast_functions_are_really_called(pool2: WorkerPool) -> None:
    expected = reference_grads(2)
    for reduce_calls, broadcast_calls, grads in pool2.run(custom_functions, timeout=30):
        assert reduce_calls == 1 and broadcast_calls >= 1
        assert_close_grads(grads, expected)


def torch_hooks(hook_name: str) -> tuple[dict[str, torch.Tensor | None], int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(make_mlp(), bucket_cap_mb=0.0005)
    seen = []
    handle = model.register_comm_hook(lambda ddp: seen.append(ddp is model))
    hook = (default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)
            if hook_name == "fp16_compress_wrapper" else getattr(default_hooks, hook_name))
    model.register_comm_hook(None, hook)
    x, y = global_batch(world)
    nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
    handle.remove()
    nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()  # no longer called
    assert seen == [True]
    for p in model.parameters():
        p.grad.div_(2)  # two backward passes accumulated
    return grads_of(model.module), len(seen)


@pytest.mark.parametrize("hook_name", ["allreduce_hook", "fp16_compress_hook", "fp16_compress_wrapper"])
def test_torch_comm_hooks_run_unchanged(pool: WorkerPool, hook_name: str) -> None:
    expected = reference_grads(pool.world_size)
    # fp16 rounds each rank's gradient and the sum: about 5e-4 of the tensor's scale each time.
    scale_tol = 0.0 if hook_name == "allreduce_hook" else 2e-3
    for grads, _ in pool.run(torch_hooks, hook_name, timeout=60):
        assert_close_grads(grads, expected, rtol=1e-6 if not scale_tol else 2e-3, scale_tol=scale_tol)


def subgroup_step() -> dict[str, torch.Tensor | None] | None:
    rank = dist.get_rank()
    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    model = DistributedDataParallel(make_mlp(seed=rank), process_group=group, bucket_cap_mb=0.0005)
    x, y = global_batch(2)
    nn.functional.mse_loss(model(shard(x, rank - 1)), shard(y, rank - 1)).backward()
    return grads_of(model.module)


def test_subgroup_without_global_rank_zero(pool3: WorkerPool) -> None:
    expected = reference_grads(2, make=lambda: make_mlp(seed=1))  # the group's first rank is global rank 1
    outsider, *members = pool3.run(subgroup_step, timeout=60)
    assert outsider is None
    for grads in members:
        assert_close_grads(grads, expected)


# --- a rank whose backward never comes ------------------------------------------------------------


def backward_on_rank_zero_only() -> None:
    from datetime import timedelta

    group = dist.new_group([0, 1], timeout=timedelta(seconds=3))  # a short timeout for this test only
    model = DistributedDataParallel(make_mlp(), process_group=group)
    x, y = global_batch(2)
    loss = nn.functional.mse_loss(model(shard(x, dist.get_rank())), shard(y, dist.get_rank()))
    if dist.get_rank() == 0:
        loss.backward()  # rank 1 never runs its backward
    else:
        import time

        time.sleep(10)


def test_a_missing_backward_ends_in_a_named_error_at_the_group_timeout(pool2: WorkerPool) -> None:
    import time

    from ddpkit.testing import RankFailedError

    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        pool2.run(backward_on_rank_zero_only, timeout=30)
    assert time.monotonic() - start < 9  # the group's 3 s timeout, not the pool's bound or torch's 30 min
    assert info.value.rank == 0
    message = str(info.value)
    assert "gradient reduction of bucket" in message and "did not run this backward" in message


def module_on_two_devices() -> str:
    model = make_mlp()
    model[4].to("meta")  # one layer elsewhere: a module split over devices
    try:
        DistributedDataParallel(model)
    except ValueError as error:
        return str(error)
    return "no error"


def test_module_split_over_devices_is_refused(pool2: WorkerPool) -> None:
    for message in pool2.run(module_on_two_devices, timeout=30):
        assert "several devices ['cpu', 'meta']" in message and "module.to(device)" in message


# --- overlap and static graphs ------------------------------------------------------------------


def gradients_missing_at_each_launch() -> list[int]:
    """For each bucket launch, how many parameters had no gradient yet (backward still running)."""
    model = DistributedDataParallel(make_mlp(), bucket_cap_mb=0.0005)
    missing: list[int] = []

    def recording_hook(state, bucket):  # type: ignore[no-untyped-def]
        missing.append(sum(p.grad is None for p in model.module.parameters()))
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, recording_hook)
    x, y = global_batch(dist.get_world_size())
    nn.functional.mse_loss(model(shard(x, dist.get_rank())), shard(y, dist.get_rank())).backward()
    return missing


def test_buckets_are_reduced_while_backward_runs(pool2: WorkerPool) -> None:
    for missing in pool2.run(gradients_missing_at_each_launch, timeout=30):
        assert len(missing) == 2  # [4.*, 2.*] then [0.*] at a 524-byte cap
        assert missing[0] > 0  # the first bucket left before the first layers had their gradients
        assert missing == sorted(missing, reverse=True)  # launched in order as backward proceeds


def static_graph_step() -> dict[str, torch.Tensor | None]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(make_mlp(), static_graph=True, find_unused_parameters=False)
    x, y = global_batch(world)
    nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
    return grads_of(model.module)


def test_static_graph_skips_negotiation_and_still_averages(pool: WorkerPool) -> None:
    expected = reference_grads(pool.world_size)
    for grads in pool.run(static_graph_step, timeout=30):
        assert_close_grads(grads, expected)


def torch_powersgd_on_ddpkit() -> list[torch.Tensor]:
    from torch.distributed.algorithms.ddp_comm_hooks import (
        powerSGD_hook as torch_powersgd,
    )

    model = DistributedDataParallel(make_mlp(), static_graph=True)  # one bucket: torch's hook needs that on Gloo
    state = torch_powersgd.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    model.register_comm_hook(state, torch_powersgd.powerSGD_hook)
    x, y = global_batch(dist.get_world_size())
    for _ in range(4):  # two plain steps, then compressed ones
        model.zero_grad()
        nn.functional.mse_loss(model(shard(x, dist.get_rank())), shard(y, dist.get_rank())).backward()
    return [p.grad.clone() for p in model.module.parameters()]


def test_torch_powersgd_hook_runs_unchanged(pool2: WorkerPool) -> None:
    pytest.importorskip("numpy", reason="torch's powerSGD_hook draws its random matrices with numpy")
    first, second = pool2.run(torch_powersgd_on_ddpkit, timeout=60)
    assert all(torch.isfinite(a).all() and torch.equal(a, b) for a, b in zip(first, second))


class UsedInReverse(nn.Module):
    """Layers registered in the reverse of the order forward uses them: registration order
    predicts the order of gradients badly, so only rebuilt buckets can fill early."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.last, self.middle, self.first = nn.Linear(16, 3), nn.Linear(16, 16), nn.Linear(6, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.middle(torch.tanh(self.first(x)))))


def launches_and_parameters(as_view: bool, steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """For each step, how many gradients were still missing at each bucket launch; then the parameters."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(UsedInReverse(), bucket_cap_mb=0.0005, gradient_as_bucket_view=as_view)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    missing: list[int] = []

    def recording_hook(state, bucket):  # type: ignore[no-untyped-def]
        missing.append(sum(p.grad is None for p in model.module.parameters()))
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, recording_hook)
    per_step = []
    for step in range(steps):
        x, y = global_batch(world, step)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
        optimizer.step()
        per_step.append(missing[:])
        missing.clear()
    return per_step, [p.detach().clone() for p in model.module.parameters()]


@pytest.mark.parametrize("as_view", [False, True], ids=["copies", "views"])
def test_buckets_are_rebuilt_in_the_order_gradients_arrive(pool: WorkerPool, as_view: bool) -> None:
    reference = UsedInReverse()
    train_on_global_batches(reference, pool.world_size, 4)
    for per_step, params in pool.run(launches_and_parameters, as_view, 4, timeout=60):
        # Step 1, registration order: the first bucket holds the first layer, whose gradient comes
        # last, so nothing can launch before backward ends. From step 2 the first bucket launches early.
        assert per_step[0][0] == 0
        assert all(launches[0] > 0 for launches in per_step[1:]), per_step
        for actual, expected in zip(params, reference.parameters()):
            torch.testing.assert_close(actual, expected.detach(), rtol=0, atol=1e-5)


def test_forward_inputs_move_to_the_module_device_through_nested_containers() -> None:
    from collections import namedtuple

    from ddpkit.parallel.construction import to_device

    Pair = namedtuple("Pair", ["left", "right"])
    meta = torch.device("meta")
    moved = to_device(((torch.ones(2), [torch.ones(1), 3]), {"k": Pair(torch.ones(1), "text")}), meta)
    (first, (second, number)), mapping = moved
    assert first.device == meta and second.device == meta and number == 3
    assert isinstance(mapping["k"], Pair) and mapping["k"].left.device == meta and mapping["k"].right == "text"
    already = torch.ones(1, device=meta)
    assert to_device(already, meta) is already  # no copy for tensors already there
