"""The launcher is never stuck (issue 30, item 4): SIGINT and SIGTERM end it within seconds in
every phase (the rendezvous, connecting to the job's store, running, restarting, replacing a
rank in place); workers that all finished are a finished job even when the store is not there;
a store host that fails to start or dies ends the job at once, naming it; torch's C++ retry
traces never reach the console. Real launchers; the workers import no torch unless they connect.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from job_processes import job_marker, processes_of_job

from ddpkit.environments import find_free_port

# Says it started, then waits: for the test, or (STOP_AFTER) a few seconds.
WAITS = textwrap.dedent(
    """
    import os, time
    open(f"started{os.environ['RANK']}.{os.environ['DDPKIT_RESTART_COUNT']}", "w").close()
    if os.environ.get("FAIL_RANK") == os.environ["RANK"]:
        raise SystemExit(f"rank {os.environ['RANK']} fails on purpose")
    time.sleep(float(os.environ.get("STOP_AFTER", "60")))
    """
)

# A DDPStrategy loop under in-place recovery; rank 1 kills itself at step 2 of the first
# generation, and its replacement (SLOW_REPLACEMENT) waits before it sets up.
IN_PLACE = textwrap.dedent(
    """
    import os, signal, time
    import torch
    import ddpkit
    if os.environ.get("DDPKIT_GENERATION", "0") != "0":
        open("replacement", "w").close()
        time.sleep(float(os.environ.get("SLOW_REPLACEMENT", "0")))
    strategy = ddpkit.DDPStrategy()
    model = torch.nn.Linear(4, 1)
    model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in strategy.epochs(1):
        for x in strategy.batches([torch.ones(2, 4)] * 200):
            with strategy.step():
                optimizer.zero_grad()
                strategy.backward(model(x).sum())
                optimizer.step()
            if strategy.progress.batch == 2 and strategy.global_rank == 1 and os.environ.get("DDPKIT_GENERATION", "0") == "0":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.05)
    strategy.teardown()
    """
)


def launch(folder: Path, *arguments: str, log: str = "launcher", **variables: str) -> subprocess.Popen[bytes]:
    """``ddpkit run arguments`` with its output in ``folder/<log>.out`` and ``.err``."""
    with open(folder / f"{log}.out", "wb") as out, open(folder / f"{log}.err", "wb") as err:
        return subprocess.Popen([sys.executable, "-m", "ddpkit", "run", *arguments], cwd=folder, stdout=out,
                                stderr=err, env={**os.environ, **variables})


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def stopped_within(launcher: subprocess.Popen[bytes], sig: int, seconds: float) -> int:
    """Send ``sig``; the launcher's exit code, which must come within ``seconds``."""
    launcher.send_signal(sig)
    start = time.monotonic()
    try:
        code = launcher.wait(timeout=seconds + 30)
    finally:
        launcher.kill()
        launcher.wait()
    assert time.monotonic() - start < seconds, f"the launcher took {time.monotonic() - start:.1f} s to end"
    return code


