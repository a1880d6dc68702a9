"""Debug mode (DDPKIT_DEBUG=1): mismatched collectives raise on every rank, before the real one,
with both fingerprints and call sites (2 Gloo ranks, process-group timeout 5 s)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit.distributed
from ddpkit.diagnostics.debug import CollectiveMismatchError, set_debug
from ddpkit.testing import WorkerPool


@pytest.fixture(scope="module")
def debug_pool() -> WorkerPool:
    with WorkerPool(2, timeout=30, pg_timeout=5) as pool:
        yield pool  # type: ignore[misc]


def in_debug_mode(scenario: str) -> tuple[str, str, float]:
    set_debug(True)
    rank = dist.get_rank()
    start = time.monotonic()
    try:
        if scenario == "all_reduce shapes":
            ddpkit.sync_ddp(torch.ones(4 + rank))
        elif scenario == "gather dtypes":
            ddpkit.gather_all_tensors(torch.ones(3, dtype=torch.float32 if rank == 0 else torch.float64))
        elif scenario == "broadcast shapes":
            ddpkit.broadcast(torch.ones(2, 2 + rank))
        elif scenario == "order":
            if rank == 0:
                ddpkit.sync_ddp(torch.ones(2))
            else:
                ddpkit.barrier()
        elif scenario == "ddp vs collective":
            model = ddpkit.DistributedDataParallel(nn.Linear(3, 1))
            if rank == 0:
                model(torch.ones(2, 3)).sum().backward()
            else:
                ddpkit.sync_ddp(torch.ones(1))
        elif scenario == "evaluation vs training":
            model = ddpkit.DistributedDataParallel(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
            if rank == 0:
                model(torch.ones(2, 3))
                model(torch.ones(2, 3))  # a second forward without backward: buffers broadcast first
            else:
                model(torch.ones(2, 3)).sum().backward()
        elif scenario == "named barriers":
            _strategy().barrier("before saving" if rank == 0 else "after saving")
        elif scenario == "all agree":
            model = ddpkit.DistributedDataParallel(nn.Linear(3, 1))
            model(torch.ones(2, 3)).sum().backward()
            ddpkit.gather_all_tensors(torch.ones(2 + rank))  # uneven gathers are legitimate
            ddpkit.broadcast_object({"rank": rank})
            ddpkit.barrier()
            return "ok", str(ddpkit.sync_ddp(torch.ones(3)).tolist()), time.monotonic() - start
    except CollectiveMismatchError as error:
        return "mismatch", str(error), time.monotonic() - start
    finally:
        set_debug(None)
    return "no error", "", time.monotonic() - start


@pytest.mark.parametrize(("scenario", "expected"), [
    ("all_reduce shapes", ["sync_ddp(float32, shape (4,)) at ", "sync_ddp(float32, shape (5,)) at "]),
    ("gather dtypes", ["gather_all_tensors(float32) at ", "gather_all_tensors(float64) at "]),
    ("broadcast shapes", ["broadcast(float32, shape (2, 2)) at ", "broadcast(float32, shape (2, 3)) at "]),
    ("order", ["different order", "rank 0 called #", " sync_ddp(float32, shape (2,)) at ", "rank 1 called #", " barrier at "]),
    ("ddp vs collective", ["different order", "DistributedDataParallel backward", "sync_ddp"]),
    ("named barriers", ["different order", "barrier 'before saving' at ", "barrier 'after saving' at "]),
    ("evaluation vs training", ["different order", "DistributedDataParallel broadcast", "DistributedDataParallel backward"]),
])
def test_a_mismatch_raises_on_every_rank_with_both_fingerprints_and_call_sites(
        debug_pool: WorkerPool, scenario: str, expected: list[str]) -> None:
    for kind, message, seconds in debug_pool.run(in_debug_mode, scenario):
        assert kind == "mismatch", (kind, message)
        for part in expected:
            assert part in message, (part, message)
        assert message.count("test_debug.py:") == 2  # both call sites, in this file
        assert seconds < 3


def test_ranks_that_agree_run_normally_in_debug_mode(debug_pool: WorkerPool) -> None:
    assert [kind for kind, *_ in debug_pool.run(in_debug_mode, "all agree")] == ["ok", "ok"]


# Every public collective, with a call that two ranks make differently. The first argument says
# how: "shape"/"dtype" (the same collective, different tensors) or "order" (rank 1 calls another).
def _strategy() -> ddpkit.DDPStrategy:
    return ddpkit.DDPStrategy()


MISMATCHES = {
    "all_gather_ddp_if_available": ("shape", lambda rank: ddpkit.all_gather_ddp_if_available(torch.ones(2 + 2 * rank, 3))),
    "all_gather_object": ("order", lambda rank: ddpkit.all_gather_object(rank)),
    "barrier": ("order", lambda rank: ddpkit.barrier()),
    "broadcast": ("shape", lambda rank: ddpkit.broadcast(torch.ones(2 + rank))),
    "broadcast_object": ("order", lambda rank: ddpkit.broadcast_object(rank)),
    "gather_all_tensors": ("dtype", lambda rank: ddpkit.gather_all_tensors(
        torch.ones(2, dtype=torch.float32 if rank == 0 else torch.float64))),
    "sync_ddp": ("shape", lambda rank: ddpkit.sync_ddp(torch.ones(1 + rank))),
    "sync_ddp_if_available": ("shape", lambda rank: ddpkit.sync_ddp_if_available(torch.ones(1 + rank))),
    "even_batches": ("order", lambda rank: next(ddpkit.even_batches([1, 2]))),
    "DDPStrategy.barrier": ("order", lambda rank: _strategy().barrier("name")),
    "DDPStrategy.broadcast": ("order", lambda rank: _strategy().broadcast(rank)),
    "DDPStrategy.reduce": ("shape", lambda rank: _strategy().reduce(torch.ones(1 + rank))),
}
# Public names of ddpkit.distributed that are not collectives. AllGatherGrad is the autograd
# Function behind all_gather_ddp_if_available(sync_grads=True), which is checked.
NOT_COLLECTIVES = {"DEFAULT_TIMEOUT", "ReduceOpLike", "AllGatherGrad", "destroy_dist_connection",
                   "distributed_available", "get_rank", "get_world_size", "init_dist_connection",
                   "register_ddp_comm_hook"}


def mismatched_call(name: str) -> tuple[str, str]:
    set_debug(True)
    rank = dist.get_rank()
    how, call = MISMATCHES[name]
    try:
        if how == "order" and rank == 1:
            ddpkit.sync_ddp(torch.ones(1))
        else:
            call(rank)
    except CollectiveMismatchError as error:
        return "mismatch", str(error)
    finally:
        set_debug(None)
    return "no error", ""


def test_the_list_of_public_collectives_is_complete() -> None:
    public = set(ddpkit.distributed.__all__) - NOT_COLLECTIVES
    assert public <= set(MISMATCHES), f"add a mismatch case for {sorted(public - set(MISMATCHES))}"


@pytest.mark.parametrize("name", sorted(MISMATCHES))
def test_every_public_collective_raises_on_every_rank_when_ranks_disagree(debug_pool: WorkerPool, name: str) -> None:
    """Not a Gloo abort (all_gather_ddp_if_available with shapes (2, 3) and (4, 3) did that) nor a hang."""
    for kind, message in debug_pool.run(mismatched_call, name, timeout=30):
        assert kind == "mismatch", (name, kind)
        assert "test_debug.py:" in message
