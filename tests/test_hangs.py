"""Hang diagnosis: a collective that waits too long is reported with the ranks that have not
arrived and every rank's stack (2 Gloo ranks, process-group timeout 10 s, diagnosis after 1 s)."""

from __future__ import annotations

import re
import time

import torch
import torch.distributed as dist

import ddpkit
from ddpkit.diagnostics.hangs import last_report, watch_for_hangs
from ddpkit.testing import WorkerPool

HANG_SECONDS = 1.0


def rank_one_is_late() -> tuple[str, float]:
    watch_for_hangs(HANG_SECONDS)
    try:
        ddpkit.barrier()  # both arrive: collective #1
        if dist.get_rank() == 1:
            time.sleep(4)  # stuck somewhere else (data loading, say) while rank 0 waits
        start = time.monotonic()
        ddpkit.sync_ddp(torch.ones(2))
        return last_report(), time.monotonic() - start
    finally:
        watch_for_hangs(None)


def test_a_late_rank_is_named_with_the_stacks_of_every_rank() -> None:
    with WorkerPool(2, timeout=60, pg_timeout=10) as pool:
        (report, waited), (late_rank_report, _) = pool.run(rank_one_is_late)
    assert late_rank_report == ""  # rank 1 never waited in a collective
    assert "rank 0 has waited" in report and "collective #2 sync_ddp at " in report, report
    assert "Ranks that have not arrived: [1]." in report
    assert "--- rank 0: last entered #2 sync_ddp at " in report
    assert "--- rank 1: last entered #1 barrier at " in report
    assert "time.sleep(4)" in report  # rank 1's stack shows where it is
    assert "ddpkit.sync_ddp(torch.ones(2))" in report  # and rank 0's, where it waits
    seconds = float(re.search(r"has waited ([\d.]+) s", report).group(1))  # type: ignore[union-attr]
    assert HANG_SECONDS <= seconds <= HANG_SECONDS + 2


def rank_one_is_late_for_a_named_barrier() -> str:
    from test_strategy import strategy

    s = strategy()
    watch_for_hangs(HANG_SECONDS)
    try:
        if dist.get_rank() == 1:
            time.sleep(4)  # past the hang time and the report's gathering of stacks
        s.barrier("before saving")
        return last_report()
    finally:
        watch_for_hangs(None)


def test_a_strategy_barrier_is_reported_by_its_name() -> None:
    with WorkerPool(2, timeout=60, pg_timeout=10) as pool:
        report, _ = pool.run(rank_one_is_late_for_a_named_barrier)
    assert "barrier 'before saving' at " in report and "test_hangs.py:" in report, report
    assert "Ranks that have not arrived: [1]." in report
