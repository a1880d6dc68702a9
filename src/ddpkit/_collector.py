"""Python's cyclic garbage collector, paused while a process imports torch.

Importing torch, its compiler stack and ddpkit's strategy creates about half a million objects
that live as long as the process, and almost no garbage. The collector runs a pass every 700 new
objects, and passes over the older generations that scan the survivors again and again: about a
fifth of the import's CPU, paid at the start of every process that imports torch (each node's
template, each warm spare or fresh worker, the store host, a launcher with a store client). Paused
for the import, it finds the little garbage there is at its next pass.

Nothing of torch or of the rest of ddpkit is imported here: the launcher and the store's client use it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off for the block, then as it was before (left off if it was off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
