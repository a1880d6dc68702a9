"""Warm starts (``workers.worker_template``): ``ddpkit run`` forks a script's workers from one
process per node that imported torch once. Each forked worker must be the worker a fresh
interpreter is (its rank's variables, working directory, arguments, thread count, its own random
state), exit codes and signals must reach the launcher as before, restarts reuse the template, and
nothing is left behind when the launcher or the template is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import assert_gone, command_line, descendants, parent_pid, waiting_spares

from ddpkit.workers.worker_template import (
    forking_allowed,
    imported_packages,
    only_the_standard_library,
    starts_differently,
)

pytestmark = pytest.mark.skipif(forking_allowed(os.environ) is not None,
                                reason=f"workers are not forked here: {forking_allowed(os.environ)}")

_REPORT = """
import json, os, sys, time
import numpy, torch
ppid = os.getppid()
with open(f"/proc/{ppid}/cmdline", "rb") as handle:
    parent = handle.read().split(b"\\0")
with open(f"/proc/{ppid}/stat") as handle:
    grandparent = int(handle.read().rsplit(")", 1)[1].split()[1])
print(json.dumps({"attempt": int(os.environ["DDPKIT_RESTART_COUNT"]), "rank": int(os.environ["RANK"]),
                  "launcher": int(os.environ["DDPKIT_LAUNCHER_PID"]), "grandparent": grandparent,
                  "pid": os.getpid(), "parent": ppid, "forked": b"--template" in parent, "cwd": os.getcwd(),
                  "argv": sys.argv, "threads": torch.get_num_threads(), "omp": os.environ["OMP_NUM_THREADS"],
                  "random": numpy.random.randint(1 << 30)}), flush=True)
