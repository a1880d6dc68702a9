"""The store a new generation of the group forms through, whose waits end when the generation is
given up.

When torch forms a Gloo group, each member writes its address under a key of the store and waits
for every other member's (``wait``, then ``get``), for as long as the group's timeout (30 minutes
by default). A member that counted itself into a generation (``Group.meet``) and died before
writing its address (a joining node killed, a replacement killed as it starts) would keep the
others there that long. ``FormingStore`` waits in slices and asks between them whether the
generation was given up (the launchers said a node of it was lost, or a process already waits
for the generation after it): then the wait raises ``GenerationAbandonedError`` at once, and the
members go on to the next generation the launchers lay out (``Group.reconfigure``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ddpkit.store.pass_through import PassThroughStore, kept

__all__ = ["FormingStore", "GenerationAbandonedError", "forming"]

# How often a wait for a member's address asks whether the generation was given up.
_LOOK_SECONDS = 0.05


class GenerationAbandonedError(RuntimeError):
    """A generation of the group was given up while it formed (``FormingStore``)."""


class FormingStore(PassThroughStore):
    """``store``, whose ``wait`` ends with ``GenerationAbandonedError`` as soon as ``abandoned()``
    says why the generation will not form (see the module docstring), and with a ``RuntimeError``
    after ``within_seconds`` (the members were all counted in: their addresses come at once)."""

    def __init__(self, store: Any, abandoned: Callable[[], str | None], within_seconds: float) -> None:
        super().__init__(store)
        self._abandoned = abandoned
        self._within_seconds = within_seconds

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = time.monotonic() + self._within_seconds
        while not self._store.check(keys):
            why = self._abandoned()
            if why is not None:
                raise GenerationAbandonedError(why)
            if time.monotonic() > deadline:
                raise RuntimeError(f"a member of the group did not write its address ({keys}) within "
                                   f"{self._within_seconds:g} s of the others")
            time.sleep(_LOOK_SECONDS)


def forming(store: Any, abandoned: Callable[[], str | None], within_seconds: float) -> FormingStore:
    """``store`` as a ``FormingStore``, kept until the process ends (``pass_through_store.kept``)."""
    return kept(FormingStore(store, abandoned, within_seconds))
