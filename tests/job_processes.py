"""Finding what a job left behind: a marker variable put in one job's environment, and the
processes still alive whose environment carries it (its launchers' and workers' children too)."""

from __future__ import annotations

import os
import time

_NAME = "DDPKIT_TEST_JOB_MARKER"


def job_marker(kind: str = "job") -> dict[str, str]:
    """A variable to put in one job's environment, to find its processes afterwards."""
    return {_NAME: f"{kind}-{time.monotonic_ns()}"}


def processes_of_job(marker: dict[str, str], wait_seconds: float = 0.0) -> list[int]:
    """Processes alive whose environment carries ``marker``, once none is left or ``wait_seconds``
    passed (a zombie's environment cannot be read: it does not count)."""
    (name, value), = marker.items()
    needle = f"{name}={value}".encode()
    deadline = time.monotonic() + wait_seconds
    while True:
        alive = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/environ", "rb") as environ:
                    if needle in environ.read():
                        alive.append(int(entry))
            except OSError:
                continue
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)
