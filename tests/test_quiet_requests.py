"""ddpkit's own requests to a store whose host died say so in ddpkit's words only: torch's
warning with its C++ stack is left out (it came now and then under srun and mpirun when rank 0
was killed: whichever of the wait and the watches asked first after the death printed it), and
the user's level of torch's log is given back after."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

from ddpkit.diagnostics.quiet_requests import _log_level, quiet_requests

# A process whose group's store is hosted by another process, which is SIGKILLed; then ddpkit's
# check between two slices of a wait reads the failure record on the dead connection.
READ_AFTER_THE_HOSTS_DEATH = textwrap.dedent(
    """
    import datetime, subprocess, sys, time
    import torch.distributed as dist
    from ddpkit.diagnostics import failures

    host = subprocess.Popen([sys.executable, "-c", "import datetime, time, torch.distributed as d; "
                             "s = d.TCPStore('127.0.0.1', 0, 2, True, timeout=datetime.timedelta(seconds=30), "
                             "wait_for_workers=False); print(s.port, flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    port = int(host.stdout.readline())
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=10))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    assert failures.peer_failure() is None
    host.kill()
    host.wait()
    time.sleep(0.2)
    error = failures.peer_failure()
    print("raised:", type(error).__name__, error)
    """
)


def test_a_read_after_the_stores_host_died_names_it_without_torchs_cpp_stack() -> None:
    result = subprocess.run([sys.executable, "-c", READ_AFTER_THE_HOSTS_DEATH], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "raised: StoreHostGoneError rank 0, the host of the process group's store" in result.stdout, result.stdout
    for trace in ("frame #", "TCPStore.cpp", "Exception raised from"):
        assert trace not in result.stderr, result.stderr[-3000:]


def test_the_level_is_raised_while_any_thread_asks_and_given_back_after_the_last() -> None:
    level = _log_level()
    assert level is not None, "c10's log level was not found beside torch"
    before = level.value
    inside, release = threading.Event(), threading.Event()

    def ask() -> None:
        with quiet_requests():
            inside.set()
            release.wait(10)

    other = threading.Thread(target=ask)
    other.start()
    assert inside.wait(10)
    with quiet_requests():
        assert level.value == max(before, 2)
    assert level.value == max(before, 2), "the other thread still asks"
    release.set()
    other.join(10)
    assert level.value == before
