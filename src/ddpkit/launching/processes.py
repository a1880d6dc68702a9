"""Worker processes: how they ended, their process groups, and which failure was the root cause.

Shared by the launcher, in-script launching, the strategy and the test pool."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass

from ddpkit.diagnostics.records import read_error_record


def describe_exit(code: int | None) -> str:
    """'exited with code N' or 'was killed by signal NAME', for a process's return code."""
    if code is not None and code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


def signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    """Send ``sig`` to the process group (session) a worker was started in, if it still exists."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def end_process_groups(processes: list[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM to each process's group, SIGKILL after ``grace`` seconds, and reap every process.

    The SIGKILL goes to every group, finished or not: it also reaches grandchildren left behind.
    """
    for process in processes:
        if process.poll() is None:
            signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(process.poll() is None for process in processes) and time.monotonic() < deadline:
        time.sleep(0.02)
    for process in processes:
        signal_group(process, signal.SIGKILL)
        process.wait()


@dataclass
class WorkerProcess:
    """A worker that a launcher (``ddpkit run``, or the script itself) started and watches."""

    local_rank: int
    rank: int
    process: subprocess.Popen[bytes]
    error_file: str  # where it records an uncaught exception (write_error_record)
    stack_file: str = ""  # where it dumps its stacks on SIGUSR1, if anywhere
    reaped: bool = False  # its process group has been killed and the process waited for


def root_cause(failed: list[WorkerProcess], workers: list[WorkerProcess]) -> tuple[WorkerProcess, dict[str, object] | None]:
    """The worker whose failure caused the others', and its record.

    One of ``failed`` that ended without recording an exception (killed by a signal, or a
    deliberate ``sys.exit``) comes first: its peers' errors ("connection closed") are its
    consequences. Otherwise the earliest recorded exception of any worker, whether or not it
    had exited yet: a worker records its exception first, then tells its peers
    (``ddpkit.diagnostics.failures``), which may fail and exit before it does.
    """
    records = {worker.rank: read_error_record(worker.error_file) for worker in workers}
    for worker in failed:
        if records[worker.rank] is None:
            return worker, None
    recorded = [(record, worker) for worker in workers if (record := records[worker.rank]) is not None]
    record, worker = min(recorded, key=lambda pair: float(str(pair[0]["time"])))
    return worker, record
