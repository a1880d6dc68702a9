"""Bootstrap of every worker that ddpkit starts (``launching.processes``):
``python -m ddpkit.launching.worker script.py [args]`` or ``python -m ddpkit.launching.worker -m module [args]``
for ``ddpkit run`` and in-script launching, ``python -m ddpkit.launching.worker --serve-functions`` for
the function pool of ``launch(fn)`` and ``ddpkit.testing.WorkerPool`` (``launching.pool``).

Before running the script as ``__main__`` (or serving the pool) it (1) asks the kernel to send SIGTERM when the launcher
dies (Linux ``PR_SET_PDEATHSIG``), and exits at once if the launcher is already gone, so no worker
outlives a killed launcher; (2) records an uncaught exception, with its traceback and the time it
happened, in the JSON file the launcher named (``DDPKIT_ERROR_FILE``), so the launcher can name the
root cause: the earliest failure, not the rank that merely lost its peer; (3) publishes that
exception to the other ranks through the process group's store (``ddpkit.diagnostics.failures``); (4) dumps
its threads' stacks to a file on SIGUSR1, for ``ddpkit run``'s stack dumps.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import runpy
import signal
import sys
import traceback

from ddpkit.diagnostics.failures import CollectiveFailedError, record_exception

_PR_SET_PDEATHSIG = 1
# The argument that makes a worker serve the function pool (``launching.pool``) instead of a script.
SERVE_FUNCTIONS = "--serve-functions"


def _die_with_launcher() -> None:
    launcher = int(os.environ.get("DDPKIT_LAUNCHER_PID", "0"))
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            pass
    if launcher and os.getppid() != launcher:  # it died before prctl took effect
        os._exit(1)


def _dump_stacks_on_request() -> None:
    """On SIGUSR1 (from ``ddpkit run``), write every thread's Python stack to DDPKIT_STACK_FILE.

    faulthandler writes from the signal handler itself, in C, so this works while the main
    thread is blocked in a collective. It keeps a reference to the file, which stays open.
    """
    path = os.environ.get("DDPKIT_STACK_FILE")
    if path:
        faulthandler.register(signal.SIGUSR1, file=open(path, "a", encoding="utf-8"), all_threads=True)


def main(argv: list[str]) -> None:
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit("usage: python -m ddpkit.launching.worker (script.py | -m module) [args...]")
    _dump_stacks_on_request()
    _die_with_launcher()
    try:
        if argv == [SERVE_FUNCTIONS]:
            from ddpkit.launching.pool import serve  # only a pool's workers need it

            serve()
        elif argv[0] == "-m":  # as `python -m module args`: the module's own sys.argv[0], the cwd on the path
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:
        # For the launcher, and (unless it is a consequence, not news to them) for the other ranks,
        # which frees those blocked in collectives.
        record_exception(exc, publish=not isinstance(exc, CollectiveFailedError))
        traceback.print_exc()
        sys.stderr.flush()
        # os._exit keeps the code: sys.exit after a Gloo error can turn into an abort (134).
        os._exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
