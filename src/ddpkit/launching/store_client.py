"""A launcher's client of the job's store (``launching.rendezvous``, ``launching.nodes``).

Two things every launcher that reaches the store needs, whatever it waits for there:

- ``torch.distributed`` imported quietly (``import_distributed``): torch's C++ code logs every
  failed try to reach a store, with its C++ stack (a few KB each, every 2 s while a node waits
  for another), straight to the launcher's stderr. The launcher says itself what it waits for and
  why it gave up, so torch's C++ log level is raised for the launcher's own process only (its
  workers keep the user's), unless the user set ``TORCH_CPP_LOG_LEVEL``.
- waits that can be given up (``connect``, ``GiveUp``): a launcher waits for the store to come
  up, or for the other nodes, for minutes by design; the caller's ``give_up`` says when it is no
  longer worth it (a stop signal, the store host gone, this node's workers ended) and the wait
  ends within ``TRY_SECONDS`` with ``GaveUpWaiting``.

torch is imported only when a launcher connects (docs/architecture.md: the launcher stays free of
torch otherwise).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from types import ModuleType
from typing import Any

__all__ = ["TRY_SECONDS", "GaveUpWaiting", "GiveUp", "StoreUnreachableError", "connect", "import_distributed",
           "never_give_up"]

#: A reason to stop waiting, or None to go on (called between tries, from the launcher's main thread).
GiveUp = Callable[[], str | None]

#: How long one try to reach the store may take: the client cannot be interrupted inside a try.
TRY_SECONDS = 2.0

_QUIET_LEVEL = "FATAL"  # torch reads TORCH_CPP_LOG_LEVEL once, when it is first imported


class GaveUpWaiting(RuntimeError):
    """A wait on the job's store ended because ``give_up`` gave a reason (``reason``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class StoreUnreachableError(RuntimeError):
    """The store did not answer within the whole timeout (the message has torch's last error)."""


def never_give_up() -> str | None:
    return None


def import_distributed() -> ModuleType:
    """``torch.distributed``, imported with torch's C++ logging quiet in this process only."""
    chosen = "TORCH_CPP_LOG_LEVEL" in os.environ
    if not chosen:
        os.environ["TORCH_CPP_LOG_LEVEL"] = _QUIET_LEVEL
    try:
        import torch.distributed as dist
    finally:
        if not chosen:
            del os.environ["TORCH_CPP_LOG_LEVEL"]  # the workers started later keep torch's default
    return dist


def connect(address: str, port: int, timeout_seconds: float, give_up: GiveUp = never_give_up) -> Any:
    """A client of the store at ``address:port``, tried in slices of ``TRY_SECONDS`` until it
    answers (the store may not be up yet), ``give_up`` gives a reason (``GaveUpWaiting``) or
    ``timeout_seconds`` pass (``StoreUnreachableError``)."""
    dist = import_distributed()
    deadline = time.monotonic() + timeout_seconds
    while True:
        try_seconds = max(0.1, min(TRY_SECONDS, deadline - time.monotonic()))
        try:
            return dist.TCPStore(address, port, is_master=False, timeout=timedelta(seconds=try_seconds),
                                 wait_for_workers=False)
        except Exception as error:  # torch raises DistStoreError, DistNetworkError, RuntimeError or OSError
            reason = give_up()
            if reason is not None:
                raise GaveUpWaiting(reason) from None
            if time.monotonic() >= deadline:
                raise StoreUnreachableError(f"{type(error).__name__}: {error}") from None
