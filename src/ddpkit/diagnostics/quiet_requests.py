"""The diagnostics' requests to a store whose host may be gone, without torch's C++ warning.

When the host of a TCP store dies (rank 0 SIGKILLed, say), the next request on a client's
established connection fails, and torch's client logs a warning with its whole C++ stack (forty
lines) before it raises. ddpkit's diagnostics ask the group's store between slices of a wait and
from their watch threads, and turn that failure into one message that names the store's host and
the cause (``StoreHostGoneError``); which of them asks first after the death is a race, so the
warning came now and then on top of ddpkit's message. ``quiet_requests`` raises torch's C++ log
level to errors around such requests (a counter: threads may nest them). The level is process-wide
while any such request runs, so a warning another thread logs in those milliseconds is not
printed either; errors still are. Where the level cannot be reached (a torch without
``libc10.so`` beside it), the requests run as they are.

The launcher quiets torch's C++ log for its whole process instead (``ddpkit.store.client``): it
is no one's training process. A worker keeps the user's level outside these requests.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Iterator

import torch

__all__ = ["quiet_requests"]

# c10's levels: 0 info, 1 warning, 2 error, 3 fatal (TORCH_CPP_LOG_LEVEL sets it when torch starts).
_ERRORS_ONLY = 2


@functools.cache
def _log_level() -> ctypes.c_int | None:
    """c10's log level, which torch's C++ code reads before it logs (None where it cannot be found)."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    try:
        library = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0))  # the copy torch loaded
        return ctypes.c_int.in_dll(library, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        return None


class _RaisedLevel:
    """Who holds c10's level raised now, and the level to give back when the last one is done."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders = 0
        self.saved = 0

    def enter(self, level: ctypes.c_int) -> None:
        with self.lock:
            if self.holders == 0:
                self.saved = level.value
                level.value = max(self.saved, _ERRORS_ONLY)
            self.holders += 1

    def leave(self, level: ctypes.c_int) -> None:
        with self.lock:
            self.holders -= 1
            if self.holders == 0:
                level.value = self.saved


# A guard over torch's own process-wide level, not a fact of ddpkit's (``PROCESS.reset`` must not
# forget a level it has to give back).
_RAISED = _RaisedLevel()


@contextlib.contextmanager
def quiet_requests() -> Iterator[None]:
    """Run ddpkit's requests to a store whose host may be gone with torch's warnings off (errors
    still print); the caller says what went wrong itself."""
    level = _log_level()
    if level is None:
        yield
        return
    _RAISED.enter(level)
    try:
        yield
    finally:
        _RAISED.leave(level)
