"""PowerSGD on torch's and ddpkit's DDP, 2 and 3 Gloo ranks: any bucketing, exact byte accounting,
convergence close to plain all-reduce, state that survives a checkpoint and a change of buckets."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import Counting
from torch import nn

from ddpkit.distributed import register_ddp_comm_hook
from ddpkit.hooks import PowerSGDState, allreduce_hook, fp16_compress_hook, powerSGD_hook
from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.testing import WorkerPool


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 40), nn.ReLU(), nn.Linear(40, 8))


def wrap(model: nn.Module, kind: str, bucket_cap_mb: float) -> nn.Module:
    if kind == "torch":
        return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    return DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, static_graph=True)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(16, 64, generator=generator), torch.randn(16, 8, generator=generator)


def sgd_steps(model: nn.Module, steps: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def train_with_powersgd(kind: str, bucket_cap_mb: float, steps: int) -> tuple[int, list[torch.Tensor]]:
    model = wrap(mlp(), kind, bucket_cap_mb)
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, min_compression_rate=1)
    register_ddp_comm_hook(model, ddp_comm_state=state, ddp_comm_hook=powerSGD_hook)
    sgd_steps(model, steps)
    buckets = len(model._reducer.buckets) if kind == "ddpkit" else int(
        model._get_ddp_logging_data()["rebuilt_bucket_sizes"].count(",") + 1)
    return buckets, [p.grad.clone() for p in model.module.parameters()]


@pytest.mark.parametrize("kind", ["torch", "ddpkit"])
@pytest.mark.parametrize(("bucket_cap_mb", "buckets"), [(25, 1), (0.008, 2), (0.001, 3)],
                         ids=["one-bucket", "two-buckets", "many-buckets"])
def test_any_number_of_buckets_and_every_rank_agrees(pool: WorkerPool, kind: str, bucket_cap_mb: float,
                                                     buckets: int) -> None:
    results = pool.run(train_with_powersgd, kind, bucket_cap_mb, 5, timeout=120)
    counts = {count for count, _ in results}
    assert len(counts) == 1 and counts.pop() >= buckets
    reference = results[0][1]
    for _, grads in results:
        assert all(torch.isfinite(g).all() and torch.equal(g, r) for g, r in zip(grads, reference))


def bucket_sizes_with(hook_name: str) -> tuple[list[int], list[int]]:
    """Bucket sizes (parameters) of four 1 MiB layers before a hook is registered and after one
    synchronised backward with it (the buckets are rebuilt then, in the observed order)."""
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)]))
    before = [len(bucket.parameters) for bucket in model._reducer.buckets]
    hooks = {"fp16": (None, fp16_compress_hook), "PowerSGD": (PowerSGDState(None, start_powerSGD_iter=1), powerSGD_hook)}
    if hook_name in hooks:
        state, hook = hooks[hook_name]
        register_ddp_comm_hook(model, ddp_comm_state=state, ddp_comm_hook=hook)
    model(torch.randn(4, 512)).sum().backward()
    return before, [len(bucket.parameters) for bucket in model._reducer.buckets]


@pytest.mark.parametrize("hook_name", ["none", "fp16", "PowerSGD"])
def test_an_elementwise_average_gets_a_bucket_a_layer_and_powersgd_keeps_torchs_caps(pool2: WorkerPool,
                                                                                     hook_name: str) -> None:
    """No hook and a hook that averages elementwise (fp16) get buckets of a 16th of the model's
    bytes, at least 1 MiB: here one 1 MiB layer each. PowerSGD, which pays per bucket, keeps
    torch's one jump from 1 MiB to bucket_cap_mb (ddpkit.parallel.buckets, benchmarks/links.py
    --torch-layout): its buckets are rebuilt when it is registered."""
    a_layer_each, one_jump = [2, 2, 2, 2], [2, 6]
    for before, after in pool2.run(bucket_sizes_with, hook_name, timeout=60):
        assert before == a_layer_each
        assert after == (one_jump if hook_name == "PowerSGD" else a_layer_each)


def bytes_on_the_wire(kind: str, rank: int, bucket_cap_mb: float = 0.01) -> tuple[int, dict[str, float], int]:
    model = wrap(mlp(), kind, bucket_cap_mb)
    state = PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=1, min_compression_rate=1)
    register_ddp_comm_hook(model, ddp_comm_state=state, ddp_comm_hook=powerSGD_hook)
    x, y = batch(0)
    nn.functional.mse_loss(model(x), y).backward()  # plain all-reduce step
    with Counting() as counting:
        nn.functional.mse_loss(model(x), y).backward()  # compressed step
    return counting.sent, state.compression_stats(), counting.calls


@pytest.mark.parametrize("kind", ["torch", "ddpkit"])
@pytest.mark.parametrize("rank", [1, 4])
def test_sends_exactly_the_bytes_its_stats_say(pool2: WorkerPool, kind: str, rank: int) -> None:
    for sent, stats, _ in pool2.run(bytes_on_the_wire, kind, rank, timeout=60):
        assert sent == stats["bytes_sent"]
        # Three weight matrices compressed: P and Q of rank r each; biases sent as they are.
        weights = (64 + 48) * rank + (48 + 40) * rank + (40 + 8) * rank
        biases = 48 + 40 + 8
        assert sent == 4 * (2 * weights // 2 + biases) or sent == 4 * (weights + biases)
        assert stats["compressed_tensors"] == 3 and stats["uncompressed_tensors"] == 3


@pytest.mark.parametrize("kind", ["torch", "ddpkit"])
def test_a_bucket_costs_two_all_reduces_as_the_uncompressed_tensors_travel_with_p(pool2: WorkerPool, kind: str) -> None:
    """PowerSGD's step waits for each of its small messages in turn: the biases ride with P, then Q."""
    for _, stats, calls in pool2.run(bytes_on_the_wire, kind, 1, 25, timeout=60):
        assert stats["compressed_tensors"] == 3 and stats["uncompressed_tensors"] == 3
        assert calls == 2  # one bucket


