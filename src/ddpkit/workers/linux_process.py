"""Two Linux ``prctl`` calls a process of ddpkit's makes about itself: die with its parent
(``PR_SET_PDEATHSIG``), and a name ``ps`` shows (``PR_SET_NAME``). Elsewhere each does nothing.

Imports no torch: the store host and the workers use it alike, and the launcher must stay light.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent", "rename_process"]

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME, _PR_GET_NAME = 15, 16


def die_with_parent(parent: int, death_signal: signal.Signals) -> None:
    """Ask the kernel for ``death_signal`` when this process's parent dies; exit at once (code 1)
    when ``parent`` (its pid; 0 for none known) is no longer the parent: it died before the request
    took effect."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, death_signal)
        except (OSError, AttributeError):
            pass
    if parent and os.getppid() != parent:
        os._exit(1)


def rename_process(name: bytes) -> bytes:
    """Give this process (its main thread) the name ``name`` (Linux keeps 15 bytes); its name
    before (b"" where it cannot). An empty ``name`` only reads it."""
    if not sys.platform.startswith("linux"):
        return b""
    before = ctypes.create_string_buffer(16)
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(_PR_GET_NAME, before)
        if name:
            libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name[:15]))
    except (OSError, AttributeError):
        return b""
    return before.value
