"""Leaving the process without the interpreter's finalisation, where finalising would hang or abort.

Two hazards of torch 2.13 + Gloo at the end of a process:

- A Gloo thread may still need the GIL after the script has ended (freeing a finished
  collective's tensors, running a future's callback). Once the interpreter is finalising,
  CPython ends such a thread with a forced unwind through C++ ``noexcept`` code, and the
  process aborts (SIGABRT) although the script succeeded.
- After ddpkit raised ``PeerFailedError`` out of a wait, the collective it stopped waiting for
  is still pending in Gloo, and finalising waits for it: the process would end only when the
  failed peer's process does.

``leave(code)`` runs what a normal exit runs, in the interpreter's order (non-daemon threads are
joined, exit handlers run, then ``before_leaving``, the standard streams are flushed) and ends the
process with ``os._exit(code)``. ``leave_on_uncaught_exception()`` makes an uncaught exception
end the process that way (exit code 1, without waiting for threads) once ddpkit has raised
``PeerFailedError`` in it.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from types import TracebackType

from ddpkit.process_state import PROCESS

__all__ = ["leave", "leave_on_uncaught_exception"]


def leave(code: int, before_leaving: Callable[[], None] | None = None, wait_for_threads: bool = True) -> None:
    """End this process with ``code`` after the steps of a normal exit, without finalisation.

    ``before_leaving`` runs after the exit handlers (which may still use the process group), e.g.
    to tear the group down and release the script's objects, whose finalizers flush its files.
    ``wait_for_threads=False`` skips joining the non-daemon threads: after a failure one of them
    may be blocked in a collective that only this process's exit ends.
    """
    current = threading.current_thread()
    for thread in threading.enumerate():
        if wait_for_threads and thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    if before_leaving is not None:
        before_leaving()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed by the script, or its reader is gone
            pass
    os._exit(code)


def leave_on_uncaught_exception() -> None:
    """From now on, an uncaught exception in the main thread is reported as usual (by the hook in
    place before), then the process leaves with code 1 (``leave``). Idempotent."""
    if PROCESS.exception_hook is not None and sys.excepthook is PROCESS.exception_hook:
        return
    previous = sys.excepthook

    def report_then_leave(kind: type[BaseException], value: BaseException, trace: TracebackType | None) -> None:
        previous(kind, value, trace)
        leave(1, wait_for_threads=False)

    PROCESS.exception_hook = sys.excepthook = report_then_leave