def error_storages_over_steps() -> list[set[int]]:
    model = DistributedDataParallel(mlp(), static_graph=True)
    state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=1, min_compression_rate=1)
    register_ddp_comm_hook(model, ddp_comm_state=state, ddp_comm_hook=powerSGD_hook)
    storages = []
    for step in range(4):
        x, y = batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        storages.append({error.data_ptr() for error in state.error.values()})
    return storages[1:]  # from the first compressed step


def test_error_feedback_is_kept_in_place_with_no_copy_of_the_gradients_per_step(pool2: WorkerPool) -> None:
    """M + E is summed into E's storage and E becomes the next error there: the hook allocates no
    matrix-sized tensor per step (those passes and allocations were most of its cost on a CPU)."""
    for storages in pool2.run(error_storages_over_steps, timeout=60):
        assert len(storages[0]) == 3 and storages[0] == storages[1] == storages[2]


def compression_of_a_large_layer() -> float:
    model = DistributedDataParallel(nn.Linear(512, 512), static_graph=True)
    state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=1)
    register_ddp_comm_hook(model, ddp_comm_state=state, ddp_comm_hook=powerSGD_hook)
    for _ in range(2):
        model(torch.randn(4, 512)).sum().backward()
    return state.compression_stats()["compression_rate"]


def test_rank_one_sends_over_a_hundred_times_fewer_bytes(pool2: WorkerPool) -> None:
    assert all(rate > 100 for rate in pool2.run(compression_of_a_large_layer, timeout=60))


def low_rank_regression(use_powersgd: bool, steps: int) -> float:
    """Fit Y = X A B with a rank-2 target; return the final loss over a fixed evaluation set."""
    generator = torch.Generator().manual_seed(7)
    a, b = torch.randn(32, 2, generator=generator), torch.randn(2, 32, generator=generator)
    x_eval = torch.randn(256, 32, generator=generator)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(32, 32, bias=False), static_graph=True)
    if use_powersgd:
        state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
        register_ddp_comm_hook(model, ddp_comm_state=state, ddp_comm_hook=powerSGD_hook)
    else:
        register_ddp_comm_hook(model, ddp_comm_hook=allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)  # 60 steps: learnt, not yet converged to 0
    for step in range(steps):
        data = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x = torch.randn(32, 32, generator=data)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), x @ a @ b).backward()
        optimizer.step()
    with torch.no_grad():
        return nn.functional.mse_loss(model.module(x_eval), x_eval @ a @ b).item()


def test_low_rank_regression_within_five_percent_of_plain_allreduce(pool2: WorkerPool) -> None:
    plain = pool2.run(low_rank_regression, False, 60, timeout=120)[0]
    compressed = pool2.run(low_rank_regression, True, 60, timeout=120)[0]
    initial = pool2.run(low_rank_regression, False, 0, timeout=60)[0]
    assert plain < 0.5 * initial  # the task was learnt at all
    assert abs(compressed - plain) <= 0.05 * plain, (compressed, plain)


