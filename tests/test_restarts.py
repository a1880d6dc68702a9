"""`ddpkit run --max-restarts N` (issue 14, item 1): after a worker fails, every worker is started
again, up to N times, each start told its number; the job's exit code and summary are the last
failure's; a stop signal is never retried. Real launchers and workers, 2 Gloo ranks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# Rank 1 fails in the first two starts; the third trains (one all-reduce) and succeeds.
FLAKY = textwrap.dedent(
    """
    import os
    import torch
    import ddpkit

    ddpkit.init_dist_connection(ddpkit.detect_environment(), timeout=30)
    rank, start = int(os.environ["RANK"]), int(os.environ["DDPKIT_RESTART_COUNT"])
    print(f"rank {rank} start {start} torchelastic {os.environ['TORCHELASTIC_RESTART_COUNT']} "
          f"of {os.environ['TORCHELASTIC_MAX_RESTARTS']}", flush=True)
    if rank == 1 and start < 2:
        raise ValueError(f"broken in start {start}")
    total = ddpkit.sync_ddp(torch.ones(1), reduce_op="sum").item()
    print(f"rank {rank} total {total:g}", flush=True)
    ddpkit.destroy_dist_connection()
    """
)

SLEEPS = textwrap.dedent(
    """
    import os, time
    open(f"started{os.environ['RANK']}.{os.environ['DDPKIT_RESTART_COUNT']}", "w").close()
    time.sleep(60)
    """
)


def run(folder: Path, *args: str, **variables: str) -> subprocess.CompletedProcess[str]:
    (folder / "flaky.py").write_text(FLAKY)
    return subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", *args, "flaky.py"],
                          cwd=folder, text=True, capture_output=True, timeout=120, env={**os.environ, **variables})


def test_the_workers_are_started_again_until_they_succeed(tmp_path: Path) -> None:
    result = run(tmp_path, "--max-restarts", "2")
    assert result.returncode == 0, result.stderr
    starts = re.findall(r"rank (\d) start (\d) torchelastic (\d) of 2", result.stdout)
    assert sorted(starts) == sorted((rank, start, start) for rank in "01" for start in "012"), result.stdout
    assert result.stdout.count("total 2") == 2  # the third start trained, with both ranks
    # Each restart is logged after the summary naming its root cause.
    positions = []
    for start in (0, 1):
        summary = re.search(rf"ddpkit run: rank 1 \(local rank 1, pid \d+\) failed first with ValueError: broken in "
                            rf"start {start}", result.stderr)
        assert summary is not None, result.stderr
        restart = result.stderr.index(f"restarting all 2 workers (restart {start + 1} of 2)")
        positions += [summary.start(), restart]
    assert positions == sorted(positions), result.stderr


def test_when_the_restarts_are_spent_the_last_failure_ends_the_job(tmp_path: Path) -> None:
    result = run(tmp_path, DDPKIT_MAX_RESTARTS="1")  # the environment variable, as every flag has
    assert result.returncode == 1
    assert "restart 1 of 1" in result.stderr and "broken in start 1" in result.stderr, result.stderr
    assert result.stderr.rstrip().endswith("no restart left (--max-restarts=1): ending the job."), result.stderr
    assert "total" not in result.stdout


def test_without_max_restarts_nothing_is_restarted(tmp_path: Path) -> None:
    result = run(tmp_path)
    assert result.returncode == 1
    assert "broken in start 0" in result.stderr, result.stderr
    assert "restarting" not in result.stderr and "no restart left" not in result.stderr
    assert "start 1" not in result.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_is_not_retried(tmp_path: Path, sig: int) -> None:
    (tmp_path / "sleeps.py").write_text(SLEEPS)
    launcher = subprocess.Popen([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", "--max-restarts",
                                 "3", "sleeps.py"], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"started{rank}.0").exists() for rank in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.05)
    launcher.send_signal(sig)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + sig, err
    assert not list(tmp_path.glob("started*.1")) and "restarting" not in err
