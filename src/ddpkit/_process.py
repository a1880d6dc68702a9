"""Small helpers shared by the launcher, the worker bootstrap, the strategy and the test pool."""

from __future__ import annotations

import json
import signal
import time


def describe_exit(code: int | None) -> str:
    """'exited with code N' or 'was killed by signal NAME', for a process's return code."""
    if code is not None and code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


def write_error_record(error_file: str, rank: int, kind: str, message: str, trace: str) -> None:
    """Record a failure where the launcher looks for it (DDPKIT_ERROR_FILE); best effort."""
    record = {"rank": rank, "time": time.time(), "type": kind, "message": message, "traceback": trace}
    try:
        with open(error_file, "w", encoding="utf-8") as handle:
            json.dump(record, handle)
    except OSError:
        pass
