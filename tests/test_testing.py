"""The multi-rank harness itself: results by rank, failures surface in seconds, the pool recovers."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist

from ddpkit.testing import RankFailedError, RankTimeoutError, WorkerPool


def rank_and_size() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def rank_one_raises_while_rank_zero_waits() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 would wait here until the process-group timeout


def rank_one_is_killed() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def rank_zero_reports_a_reset_before_rank_one_is_seen_dead() -> None:
    if dist.get_rank() == 1:
        time.sleep(0.2)  # the order the pool sees under load: the witness's error first
        os.kill(os.getpid(), signal.SIGKILL)
    raise ConnectionResetError("Read error: Connection reset by peer")


def rank_one_hangs() -> None:
    if dist.get_rank() == 1:
        time.sleep(60)
    dist.barrier()


def test_results_come_back_by_rank(pool: WorkerPool) -> None:
    size = pool.world_size
    assert pool.run(rank_and_size) == [(rank, size) for rank in range(size)]


def test_a_failing_rank_surfaces_its_traceback_in_seconds(pool2: WorkerPool) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        pool2.run(rank_one_raises_while_rank_zero_waits)
    assert time.monotonic() - start < 5  # not the 20 s process-group timeout
    assert info.value.rank == 1
    assert "rank 1 of 2" in str(info.value)
    assert "ValueError: rank one is broken" in str(info.value)
    assert "rank_one_raises_while_rank_zero_waits" in str(info.value)
    assert pool2.run(rank_and_size) == [(0, 2), (1, 2)]  # a fresh pool for the next call


def test_a_killed_rank_is_named_with_its_signal(pool2: WorkerPool) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="(?s)rank 1 of 2.*was killed by signal SIGKILL"):
        pool2.run(rank_one_is_killed)
    assert time.monotonic() - start < 5
    assert pool2.run(rank_and_size) == [(0, 2), (1, 2)]


def test_a_peer_that_died_is_named_rather_than_the_rank_that_saw_its_connection_reset(pool2: WorkerPool) -> None:
    with pytest.raises(RankFailedError, match="(?s)rank 1 of 2.*was killed by signal SIGKILL"):
        pool2.run(rank_zero_reports_a_reset_before_rank_one_is_seen_dead)
    assert pool2.run(rank_and_size) == [(0, 2), (1, 2)]


def test_a_hung_rank_is_bounded_by_the_timeout(pool2: WorkerPool) -> None:
    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        pool2.run(rank_one_hangs, timeout=2)
    assert time.monotonic() - start < 4
    assert 1 in info.value.ranks
    assert pool2.run(rank_and_size) == [(0, 2), (1, 2)]


def test_unpicklable_functions_are_refused_before_sending(pool2: WorkerPool) -> None:
    with pytest.raises(TypeError, match="module-level function"):
        pool2.run(lambda: 1)


def test_pool_rejects_bad_size() -> None:
    with pytest.raises(ValueError, match="world_size=0"):
        WorkerPool(0)