"""


def _run(tmp_path: Path, body: str, *flags: str, env: dict[str, str] | None = None,
         timeout: float = 90) -> subprocess.CompletedProcess[str]:
    (tmp_path / "job.py").write_text(_REPORT + body)
    return subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", *flags, "job.py", "--flag"],
                          cwd=tmp_path, env={**os.environ, **(env or {})}, text=True, capture_output=True,
                          timeout=timeout)


def _reports(stdout: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_forked_workers_are_each_their_own_worker_and_a_restart_forks_from_the_same_template(tmp_path: Path) -> None:
    body = ("if os.environ['DDPKIT_RESTART_COUNT'] == '0' and os.environ['RANK'] == '1':\n"
            "    time.sleep(0.5)\n"
            "    sys.exit(3)\n")
    result = _run(tmp_path, body, "--max-restarts", "1")
    assert result.returncode == 0, result.stderr
    assert "rank 1 (local rank 1" in result.stderr and "exited with code 3" in result.stderr, result.stderr
    reports = _reports(result.stdout)
    assert sorted((report["attempt"], report["rank"]) for report in reports) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(report["forked"] for report in reports), reports
    assert len({report["parent"] for report in reports}) == 1, "the restart forked from another template"
    assert len({report["pid"] for report in reports}) == 4
    assert all(report["cwd"] == str(tmp_path) and report["argv"] == ["job.py", "--flag"] for report in reports)
    assert all(report["threads"] == int(str(report["omp"])) for report in reports), reports
    assert len({report["random"] for report in reports}) == 4, "the workers share numpy's random state"
    # DDPKIT_LAUNCHER_PID names the launcher (a script may signal it), not the template between them.
    assert all(report["launcher"] == report["grandparent"] for report in reports), reports


def test_a_killed_launcher_takes_the_template_and_its_forked_workers_with_it(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(_REPORT + "time.sleep(120)\n")
    launcher = subprocess.Popen([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", "job.py"],
                                cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert launcher.stdout is not None
    reports = [json.loads(launcher.stdout.readline()) for _ in range(2)]
    pids = [int(report["pid"]) for report in reports] + [int(reports[0]["parent"])]
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=10)
    assert_gone(pids, within=10)


def test_a_template_killed_under_its_workers_ends_the_attempt_and_the_restart_starts_fresh_interpreters(
        tmp_path: Path) -> None:
    body = ("if os.environ['DDPKIT_RESTART_COUNT'] == '0':\n"
            "    time.sleep(120)\n")
    (tmp_path / "job.py").write_text(_REPORT + body)
    launcher = subprocess.Popen([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", "--max-restarts", "1",
                                 "job.py"], cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert launcher.stdout is not None
    first = [json.loads(launcher.stdout.readline()) for _ in range(2)]
    start = time.monotonic()
    os.kill(int(first[0]["parent"]), signal.SIGKILL)
    rest, err = launcher.communicate(timeout=60)
    assert time.monotonic() - start < 15
    assert launcher.returncode == 0, err
    again = _reports(rest)
    assert sorted(report["rank"] for report in again) == [0, 1] and not any(report["forked"] for report in again)
    assert "the next workers start as fresh interpreters" in err, err


def test_with_fork_workers_off_each_worker_is_a_fresh_interpreter(tmp_path: Path) -> None:
    result = _run(tmp_path, "", env={"DDPKIT_FORK_WORKERS": "0"})
    assert result.returncode == 0, result.stderr
    assert [report["forked"] for report in _reports(result.stdout)] == [False, False]


def test_a_variable_read_when_an_interpreter_starts_that_differs_rules_out_a_fork() -> None:
    template = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "RANK": "0", "PYTHONPATH": "a"}
    assert starts_differently(template, {**template, "RANK": "1", "MASTER_PORT": "9"}) == []
    assert starts_differently(template, {**template, "OMP_NUM_THREADS": "2", "PYTHONPATH": "b",
                                         "TORCH_CPP_LOG_LEVEL": "INFO", "LD_PRELOAD": "x"}) == [
        "LD_PRELOAD", "OMP_NUM_THREADS", "PYTHONPATH", "TORCH_CPP_LOG_LEVEL"]
    assert starts_differently(template, {key: value for key, value in template.items() if key != "PYTHONPATH"}) == [
        "PYTHONPATH"]
    assert forking_allowed({"DDPKIT_FORK_WORKERS": "0"}) == "DDPKIT_FORK_WORKERS=0"


_STANDARD_LIBRARY_ONLY = """
import os, sys
with open(f"/proc/{os.getppid()}/cmdline", "rb") as handle:
    forked = b"--template" in handle.read()
