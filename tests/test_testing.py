"""The multi-rank harness itself: results by rank, failures surface in seconds, the pool recovers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import assert_gone, worker_pids

from ddpkit import guard
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


def rank_one_fails_first_and_lives_on_while_rank_zero_answers_first() -> None:
    if dist.get_rank() == 1:
        try:
            with guard():  # records the failure when it happens
                raise ValueError("the real cause on rank 1")
        finally:
            time.sleep(0.6)  # logging, cleaning up: it answers after its witness
    time.sleep(0.1)
    raise RuntimeError("rank 0 lost its peer")


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


def test_the_rank_that_failed_first_is_named_not_the_one_that_answered_first(pool2: WorkerPool) -> None:
    with pytest.raises(RankFailedError) as info:
        pool2.run(rank_one_fails_first_and_lives_on_while_rank_zero_answers_first)
    assert info.value.rank == 1, info.value
    assert "ValueError: the real cause on rank 1" in str(info.value)
    assert pool2.run(rank_and_size) == [(0, 2), (1, 2)]


def test_a_hung_rank_is_bounded_by_the_timeout_and_its_stack_shown(pool2: WorkerPool, capfd) -> None:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        pool2.run(rank_one_hangs, timeout=2)
    assert time.monotonic() - start < 4
    assert 1 in info.value.ranks
    err = capfd.readouterr().err
    assert "stack of hung rank 1" in err and "in rank_one_hangs" in err, err
    assert pool2.run(rank_and_size) == [(0, 2), (1, 2)]


POOL_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist
    from ddpkit.testing import WorkerPool

    # The workers run this file's top level too (to find its functions); rank 1's is slow, as a
    # script with a heavy import on a loaded machine. The pool's error file names the rank.
    if sys.argv[1:2] == ["slow-start"] and os.environ.get("DDPKIT_ERROR_FILE", "").endswith("rank1.json"):
        time.sleep(4)


    def write_pid_and_block(folder):
        with open(os.path.join(folder, f"pid{dist.get_rank()}"), "w") as handle:
            handle.write(str(os.getpid()))
        time.sleep(60)


    def rank_and_size():
        return dist.get_rank(), dist.get_world_size()


    def priority():
        return os.getpriority(os.PRIO_PROCESS, 0)


    if __name__ == "__main__":
        if sys.argv[1] == "block":
            with WorkerPool(2, timeout=120) as pool:
                pool.run(write_pid_and_block, os.path.dirname(os.path.abspath(__file__)))
        elif sys.argv[1] == "nice":  # a pool's priorities, then another's after the process ran ``nice``
            with WorkerPool(2, timeout=60) as pool:
                print(pool.run(priority))
            os.nice(3)
            with WorkerPool(2, timeout=60) as pool:
                print(pool.run(priority))
        else:
            with WorkerPool(2, timeout=60, pg_timeout=1) as pool:
                print(pool.run(rank_and_size))
    """
)


def test_workers_of_a_pool_die_with_the_process_that_started_it(tmp_path: Path) -> None:
    (tmp_path / "pool_script.py").write_text(POOL_SCRIPT)
    script = subprocess.Popen([sys.executable, "pool_script.py", "block"], cwd=tmp_path)
    try:
        pids = worker_pids(tmp_path, 2)  # each is busy in a function, not waiting for the next one
    finally:
        script.kill()
        script.wait()
    assert_gone(pids)


def test_a_slow_starting_rank_is_waited_for_whatever_the_process_group_timeout(tmp_path: Path) -> None:
    (tmp_path / "pool_script.py").write_text(POOL_SCRIPT)
    done = subprocess.run([sys.executable, "pool_script.py", "slow-start"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[(0, 2), (1, 2)]"


def test_a_forked_pool_worker_has_the_priority_its_pool_has_now(tmp_path: Path) -> None:
    """As a fresh interpreter would inherit it: not the one the template had when it started
    (the process ran ``nice`` between its first pool and its second)."""
    (tmp_path / "pool_script.py").write_text(POOL_SCRIPT)
    done = subprocess.run([sys.executable, "pool_script.py", "nice"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=90)
    assert done.returncode == 0, done.stderr
    start = os.getpriority(os.PRIO_PROCESS, 0)
    assert done.stdout.split("\n")[:2] == [str([start] * 2), str([start + 3] * 2)], done.stdout


def test_unpicklable_functions_are_refused_before_sending(pool2: WorkerPool) -> None:
    with pytest.raises(TypeError, match="module-level function"):
        pool2.run(lambda: 1)


def test_pool_rejects_bad_size() -> None:
    with pytest.raises(ValueError, match="world_size=0"):
        WorkerPool(0)


def parent_pid() -> int:
    return os.getppid()


def test_the_pools_of_a_process_fork_their_workers_from_one_template() -> None:
    """A pool's workers are forked from the template this process's first pool started
    (``workers.pool``): a second pool's ranks are forks of the same process, not fresh
    interpreters, each of which would import torch again."""
    with WorkerPool(2) as first:
        parents = first.run(parent_pid)
    with WorkerPool(3) as second:
        assert second.run(parent_pid) == [parents[0]] * 3
    assert parents == [parents[0]] * 2 and parents[0] != os.getpid()


def test_a_pool_started_from_another_thread_or_with_forks_off_starts_fresh_interpreters(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel would end a template with the thread that started it, and the workers of every
    pool with it: a pool started from another thread starts its workers itself, as does one
    started with ``DDPKIT_FORK_WORKERS=0``."""
    parents: list[list[int]] = []

    def run_a_pool() -> None:
        with WorkerPool(2) as pool:
            parents.append(pool.run(parent_pid))

    thread = threading.Thread(target=run_a_pool)
    thread.start()
    thread.join(120)
    monkeypatch.setenv("DDPKIT_FORK_WORKERS", "0")
    run_a_pool()
    assert parents == [[os.getpid()] * 2] * 2


def rank_says(word: str) -> None:
    print(f"{word} from rank {dist.get_rank()}", flush=True)
    print(f"{word} on the error stream of rank {dist.get_rank()}", file=sys.stderr, flush=True)


def test_a_forked_pool_worker_writes_to_the_streams_its_pool_has_now(capfd, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """As a fresh interpreter would: not to those the template had when it started (pytest
    captures each test's output by redirecting the process's descriptors 1 and 2)."""
    elsewhere = open(tmp_path / "elsewhere", "w")
    saved = os.dup(1), os.dup(2)
    os.dup2(elsewhere.fileno(), 1)
    os.dup2(elsewhere.fileno(), 2)
    try:
        with WorkerPool(2) as pool:  # the template starts here, if no pool of this process started it before
            pool.run(parent_pid)
    finally:
        for stream, descriptor in enumerate(saved, start=1):
            os.dup2(descriptor, stream)
            os.close(descriptor)
        elsewhere.close()
    with WorkerPool(2) as pool:
        pool.run(rank_says, "hello")
    out, err = capfd.readouterr()
    assert sorted(line for line in out.splitlines() if "hello" in line) == ["hello from rank 0", "hello from rank 1"]
    assert "hello on the error stream of rank 1" in err
    assert "hello" not in (tmp_path / "elsewhere").read_text()

