"""The launcher's client of the job's store (``launching.store_client``) against a store whose host
is frozen rather than dead (SIGSTOP): its kernel still takes connections and keeps them open, and
nothing answers. torch's client waits for such an answer without end (its timeout bounds only the
wait for a key): every request and every try to connect must end within its bound instead, and
the launcher must end with its own exit code, not SIGABRT from a request left blocked."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpkit.diagnostics.hangs import _process_state
from ddpkit.store.client import (
    BoundedStore,
    StoreRequestTimeout,
    StoreUnreachableError,
    connect,
)

HOST = textwrap.dedent(
    """
    import time
    from datetime import timedelta
    import torch.distributed as dist
    # Port 0: no window between finding a free port and binding it, in which a test beside this one could take it.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    print(f"up {store.port}", flush=True)
    time.sleep(120)
    """
)


@pytest.fixture
def store_host() -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """A TCPStore in a process of its own (stopped by the test when it freezes the host)."""
    host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True)
    assert host.stdout is not None
    said, _, port = host.stdout.readline().strip().partition(" ")
    assert said == "up" and port.isdigit(), said
    yield int(port), host
    host.kill()
    host.wait()


def freeze(host: subprocess.Popen[str]) -> None:
    """SIGSTOP the host, and return once each of its threads is stopped: the stop is taken by each
    thread when it next runs, and under load the store's thread answered a request sent after the
    signal (the request then did not time out: seen beside other tests)."""
    host.send_signal(signal.SIGSTOP)
    tasks = Path(f"/proc/{host.pid}/task")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = [_process_state(int(task.name)) for task in tasks.iterdir()]  # (a thread's id reads as a pid's)
        if states and all(state is not None and state in "tT" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"the store's host (pid {host.pid}) did not stop within 10 s of SIGSTOP")


# Beside another test: the bound is on a wait, which a thread asleep in it ends on time under load.
def test_every_request_to_a_frozen_store_ends_within_its_bound(store_host: tuple[int, subprocess.Popen[str]]) -> None:
    port, host = store_host
    store = BoundedStore(connect("127.0.0.1", port, 10), 1.0)
    store.set("key", "value")
    assert store.get("key") == b"value" and store.check(["key"]) and store.add("count", 2) == 2
    freeze(host)
    start = time.monotonic()
    with pytest.raises(StoreRequestTimeout, match=r"did not answer a request \(check\) within 1 s"):
        store.check(["key"])
    assert time.monotonic() - start < 3
    start = time.monotonic()
    with pytest.raises(StoreRequestTimeout):  # the store is taken for lost: no second wait
        store.add("count", 1)
    assert time.monotonic() - start < 0.5


def test_a_store_that_dies_fails_a_request_as_torch_s_client_fails_it(
        store_host: tuple[int, subprocess.Popen[str]]) -> None:
    port, host = store_host
    store = BoundedStore(connect("127.0.0.1", port, 10), 30.0)
    host.kill()
    host.wait()
    start = time.monotonic()
    with pytest.raises(Exception) as raised:
        store.add("count", 1)
    assert not isinstance(raised.value, StoreRequestTimeout) and time.monotonic() - start < 5


def test_connecting_to_a_frozen_store_ends_within_the_timeout(store_host: tuple[int, subprocess.Popen[str]]) -> None:
    port, host = store_host
    freeze(host)
    start = time.monotonic()
    with pytest.raises(StoreUnreachableError, match="took the connection but did not answer"):
        connect("127.0.0.1", port, 4)
    assert time.monotonic() - start < 4 + 3.5  # a try started just before the deadline, and its margin


LAUNCHER = textwrap.dedent(
    """
    import atexit, sys
    import ddpkit.__main__
    import ddpkit.launching.cli
    from ddpkit.store.client import BoundedStore, StoreRequestTimeout, connect

    def run():  # a launcher whose last request to the store went unanswered
        store = BoundedStore(connect("127.0.0.1", int(sys.argv[1]), 10), 0.5)
        print("connected", flush=True)
        sys.stdin.readline()  # the host is frozen now
        try:
            store.check(["key"])
        except StoreRequestTimeout:
            print("unanswered", flush=True)
        return 3

    ddpkit.launching.cli.main = run
    atexit.register(print, "finalised")
    sys.exit(ddpkit.__main__.main())
    """
)


def test_a_launcher_with_a_request_left_unanswered_ends_with_its_own_exit_code(
        store_host: tuple[int, subprocess.Popen[str]], tmp_path: Path) -> None:
    """The thread left in the request would end the process with SIGABRT were the store to
    wake it (the frozen host killed, say) while the interpreter finalises: the launcher ends
    without finalising (no atexit handler runs) with the job's code."""
    port, host = store_host
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    launcher = subprocess.Popen([sys.executable, "launcher.py", str(port)], cwd=tmp_path, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert launcher.stdin is not None and launcher.stdout is not None
    assert launcher.stdout.readline().strip() == "connected"
    freeze(host)
    launcher.stdin.write("\n")
    launcher.stdin.flush()
    assert launcher.stdout.readline().strip() == "unanswered"
    host.kill()  # wakes the blocked request as the launcher ends
    out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 3, err
    assert "finalised" not in out and "terminate called" not in err
