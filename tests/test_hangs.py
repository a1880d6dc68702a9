"""Hang diagnosis: a collective that waits too long is reported with the ranks that have not
arrived and every rank's stack (2 Gloo ranks, process-group timeout 10 s, diagnosis after 1 s)."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.diagnostics.failures import FAILURE, record_signer
from ddpkit.diagnostics.hangs import last_report, watch_for_hangs
from ddpkit.testing import WorkerPool

# Beside another test (not ``alone``): the bounds are on seconds the ranks spend asleep or waiting in
# a collective, and the kernel gives a waking process a core within milliseconds though a test beside
# it keeps both busy; the module passed beside the heaviest one, tests/test_real_loops.py.
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
    assert HANG_SECONDS <= seconds <= HANG_SECONDS + 3.5  # the watch looks once a second, answers within one more


def rank_one_is_late_for_a_named_barrier() -> str:
    from helpers import strategy

    s = strategy()
    watch_for_hangs(HANG_SECONDS)
    try:
        if dist.get_rank() == 1:
            # Past the hang time, the watch's once-a-second look and the report's gathering of
            # stacks (up to 2.5 s), with room for a slow machine: 4 s was too short on one.
            time.sleep(7)
        s.barrier("before saving")
        return last_report()
    finally:
        watch_for_hangs(None)


def test_a_strategy_barrier_is_reported_by_its_name() -> None:
    with WorkerPool(2, timeout=60, pg_timeout=10) as pool:
        report, _ = pool.run(rank_one_is_late_for_a_named_barrier)
    assert "barrier 'before saving' at " in report and "test_hangs.py:" in report, report
    assert "Ranks that have not arrived: [1]." in report


def test_on_by_default_with_a_minute_and_off_with_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpkit.diagnostics import hangs

    monkeypatch.delenv("DDPKIT_HANG_SECONDS", raising=False)
    assert hangs._configured_seconds() == hangs.DEFAULT_HANG_SECONDS == 60.0
    monkeypatch.setenv("DDPKIT_HANG_SECONDS", "0")
    assert hangs._configured_seconds() == 0.0


def resume_when_reported(pid_key: str) -> None:
    """Rank 0's helper: once the report is out, send SIGCONT to the rank that stopped itself."""
    store = dist.distributed_c10d._get_default_store()
    pid = int(store.get(pid_key))
    deadline = time.monotonic() + 20
    while not last_report() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(pid, signal.SIGCONT)


def rank_one_is_frozen() -> str:
    watch_for_hangs(HANG_SECONDS)
    try:
        ddpkit.barrier()
        if dist.get_rank() == 1:
            dist.distributed_c10d._get_default_store().set("frozen_pid", str(os.getpid()))
            time.sleep(1.5)  # its watch has published its progress (it does once a second)
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen, as by a debugger or a job control mistake
        else:
            threading.Thread(target=resume_when_reported, args=("frozen_pid",), daemon=True).start()
        ddpkit.sync_ddp(torch.ones(2))
        return last_report()
    finally:
        watch_for_hangs(None)


def test_a_frozen_rank_is_named_and_said_to_be_stopped() -> None:
    with WorkerPool(2, timeout=60, pg_timeout=30) as pool:
        report, _ = pool.run(rank_one_is_frozen)
    assert "Ranks that have not arrived: [1]." in report, report
    assert "--- rank 1: last entered #1 barrier at " in report
    assert "the process is STOPPED (SIGSTOP, or a debugger holds it), so its stack cannot be read" in report, report


def stuck_in_a_c_extension_holding_the_gil() -> str:
    watch_for_hangs(HANG_SECONDS)
    try:
        ddpkit.barrier()
        if dist.get_rank() == 1:
            time.sleep(1.5)  # its watch has published its progress (it does once a second)
            ctypes.PyDLL(None).sleep(6)  # C code that keeps the GIL: no Python thread of this rank runs
        ddpkit.sync_ddp(torch.ones(2))
        deadline = time.monotonic() + 5  # reading rank 1's stack ended its sleep (SIGUSR1): the report may follow
        while dist.get_rank() == 0 and not last_report() and time.monotonic() < deadline:
            time.sleep(0.05)
        return last_report()
    finally:
        watch_for_hangs(None)


def test_a_rank_stuck_in_a_c_extension_is_named_with_its_stack() -> None:
    with WorkerPool(2, timeout=60, pg_timeout=30) as pool:
        report, _ = pool.run(stuck_in_a_c_extension_holding_the_gil)
    assert "Ranks that have not arrived: [1]." in report, report
    assert "most likely inside a C extension that holds the GIL" in report, report
    assert "stuck_in_a_c_extension_holding_the_gil" in report  # its Python stack, written by faulthandler