def checkpoint_and_resume(rebucket: bool) -> bool:
    def make(cap: float) -> tuple[nn.Module, PowerSGDState, torch.optim.Optimizer]:
        model = DistributedDataParallel(mlp(), bucket_cap_mb=cap, static_graph=True)
        state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=1)
        register_ddp_comm_hook(model, ddp_comm_state=state, ddp_comm_hook=powerSGD_hook)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.05)

    def steps(model, optimizer, first, count):  # type: ignore[no-untyped-def]
        for step in range(first, first + count):
            x, y = batch(step)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()

    model, state, optimizer = make(25)
    steps(model, optimizer, 0, 3)
    saved = copy.deepcopy((model.state_dict(), state.state_dict(), optimizer.state_dict()))  # a snapshot
    steps(model, optimizer, 3, 3)
    continued = [p.detach().clone() for p in model.module.parameters()]

    model2, state2, optimizer2 = make(0.001 if rebucket else 25)  # other buckets: state keyed by name
    model2.load_state_dict(saved[0])
    state2.load_state_dict(saved[1])
    optimizer2.load_state_dict(saved[2])
    assert state2.iter == 3 and set(state2.error) == {"0.weight", "2.weight", "4.weight"}
    steps(model2, optimizer2, 3, 3)
    return all(torch.equal(a, b) for a, b in zip(continued, model2.module.parameters()))


@pytest.mark.parametrize("rebucket", [False, True], ids=["same-buckets", "new-buckets"])
def test_state_round_trips_through_state_dict(pool2: WorkerPool, rebucket: bool) -> None:
    assert pool2.run(checkpoint_and_resume, rebucket, timeout=120) == [True, True]


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="matrix_approximation_rank=0"):
        PowerSGDState(None, matrix_approximation_rank=0)
    with pytest.raises(ValueError, match="start_powerSGD_iter=0"):
        PowerSGDState(None, start_powerSGD_iter=0)


def full_rank_powersgd(kind: str, registration: str = "register_ddp_comm_hook") -> list[torch.Tensor]:
    """With rank = rows, P spans the whole column space: PowerSGD must return the exact mean."""
    torch.manual_seed(0)
    model = wrap(nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3)), kind, 25)
    state = PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=1, min_compression_rate=0)
    if registration == "register_ddp_comm_hook":
        register_ddp_comm_hook(model, ddp_comm_state=state, ddp_comm_hook=powerSGD_hook)
    else:  # the module's own method, as for torch's powerSGD_hook: no names given
        model.register_comm_hook(state, powerSGD_hook)
    generator = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(5, 6, generator=generator), torch.randn(5, 3, generator=generator)
    for _ in range(2):  # step 0 plain, step 1 compressed
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
    assert state.compression_stats()["compressed_tensors"] == 2
    return [p.grad.clone() for p in model.module.parameters()]


@pytest.mark.parametrize("registration", ["register_ddp_comm_hook", "module.register_comm_hook"])
@pytest.mark.parametrize("kind", ["torch", "ddpkit"])
def test_full_rank_compression_returns_the_exact_mean(pool2: WorkerPool, kind: str, registration: str) -> None:
    local = []
    for rank in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))
        generator = torch.Generator().manual_seed(rank)
        x, y = torch.randn(5, 6, generator=generator), torch.randn(5, 3, generator=generator)
        nn.functional.mse_loss(model(x), y).backward()
        local.append([p.grad for p in model.parameters()])
    mean = [(a + b) / 2 for a, b in zip(*local)]
    for grads in pool2.run(full_rank_powersgd, kind, registration, timeout=60):
        for grad, expected in zip(grads, mean):
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)


def drop_in_for_torch_powersgd(steps: int) -> tuple[list[torch.Tensor], set[str], set[str]]:
    """torch's DDP with several buckets, the hook registered as torch's own would be, error
    feedback and warm start on: it trains; state_dict() asks for names, then has them."""
    model = nn.parallel.DistributedDataParallel(mlp(), bucket_cap_mb=0.001)
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, min_compression_rate=1)
    model.register_comm_hook(state, powerSGD_hook)
    sgd_steps(model, steps)
    with pytest.raises(ValueError, match=r"state.name_parameters\(model.module\)"):
        state.state_dict()
    unnamed = set(state.error)
    state.name_parameters(model.module)
    return [p.detach().clone() for p in model.module.parameters()], unnamed, set(state.state_dict()["error"])


def test_registered_on_torch_ddp_without_names_it_works_as_torch_hook_would(pool: WorkerPool) -> None:
    results = pool.run(drop_in_for_torch_powersgd, 5, timeout=120)
    for params, unnamed, named in results:
        assert len(unnamed) == 3 and all(key.startswith("<unnamed>") for key in unnamed)
        assert named == {"0.weight", "2.weight", "4.weight"}
        for ours, first in zip(params, results[0][0]):
            assert torch.equal(ours, first)  # every rank holds the same parameters
