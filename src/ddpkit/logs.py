"""ddpkit's messages: loggers named ``ddpkit.<part>``, each line prefixed with this process's rank.

Every message that is not the direct answer to a command (a notice, a hang report) goes through
``logging.getLogger("ddpkit.<part>")``. By default the ``ddpkit`` logger writes them to standard
error itself, at ``INFO`` and above, with ``[rank N]`` in front once the rank is known (unless
``ddpkit run --tee`` prefixes the worker's lines already), and does
not pass them to the root logger (so a script's own logging set-up does not print them twice).
``DDPKIT_LOG_LEVEL`` (``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``, ``CRITICAL``) sets the level.
To route them yourself: ``logging.getLogger("ddpkit").handlers.clear()`` and
``logging.getLogger("ddpkit").propagate = True``.

The handler writes with ``os.write``, not ``sys.stderr``: a hang report comes from a watchdog
thread while the main thread may be stuck half-way through a write to ``sys.stderr``.

On a terminal each message starts on a line of its own even while a worker draws a progress bar
(which ends its line with a carriage return, not a newline): the handler returns to the line's start
and clears it first (``LINE_START``), as ``tqdm.write`` does; the bar draws itself again below at
its next update. The launchers' failure summary is the answer of ``ddpkit run`` and stays a plain
write to stderr, starting the same way.
"""

from __future__ import annotations

import logging
import os
import sys

from ddpkit.variables import DDPKIT_LOG_LEVEL, DDPKIT_STDERR_PREFIXED

__all__ = ["get_logger", "line_start", "log_level_problem"]

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _RankPrefix(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        # ``ddpkit run --tee`` prefixes this worker's stderr lines with the rank itself (``workers.output``).
        rank = None if os.environ.get(DDPKIT_STDERR_PREFIXED) == "1" else _rank()
        return text if rank is None else "\n".join(f"[rank {rank}] {line}" for line in text.split("\n"))


def _rank() -> str | None:
    """This process's global rank when known: from the process group, else from RANK (set by the
    launchers); None in the launcher itself."""
    distributed = sys.modules.get("torch.distributed")  # never imported here: the launcher stays light
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return str(distributed.get_rank())
    return os.environ.get("RANK")


# Back to the start of the line, and clear it (a progress bar's partial line).
_LINE_START_ON_A_TERMINAL = "\r\x1b[K"


def line_start(descriptor: int = 2) -> str:
    """What a message written to ``descriptor`` starts with so that it starts on a line of its own:
    on a terminal (not a dumb one), a return to the line's start that clears it; else nothing."""
    try:
        terminal = os.isatty(descriptor)
    except OSError:
        return ""
    return _LINE_START_ON_A_TERMINAL if terminal and os.environ.get("TERM") != "dumb" else ""


class _StandardErrorHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            os.write(2, (line_start() + self.format(record) + "\n").encode(errors="replace"))
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def log_level_problem() -> str | None:
    """What is wrong with ``DDPKIT_LOG_LEVEL``, or None. Sets nothing up: ``ddpkit run`` asks
    before it imports anything that logs, so that a malformed level is one line, not a traceback."""
    value = os.environ.get(DDPKIT_LOG_LEVEL, "INFO").strip().upper()
    if value in _LEVELS:
        return None
    return (f"{DDPKIT_LOG_LEVEL}={os.environ[DDPKIT_LOG_LEVEL]!r} is not a logging level. "
            f"Use one of {', '.join(_LEVELS)}, or unset it for INFO.")


def _level_from_environment() -> int:
    problem = log_level_problem()
    if problem is not None:
        raise ValueError(problem)
    return int(getattr(logging, os.environ.get(DDPKIT_LOG_LEVEL, "INFO").strip().upper()))


def _configure(root: logging.Logger) -> None:
    handler = _StandardErrorHandler()
    handler.setFormatter(_RankPrefix("%(message)s"))
    root.addHandler(handler)
    root.setLevel(_level_from_environment())
    root.propagate = False


def get_logger(part: str) -> logging.Logger:
    """The logger of one part of ddpkit (``ddpkit.<part>``); sets up the ``ddpkit`` logger on first use."""
    root = logging.getLogger("ddpkit")
    if not getattr(root, "_ddpkit_configured", False):
        _configure(root)
        root._ddpkit_configured = True  # type: ignore[attr-defined]  # once, even if the user removes our handler
    return logging.getLogger(f"ddpkit.{part}")
