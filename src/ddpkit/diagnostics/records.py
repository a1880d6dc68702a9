"""Failure records: one rank's failure as the launchers' error files and the store hold it.

A record is a JSON object with ``rank``, ``time``, ``type``, ``message`` and ``traceback``
(torchrun's error-file fields), so a failure written by a worker, by the strategy or by
``guard()`` reads the same wherever it is shown.
"""

from __future__ import annotations

import json
import time
import traceback

__all__ = ["PEER_LOST", "exception_record", "failure_record", "read_error_record", "record_time", "trace_record",
           "write_error_record"]

# The type of a record whose rank failed because another rank of its group vanished
# (``diagnostics.failures.PeerLostError``), as the torch-free launcher reads it.
PEER_LOST = "PeerLostError"


def failure_record(rank: int, kind: str, message: str, trace: str) -> dict[str, object]:
    """One rank's failure, as the launchers' error files and the store (``ddpkit.diagnostics.failures``) hold it."""
    return {"rank": rank, "time": time.time(), "type": kind, "message": message, "traceback": trace}


def trace_record(rank: int, trace: str) -> dict[str, object]:
    """The record of a failure given as its formatted traceback, named by its last line
    ("SomeError: message"; "Error" when the last line is not of that form)."""
    last_line = trace.strip().splitlines()[-1] if trace.strip() else "(no traceback given)"
    kind, separator, message = last_line.partition(": ")
    if not separator or " " in kind:
        kind, message = "Error", last_line
    return failure_record(rank, kind, message, trace)


def record_time(record: dict[str, object]) -> float:
    """When the failure of ``record`` was recorded (seconds since the epoch, as ``time.time()``)."""
    return float(str(record["time"]))


def exception_record(rank: int, error: BaseException) -> dict[str, object]:
    """``failure_record`` of an exception, with its traceback."""
    return failure_record(rank, type(error).__name__, str(error), "".join(traceback.format_exception(error)))


def write_error_record(error_file: str, record: dict[str, object]) -> None:
    """Record a failure where the launcher looks for it (DDPKIT_ERROR_FILE); best effort. The
    first failure of the process is kept: it is the cause, the later ones its consequences."""
    try:
        with open(error_file, "x", encoding="utf-8") as handle:
            json.dump(record, handle)
    except OSError:  # FileExistsError included: a failure is recorded already
        pass


def read_error_record(error_file: str) -> dict[str, object] | None:
    """The failure a worker recorded with ``write_error_record``, or None when it recorded none."""
    try:
        with open(error_file, encoding="utf-8") as handle:
            record: dict[str, object] = json.load(handle)
            return record
    except (OSError, ValueError):
        return None
