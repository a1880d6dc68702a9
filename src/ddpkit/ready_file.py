"""The ready file: how a worker under in-place recovery tells its launcher that it can take part in a
recovery, and what a replacement says in it. One writer (``tell_the_launcher``, the worker) and one
reader (``what_it_said``, ``workers.replacement``), so both sides spell the contract the same way.

A worker writes "ready" once it is attached to the recovery (a replacement: once it holds the
survivors' state, which ends the recovery), or "outside" while, as a replacement, it waits outside a
block between steps that the survivors run again (the recovery goes on and is not timed out).
"""

from __future__ import annotations

import os

from ddpkit.variables import DDPKIT_READY_FILE

__all__ = ["OUTSIDE", "READY", "tell_the_launcher", "what_it_said"]

READY = "ready"
OUTSIDE = "outside"


def tell_the_launcher(outside: bool = False) -> None:
    """Write this worker's ready file (``DDPKIT_READY_FILE``); nothing when it has none (not launched
    under in-place recovery)."""
    path = os.environ.get(DDPKIT_READY_FILE)
    if path:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(f"{OUTSIDE if outside else READY}\n")


def what_it_said(path: str) -> str:
    """What the worker wrote in its ready file at ``path``: ``READY``, ``OUTSIDE``, or "" when it has
    written nothing yet."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip()
    except OSError:
        return ""
