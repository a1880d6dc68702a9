"""benchmarks/gpu_check.py, the one command a GPU machine runs: its dry run on this CPU runs every
part or says why it skipped, within the three minutes the issue gives it, and writes its two
reports; a part that fails or overruns is reported and ended (its whole process group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.timeout(240)
def test_the_dry_run_runs_every_part_or_says_why_not_in_under_three_minutes(tmp_path: Path) -> None:
    start = time.monotonic()
    result = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--dry-run", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=230)
    seconds = time.monotonic() - start
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert seconds < 180, f"the dry run took {seconds:.0f} s"
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = {part["name"]: part for part in report["parts"]}
    assert report["dry_run"] and parts["environment"]["figures"]["torch"]
    for part in parts.values():
        assert part["status"] == "passed" or (part["status"] == "skipped" and part["reason"]), part
    ran = [name for name, part in parts.items() if part["status"] == "passed"]
    assert len(ran) >= 6, ran  # environment, tests, two step worlds, both abort probes
    tests = parts["tests: tests/test_gpu.py"]["figures"]
    assert tests["counts"]["passed"] >= 10
    assert any("in_place_recovery_with_the_models_tensors" in test["name"] and test["outcome"] == "passed"
               for test in tests["tests"])
    assert all(model["ddpkit_over_torch_host"] > 0 for model in
               parts["step: world 2 sharing the device over gloo"]["figures"]["models"].values())
    assert parts["abort: NCCL across ranks, a peer killed"]["figures"]["collective after"]["value"] == 1.0
    summary = (tmp_path / "gpu_check.md").read_text()
    assert "dry run" in summary and "| tests: tests/test_gpu.py | passed |" in summary


def test_a_part_that_overruns_is_ended_with_its_children_and_one_that_fails_keeps_its_output(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(BENCHMARKS))
    marker = tmp_path / "child"
    sleeper = gpu_check.Part("sleeps")
    grandchild = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
                  f"time.sleep(60)']); open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    start = time.monotonic()
    gpu_check.run_bounded(sleeper, [sys.executable, "-c", grandchild], 3, dict(os.environ))
    assert sleeper.status == "timeout" and time.monotonic() - start < 20, sleeper
    pid = int(marker.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists() and "Z" not in _state(pid):
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid), "the part's child outlived it"
    failing = gpu_check.Part("fails")
    gpu_check.run_bounded(failing, [sys.executable, "-c", "print('what went wrong'); raise SystemExit(3)"], 30,
                          dict(os.environ))
    assert failing.status == "failed" and failing.reason == "exit code 3" and "what went wrong" in failing.output
    assert gpu_check.Budget(10).limit(60) <= 10


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "Z"