FROZEN_UNDER_THE_LAUNCHER = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    import torch.distributed as dist
    import ddpkit

    ddpkit.init_dist_connection(ddpkit.detect_environment(), timeout=60)
    ddpkit.barrier()
    if dist.get_rank() == 1:
        time.sleep(1.5)  # its watch has published its progress (it does once a second)
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    try:
        ddpkit.sync_ddp(torch.ones(2))
    except ddpkit.PeerFailedError as error:
        print(f"rank {dist.get_rank()} raised after {time.monotonic() - start:.1f} s naming rank {error.rank}: "
              f"{error.kind}", flush=True)
        raise
    """
)


@pytest.mark.timeout(90)
def test_hang_abort_ends_the_job_naming_the_stuck_rank(tmp_path: Path) -> None:
    """DDPKIT_HANG_ABORT_SECONDS: the frozen rank is the root cause, not the rank that waited for it."""
    (tmp_path / "script.py").write_text(FROZEN_UNDER_THE_LAUNCHER)
    environment = {**os.environ, "DDPKIT_HANG_SECONDS": "1", "DDPKIT_HANG_ABORT_SECONDS": "1"}
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "3", "script.py"],
                            cwd=tmp_path, env=environment, text=True, capture_output=True, timeout=60)
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    root_cause = output[output.index("ddpkit run: rank "):]
    assert root_cause.startswith("ddpkit run: rank 1 "), root_cause
    assert "failed first with HangError: rank 1 did not arrive at collective #2 sync_ddp" in root_cause, root_cause
    assert "the process is STOPPED" in root_cause  # the report travels as the record's traceback
    raised = re.findall(r"rank (\d) raised after ([\d.]+) s naming rank 1: HangError", output)
    assert raised, output
    # Hang report after 1-2 s (the watch looks once a second), the stacks gathered within 2.5 s,
    # the abort 1 s after it (checked once a second), then the next slice of the waits.
    assert all(float(seconds) < 9 for _, seconds in raised), raised
    assert elapsed < 30, (elapsed, output)
    # Ranks 0 and 2 both wait for rank 1: one of them reports, and the other answers its request
    # (never described as silent, and so never signalled for its stack while its Python runs).
    sections = re.findall(r"\[rank (\d)\] --- rank (\d): last entered [^;]*; now (.*)", output)
    reporters = {reporter for reporter, _, _ in sections}
    assert len(reporters) == 1 and reporters <= {"0", "2"}, output
    waiting = ({"0", "2"} - reporters).pop()
    assert f"rank {waiting} has waited" in output and f"rank {reporters.pop()} gathers every rank's stack" in output
    for reporter, about, now in sections:
        if about != "1":
            assert now.startswith("in #2 sync_ddp at script.py:"), (reporter, about, now)


def every_rank_is_in_the_slow_collective() -> tuple[str, bool]:
    """Rank 1 is inside collective #2 as far as the watch can tell (slow inside it, as on a slow
    network) while rank 0 waits for it: the hang abort must not end the job."""
    from ddpkit.diagnostics.hangs import start_hang_watch

    os.environ["DDPKIT_HANG_ABORT_SECONDS"] = "1"
    watch_for_hangs(HANG_SECONDS)
    try:
        ddpkit.barrier()
        if dist.get_rank() == 1:
            watch = start_hang_watch()
            assert watch is not None
            watch.enter("sync_ddp", "a slow network")
            time.sleep(7)  # the report (~2-4 s) and the abort time after it pass
            watch.leave()
        ddpkit.sync_ddp(torch.ones(2))
        published = record_signer().key(FAILURE)
        return last_report(), dist.distributed_c10d._get_default_store().check([published])
    finally:
        watch_for_hangs(None)
        del os.environ["DDPKIT_HANG_ABORT_SECONDS"]


def test_hang_abort_does_not_end_a_job_whose_ranks_are_all_inside_the_collective() -> None:
    with WorkerPool(2, timeout=60, pg_timeout=30) as pool:
        (report, published), (other_report, _) = pool.run(every_rank_is_in_the_slow_collective)
    # Both wait past the hang time in collective #2; the first to claim it reports.
    assert "Ranks that have not arrived: none (they are in it" in report + other_report, (report, other_report)
    assert not published


def three_wait_for_a_late_fourth() -> tuple[str, int]:
    watch_for_hangs(HANG_SECONDS)
    try:
        ddpkit.barrier()
        if dist.get_rank() == 3:
            time.sleep(5)
        ddpkit.sync_ddp(torch.ones(2))
        ddpkit.barrier()
        from ddpkit.store.keys import HANG_REQUESTS

        return last_report(), dist.distributed_c10d._get_default_store().add(record_signer().key(HANG_REQUESTS), 0)
    finally:
        watch_for_hangs(None)


def test_of_the_ranks_waiting_for_a_late_one_one_reports_and_the_others_name_it() -> None:
    """Three ranks wait for a fourth: one claims the report and asks every rank for its stack once;
    each of the others says who reports. Before, each of them asked (three requests, each answered by
    every rank: W^2 stacks in a hang of W ranks) and logged the whole report."""
    with WorkerPool(4, timeout=60, pg_timeout=20) as pool:
        results = pool.run(three_wait_for_a_late_fourth)
    reports = [report for report, _ in results[:3]]
    full = [rank for rank, report in enumerate(reports) if "Ranks that have not arrived: [3]." in report]
    assert len(full) == 1, reports
    for rank, report in enumerate(reports):
        if rank != full[0]:
            assert report.startswith(f"ddpkit: rank {rank} has waited") and \
                f"rank {full[0]} gathers every rank's stack" in report, report
    assert results[3][0] == ""  # the late rank waited in no collective
    assert {requests for _, requests in results} == {1}, results
