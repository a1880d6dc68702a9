"""The diagnostics' settings read from the environment: numbers of seconds, where 0 turns a
mechanism off."""

from __future__ import annotations

import os

__all__ = ["seconds_setting"]


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