print(f"rank {os.environ['RANK']}: forked {forked}, compiler stack imported {'torch._dynamo' in sys.modules}")
"""


def test_the_template_of_a_script_of_the_standard_library_alone_imports_no_more_than_the_bootstrap(
        tmp_path: Path) -> None:
    """A script that only starts, writes or waits (a test's, a wrapper's) gets forked workers too,
    but its template skips torch's compiler stack and ddpkit's strategy (seconds of CPU at each
    start); a script that imports torch gets them ahead, as before."""
    (tmp_path / "plain.py").write_text(_STANDARD_LIBRARY_ONLY)
    result = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", "plain.py"],
                            cwd=tmp_path, text=True, capture_output=True, timeout=90)
    assert result.returncode == 0, result.stderr
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("rank")) == [
        f"rank {rank}: forked True, compiler stack imported False" for rank in (0, 1)], result.stdout
    (tmp_path / "with_torch.py").write_text("import torch\n" + _STANDARD_LIBRARY_ONLY)
    result = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "1", "with_torch.py"],
                            cwd=tmp_path, text=True, capture_output=True, timeout=90)
    assert "rank 0: forked True, compiler stack imported True" in result.stdout, result.stdout + result.stderr
    assert only_the_standard_library(imported_packages([str(tmp_path / "plain.py")]))
    (tmp_path / "relative.py").write_text("import os\nfrom . import model\n")
    assert not only_the_standard_library(imported_packages([str(tmp_path / "relative.py")]))
    assert not only_the_standard_library(imported_packages([str(tmp_path / "missing.py")]))


_COLLECTIONS = """
import gc, json
print(json.dumps({"collector_on": gc.isenabled(), "passes": sum(stats["collections"] for stats in gc.get_stats())}))
"""

# Importing torch with the collector running takes it 400 passes or more (700 with the compiler
# stack and ddpkit's strategy); paused, the interpreter's own start and the bootstrap's take 30-40.
_FEW_PASSES = 150


def test_every_process_that_imports_torch_for_ddpkit_does_so_with_the_collector_paused_and_runs_on_with_it(
        tmp_path: Path) -> None:
    """``ddpkit._collector``: a forked worker (its template imported torch and the rest), a fresh
    interpreter's bootstrap, a launcher's store client and the store host import torch with the
    garbage collector paused (a fifth of the import's CPU), and the script, the launcher and the
    store then run with it on as usual."""
    (tmp_path / "report.py").write_text("import torch\n" + _COLLECTIONS)
    quietly = "from ddpkit.store.client import import_distributed; import_distributed()\n"
    serving = "from ddpkit.launching.store_host import _serve; store = _serve('127.0.0.1', 0, None)\n"
    commands = {"forked": [sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "1", "report.py"],
                "fresh": [sys.executable, "-m", "ddpkit.workers.worker", "report.py"],
                "store client": [sys.executable, "-c", quietly + _COLLECTIONS],
                "store host": [sys.executable, "-c", serving + _COLLECTIONS]}
    started = {kind: subprocess.Popen(command, cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for kind, command in commands.items()}
    reports = {}
    try:
        for kind, process in started.items():
            out, err = process.communicate(timeout=120)
            assert process.returncode == 0, f"{kind}: {err[-3000:]}"
            reports[kind] = _reports(out)[-1]
    finally:
        for process in started.values():
            process.kill()
            process.wait()
    assert all(report["collector_on"] for report in reports.values()), reports
    assert all(report["passes"] < _FEW_PASSES for report in reports.values()), reports


def test_lightning_imported_by_the_template_knows_each_workers_rank(tmp_path: Path) -> None:
    """Lightning notes the rank (``rank_zero_only.rank``) when it is imported: in the template that
    was before any rank; a forked worker must see its own, as a fresh interpreter would."""
    pytest.importorskip("lightning", reason="Lightning is not installed (pip install lightning)")
    body = ("import lightning\n"
            "from lightning.pytorch.utilities import rank_zero_only\n"
            "print(json.dumps({'lightning_rank': rank_zero_only.rank, 'env_rank': int(os.environ['RANK'])}), "
            "flush=True)\n")
    result = _run(tmp_path, body)
    assert result.returncode == 0, result.stderr
    reports = _reports(result.stdout)
    assert all(report["forked"] for report in reports if "forked" in report), reports
    ranks = [(report["lightning_rank"], report["env_rank"]) for report in reports if "lightning_rank" in report]
    assert sorted(ranks) == [(0, 0), (1, 1)], ranks


def test_a_template_that_dies_alone_is_a_crash_that_restarts_not_a_preemption(tmp_path: Path) -> None:
    """The template killed by itself (the out-of-memory killer, say) takes its workers with it as a
    crash (SIGKILL), which ``--max-restarts`` restarts; a SIGTERM would have had a training script
    save and stop as if preempted (exit 75), and the job would have ended there."""
    from test_preemption import PREEMPTIBLE

    (tmp_path / "preemptible.py").write_text(PREEMPTIBLE)
    launcher = subprocess.Popen([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", "--max-restarts", "1",
                                 "preemptible.py"], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env={**os.environ, "STEPS": "60", "STEP_SECONDS": "0.05"})
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"step{rank}").exists() for rank in (0, 1)):
        assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate()
        time.sleep(0.05)
    template = [pid for pid in descendants(launcher.pid)
                if parent_pid(pid) == launcher.pid and "--template" in command_line(pid)]
    assert len(template) == 1
    os.kill(template[0], signal.SIGKILL)
    _, err = launcher.communicate(timeout=90)
    assert launcher.returncode == 0, err
    assert not list(tmp_path.glob("stopped*")) and "restarting all 2 workers" in err, err



_SPARES_REPORT = """
import json, os, sys
with open(f"/proc/{os.getppid()}/cmdline", "rb") as handle:
    parent = handle.read()
with open(os.environ["REPORT"], "w") as handle:
    json.dump({"rank": os.environ["RANK"], "forked": b"--template" in parent, "argv": sys.argv,
               "input": sys.stdin.read()}, handle)
"""


def test_a_warm_spare_is_forked_from_the_template_and_runs_the_script_as_the_rank_it_is_given(tmp_path: Path) -> None:
    """A spare (in-place recovery) forked from the node's template: warm at once, named while it
    waits (its command line is the template's), given its rank on the pipe from its launcher, then
    the script's worker; a spare whose pipe is closed unused leaves with 0."""
    from ddpkit.workers.processes import SPARE, WorkerProcesses
    from ddpkit.workers.worker_template import WorkerTemplate

    (tmp_path / "job.py").write_text(_SPARES_REPORT)
    command = [sys.executable, "-m", "ddpkit.workers.worker", SPARE, str(tmp_path / "job.py"), "--flag"]
    template = WorkerTemplate(os.environ)
    try:
        with WorkerProcesses("spares", template=template) as workers:
            taking, leaving = (workers.start_spare(command, dict(os.environ)) for _ in range(2))
            deadline = time.monotonic() + 60
            while not {taking.process.pid, leaving.process.pid} <= set(waiting_spares(os.getpid())):
                assert time.monotonic() < deadline, waiting_spares(os.getpid())
                time.sleep(0.05)
            assert template._process is not None
            assert {parent_pid(taking.process.pid), parent_pid(leaving.process.pid)} == {template._process.pid}
            workers.assign(taking, {"RANK": "3", "REPORT": str(tmp_path / "report.json")}, rank=3, local_rank=0)
            assert taking.process.wait(timeout=30) == 0
            assert leaving.process.stdin is not None
            leaving.process.stdin.close()
            assert leaving.process.wait(timeout=30) == 0
    finally:
        template.close()
    report = json.loads((tmp_path / "report.json").read_text())
    assert report == {"rank": "3", "forked": True, "argv": [str(tmp_path / "job.py"), "--flag"], "input": ""}, report


def test_a_template_still_importing_says_a_fork_would_wait_and_the_fork_is_at_once_when_it_says_not(
        tmp_path: Path) -> None:
    """``forks_at_once``: what a spare node asks before it starts its warm spares (it must not wait
    for the template's imports while a lost node's place is there to claim)."""
    from ddpkit.workers.processes import SPARE
    from ddpkit.workers.worker_template import WorkerTemplate

    (tmp_path / "job.py").write_text(_SPARES_REPORT)
    command = [sys.executable, "-m", "ddpkit.workers.worker", SPARE, str(tmp_path / "job.py")]
    template = WorkerTemplate(os.environ)
    try:
        assert template.forks_at_once()  # nothing started: a fork would start a fresh interpreter or the template
        template.prepare([*command[:3], *command[4:]], dict(os.environ))
        assert not template.forks_at_once()  # importing torch: a second or more
        deadline = time.monotonic() + 60
        while not template.forks_at_once():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        started = time.monotonic()
        spare = template.fork(command, dict(os.environ), with_input=True)
        assert spare is not None and time.monotonic() - started < 10.0  # no import to wait for (a loaded machine is slow)
        assert spare.stdin is not None
        spare.stdin.close()  # unused: it leaves
        assert spare.wait(timeout=30) == 0
    finally:
        template.close()
