"""Seconds settings read from the environment, where 0 turns a mechanism off: the diagnostics',
and the in-place recovery timeout that the launcher and its workers both read. torch-free."""

from __future__ import annotations

import os

from ddpkit.variables import (
    DDPKIT_HANG_ABORT_SECONDS,
    DDPKIT_HANG_SECONDS,
    DDPKIT_PEER_FAILURE_EXIT_SECONDS,
    DDPKIT_RECOVERY_TIMEOUT_SECONDS,
)

__all__ = ["RECOVERY_TIMEOUT_SECONDS", "WORKER_SECONDS_SETTINGS", "check_worker_seconds_settings",
           "recovery_timeout_seconds", "seconds_setting"]

#: DDPKIT_RECOVERY_TIMEOUT_SECONDS when not set: how long the ranks of an in-place recovery wait
#: for each other (the launcher waits a little longer).
RECOVERY_TIMEOUT_SECONDS = 60.0

#: The seconds settings every worker reads, each with the example its message suggests.
WORKER_SECONDS_SETTINGS = {
    DDPKIT_HANG_SECONDS: "60",
    DDPKIT_HANG_ABORT_SECONDS: "30",
    DDPKIT_PEER_FAILURE_EXIT_SECONDS: "1, 0 to never end a rank whose peer failed",
}


def seconds_setting(variable: str, default: float, example: str) -> float:
    """``variable`` as a number of seconds (negative counts as 0), ``default`` when unset or empty.

    A value that is not a number raises ``ValueError`` naming it and suggesting ``example``
    (e.g. ``"60"``), in the caller's thread.
    """
    value = os.environ.get(variable, "").strip()
    if not value:
        return default
    try:
        return max(0.0, float(value))
    except ValueError:
        raise ValueError(f"{variable}={value!r} is not a number of seconds. Set e.g. {example}, or unset it.") from None


def recovery_timeout_seconds() -> float:
    """``DDPKIT_RECOVERY_TIMEOUT_SECONDS`` (``ValueError`` naming it when it is not a number)."""
    return seconds_setting(DDPKIT_RECOVERY_TIMEOUT_SECONDS, RECOVERY_TIMEOUT_SECONDS, "60")


def check_worker_seconds_settings() -> None:
    """``ValueError`` for the first malformed ``WORKER_SECONDS_SETTINGS`` value: the launcher refuses
    it before any worker starts, instead of every worker failing on it with a traceback."""
    for variable, example in WORKER_SECONDS_SETTINGS.items():
        seconds_setting(variable, 0.0, example)
