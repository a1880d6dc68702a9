"""Uneven inputs: ranks with different numbers of batches finish cleanly, with DistributedDataParallel.join
(the finished ranks shadow the others' reductions) or with even_batches (all stop at the shortest)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from helpers import BATCH_PER_RANK, make_mlp
from torch import nn

import ddpkit
from ddpkit.hooks import PowerSGDState, elementwise_average, fp16_compress_hook, powerSGD_hook
from ddpkit.hooks.contract import GradBucket
from ddpkit.testing import WorkerPool

BATCHES = [10, 7, 4]  # per rank


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(BATCH_PER_RANK, 6, generator=generator), torch.randn(BATCH_PER_RANK, 3, generator=generator)


def reference(world_size: int) -> list[torch.Tensor]:
    """One process, step by step: the ranks that still have a batch contribute their mean loss over
    the world size (those that finished contribute zero, as torch's Join does by default)."""
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(max(BATCHES[:world_size])):
        optimizer.zero_grad()
        losses = [nn.functional.mse_loss(model(x), y) for x, y in
                  (batch(rank, step) for rank in range(world_size) if step < BATCHES[rank])]
        (sum(losses) / world_size).backward()  # type: ignore[union-attr]
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def train_with_join(hook: str) -> tuple[list[torch.Tensor], float]:
    rank = dist.get_rank()
    model = ddpkit.DistributedDataParallel(make_mlp(seed=rank), bucket_cap_mb=0.0005)  # several buckets
    if hook == "fp16":
        model.register_comm_hook(None, fp16_compress_hook)
    elif hook == "user's, declared elementwise":
        model.register_comm_hook(None, users_averaging_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = time.monotonic()
    with model.join():
        for step in range(BATCHES[rank]):
            x, y = batch(rank, step)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    return [p.detach().clone() for p in model.module.parameters()], time.monotonic() - start


@elementwise_average
def users_averaging_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    if not (isinstance(bucket, GradBucket) and bucket.prescaled()):
        buffer.div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda done: done.value()[0])


@pytest.mark.parametrize("hook", ["none", "fp16", "user's, declared elementwise"])
def test_join_lets_uneven_ranks_finish_and_matches_the_reference(pool: WorkerPool, hook: str) -> None:
    expected = reference(pool.world_size)
    tolerance = 2e-3 if hook == "fp16" else 1e-5  # fp16 rounds each reduced gradient
    for params, seconds in pool.run(train_with_join, hook, timeout=30):
        assert seconds < 10
        for actual, wanted in zip(params, expected):
            torch.testing.assert_close(actual, wanted, rtol=0, atol=tolerance)


def join_with_powersgd() -> str:
    model = ddpkit.DistributedDataParallel(make_mlp())
    model.register_comm_hook(PowerSGDState(process_group=None), powerSGD_hook)
    try:
        with model.join():
            pass
    except ValueError as error:
        return str(error)
    return "no error"


def test_join_refuses_reductions_it_cannot_shadow(pool2: WorkerPool) -> None:
    for message in pool2.run(join_with_powersgd, timeout=30):
        assert "cannot shadow reductions made by the comm hook 'powerSGD_hook'" in message
        assert "ddpkit.even_batches" in message


def count_even_batches() -> int:
    rank = dist.get_rank()
    return sum(1 for _ in ddpkit.even_batches(range(BATCHES[rank])))


def test_even_batches_stops_every_rank_at_the_shortest(pool: WorkerPool) -> None:
    shortest = min(BATCHES[: pool.world_size])
    assert pool.run(count_even_batches, timeout=30) == [shortest] * pool.world_size


def train_through_the_strategy(use_torch_ddp: bool) -> list[torch.Tensor]:
    from helpers import strategy

    rank = dist.get_rank()
    s = strategy(use_torch_ddp=use_torch_ddp)
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = s.setup(model, optimizer)
    with s.join():
        for step in range(BATCHES[rank]):
            x, y = batch(rank, step)
            optimizer.zero_grad()
            s.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
    return [p.detach().clone() for p in s.get_model_from_plugin(model).parameters()]


@pytest.mark.parametrize("use_torch_ddp", [False, True], ids=["ddpkit", "torch"])
def test_the_strategy_joins_with_either_ddp(pool2: WorkerPool, use_torch_ddp: bool) -> None:
    expected = reference(2)
    results = pool2.run(train_through_the_strategy, use_torch_ddp, timeout=30)
    for actual, wanted in zip(results[0], expected):  # rank 0 trained longest
        torch.testing.assert_close(actual, wanted, rtol=0, atol=1e-5)


def join_with_logging() -> list[tuple[float, list[list[float]]]]:
    """Every step, the ranks still training sum their losses and gather them (for logging)."""
    rank = dist.get_rank()
    model = ddpkit.DistributedDataParallel(make_mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logged = []

    def shadow_step() -> None:  # the same calls, contributing nothing
        ddpkit.sync_ddp(torch.zeros(1))
        ddpkit.gather_all_tensors(torch.empty(0))

    with model.join(shadow_step=shadow_step):
        for step in range(BATCHES[rank]):
            x, y = batch(rank, step)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            total = ddpkit.sync_ddp(loss.detach().reshape(1)).item()
            pieces = [piece.tolist() for piece in ddpkit.gather_all_tensors(loss.detach().reshape(1))]
            logged.append((total, pieces))
    return logged


def test_join_shadows_per_step_collectives_with_neutral_values(pool2: WorkerPool) -> None:
    longer, shorter = pool2.run(join_with_logging, timeout=30)
    assert len(longer) == BATCHES[0] and len(shorter) == BATCHES[1]
    for step, (total, pieces) in enumerate(longer):
        if step < BATCHES[1]:
            assert pieces[1] != [] and total == pytest.approx(pieces[0][0] + pieces[1][0])
        else:  # rank 1 has finished: it contributed zero to the sum and nothing to the gather
            assert pieces[1] == [] and total == pytest.approx(pieces[0][0])