def store_host_pid(job: dict[str, str]) -> int:
    (name, value), = job.items()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline, open(f"/proc/{entry}/environ", "rb") as environ:
                if b"ddpkit.launching.store_host" in cmdline.read() and f"{name}={value}".encode() in environ.read():
                    return int(entry)
        except OSError:
            continue
    raise AssertionError("no store host found")


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    (tmp_path / "waits.py").write_text(WAITS)
    (tmp_path / "in_place.py").write_text(IN_PLACE)
    return tmp_path


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_a_launcher_waiting_at_the_rendezvous(folder: Path, sig: int, code: int) -> None:
    """The other node never comes; the launcher (which hosts the endpoint) ends at once."""
    job = job_marker("stuck")
    launcher = launch(folder, "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                      f"127.0.0.1:{find_free_port()}", "--rdzv-id", "alone", "waits.py", **job)
    wait_until(lambda: b"waiting for 1 more node" in (folder / "launcher.err").read_bytes(), 30, "at the rendezvous")
    assert stopped_within(launcher, sig, 5.0) == code
    err = (folder / "launcher.err").read_text()
    assert f"received {signal.Signals(sig).name} while waiting on the job's store" in err, err
    assert processes_of_job(job, wait_seconds=5.0) == []


def test_a_signal_ends_a_launcher_connecting_to_node_0s_store_and_torchs_retries_stay_quiet(folder: Path) -> None:
    """Node 1 started alone, with restarts: its workers run while it waits for node 0's store."""
    job = job_marker("stuck")
    launcher = launch(folder, "--nnodes", "2", "--node-rank", "1", "--master-port", str(find_free_port()),
                      "--max-restarts", "1", "waits.py", **job)
    wait_until(lambda: (folder / "started1.0").exists(), 30, "node 1's worker started")
    time.sleep(5)  # two tries or more to reach the store
    assert stopped_within(launcher, signal.SIGINT, 6.0) == 130
    err = (folder / "launcher.err").read_text()
    assert "stopped waiting for the job's store" in err and "received SIGINT" in err, err
    for trace in ("frame #", "TCPStore.cpp", "socket.cpp", "Exception raised from"):
        assert trace not in err, err
    assert processes_of_job(job, wait_seconds=5.0) == []


def test_workers_that_all_finished_are_a_finished_job_without_node_0s_store(folder: Path) -> None:
    job = job_marker("stuck")
    launcher = launch(folder, "--nnodes", "2", "--node-rank", "1", "--master-port", str(find_free_port()),
                      "--max-restarts", "1", "waits.py", STOP_AFTER="0", **job)
    start = time.monotonic()
    code = launcher.wait(timeout=60)
    assert code == 0 and time.monotonic() - start < 20, (folder / "launcher.err").read_text()
    assert "every worker of this node ended" in (folder / "launcher.err").read_text()
    assert processes_of_job(job, wait_seconds=5.0) == []


def test_a_signal_ends_a_launcher_waiting_for_another_node_to_restart(folder: Path) -> None:
    """Node 1's launcher is frozen (SIGSTOP); node 0's worker fails and its launcher waits for
    node 1 to meet for the restart, saying so: the signal comes once it does (a signal that comes
    while the failed attempt ends still ends the job, with the failure's exit code)."""
    job = job_marker("stuck")
    port = str(find_free_port())
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-port", port, "--max-restarts", "1"]
    node0 = launch(folder, *common, "--node-rank", "0", "waits.py", log="node0", FAIL_RANK="0",
                   DDPKIT_RECOVERY_TIMEOUT_SECONDS="120", **job)
    node1 = launch(folder, *common, "--node-rank", "1", "waits.py", log="node1", **job)
    try:
        wait_until(lambda: (folder / "started1.0").exists(), 30, "node 1's worker started")
        node1.send_signal(signal.SIGSTOP)
        wait_until(lambda: b"restart 1: waiting for the launchers of node(s) 1" in (folder / "node0.err").read_bytes(),
                   60, "node 0's launcher at the meeting for restart 1")
        assert stopped_within(node0, signal.SIGINT, 5.0) == 130, (folder / "node0.err").read_text()
        assert "received SIGINT while waiting on the job's store" in (folder / "node0.err").read_text()
    finally:
        node1.kill()
        node1.wait()
    assert not (folder / "started0.1").exists()
    assert processes_of_job(job, wait_seconds=5.0) == []


def test_a_signal_ends_a_launcher_while_a_rank_is_being_replaced_in_place(folder: Path) -> None:
    job = job_marker("stuck")
    launcher = launch(folder, "--nproc-per-node", "2", "--recovery", "in-place", "--max-restarts", "1", "in_place.py",
                      SLOW_REPLACEMENT="60", **job)
    wait_until(lambda: (folder / "replacement").exists(), 60, "the replacement runs the script")
    assert stopped_within(launcher, signal.SIGTERM, 8.0) in (143, 75)
    assert processes_of_job(job, wait_seconds=5.0) == []


@pytest.mark.parametrize("bind", ["", "all"], ids=["master-address", "every-interface-asked"])
def test_a_store_that_cannot_listen_ends_the_job_at_once_naming_it(folder: Path, bind: str) -> None:
    """Another process listens on the port at another loopback address. The store host listens on the
    master address only (127.0.0.1), so the job runs beside it (a lost rank replaced as usual); asked
    to listen on every interface (DDPKIT_STORE_BIND=all) it cannot, and the launcher ends at once,
    naming the port, before any worker starts."""
    job = job_marker("stuck")
    with socket.socket() as taken:
        taken.bind(("127.0.0.2", 0))
        taken.listen()
        port = taken.getsockname()[1]
        launcher = launch(folder, "--nproc-per-node", "2", "--recovery", "in-place", "--max-restarts", "1",
                          "--master-port", str(port), "in_place.py", DDPKIT_STORE_BIND=bind, **job)
        start = time.monotonic()
        code = launcher.wait(timeout=90)
    err = (folder / "launcher.err").read_text()
    if bind == "all":
        assert code == 2 and time.monotonic() - start < 20, err
        assert f"the job's store cannot listen on every interface port {port} (Address already in use)" in err, err
        assert not (folder / "replacement").exists()
    else:
        assert code == 0, err
        assert (folder / "replacement").exists()
    assert processes_of_job(job, wait_seconds=5.0) == []


def test_a_store_host_that_dies_ends_the_job_at_once_naming_it(folder: Path) -> None:
    job = job_marker("stuck")
    launcher = launch(folder, "--nproc-per-node", "2", "--recovery", "in-place", "--max-restarts", "1", "waits.py",
                      **job)
    wait_until(lambda: (folder / "started0.0").exists() and (folder / "started1.0").exists(), 30, "workers started")
    os.kill(store_host_pid(job), signal.SIGKILL)
    start = time.monotonic()
    code = launcher.wait(timeout=60)
    err = (folder / "launcher.err").read_text()
    assert code == 1 and time.monotonic() - start < 10, err
    assert "the job's store host" in err and "was killed by signal SIGKILL" in err, err
    assert processes_of_job(job, wait_seconds=5.0) == []
