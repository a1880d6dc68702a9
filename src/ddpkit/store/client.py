"""A launcher's client of the job's store (``launching.rendezvous``, ``control_plane.nodes``).

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
- requests that end (``BoundedStore``): torch's client waits for the answer to a ``check``,
  ``get``, ``add`` or ``compare_set`` without end (the store's timeout bounds only the wait for a
  key). A store whose host is frozen, or whose connection was lost without a reset, answers
  nothing and would hold the launcher, and so the whole job, for ever. Such a request is left
  blocked on a thread of its own; were it woken while the interpreter finalises, torch's C++ code
  would end the process with ``std::terminate`` (SIGABRT), so the launcher then ends without
  finalising (``requests_left_unanswered``, read by ``ddpkit.__main__``).

torch is imported only when a launcher connects (docs/architecture.md: the launcher stays free of
torch otherwise).
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from types import ModuleType
from typing import Any

from ddpkit._collector import collector_paused
from ddpkit.process_state import PROCESS

__all__ = ["TRY_SECONDS", "BoundedStore", "GaveUpWaiting", "GiveUp", "StoreRequestTimeout", "StoreUnreachableError",
           "connect", "import_distributed", "never_give_up", "requests_left_unanswered"]

#: A reason to stop waiting, or None to go on (called between tries, from the launcher's main thread).
GiveUp = Callable[[], str | None]

#: How long one try to reach the store may take: the client cannot be interrupted inside a try.
TRY_SECONDS = 2.0

_QUIET_LEVEL = "FATAL"  # torch reads TORCH_CPP_LOG_LEVEL once, when it is first imported



def requests_left_unanswered() -> bool:
    """Whether a thread of this process is still blocked in a request the store never answered."""
    return PROCESS.store_requests_unanswered.is_set()


class GaveUpWaiting(RuntimeError):
    """A wait on the job's store ended because ``give_up`` gave a reason (``reason``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class StoreUnreachableError(RuntimeError):
    """The store did not answer within the whole timeout (the message has torch's last error)."""


class StoreRequestTimeout(TimeoutError):
    """A request to the store got no answer within ``BoundedStore.seconds``."""


class _Call:
    """One call made on a thread of its own, and its outcome, which the caller waits for."""

    def __init__(self, function: Callable[..., Any], *args: Any) -> None:
        self._function, self._args = function, args
        self._answered = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._result = self._function(*self._args)
        except BaseException as error:  # handed to the caller, whatever it is
            self._error = error
        self._answered.set()

    def outcome(self, seconds: float, unanswered: str) -> Any:
        """The result (or the error raised) once it came within ``seconds``; otherwise
        ``StoreRequestTimeout(unanswered)``, the call's thread left blocked."""
        if not self._answered.wait(seconds):
            PROCESS.store_requests_unanswered.set()
            raise StoreRequestTimeout(unanswered)
        if self._error is not None:
            raise self._error
        return self._result


class BoundedStore:
    """A client of the job's store whose every request ends within ``seconds``: answered, failed
    as torch's client fails it, or ``StoreRequestTimeout``.

    The requests run one at a time on a daemon thread of the client's own, which the caller waits
    for. A request left unanswered leaves that thread blocked (torch's client cannot be
    interrupted), and every later request fails at once: the store is taken for lost, as when its
    connection breaks."""

    def __init__(self, store: Any, seconds: float) -> None:
        self.seconds = seconds
        self._store = store
        store.set_timeout(timedelta(seconds=seconds))  # a get of a key not there fails as torch fails it, sooner
        self._requests: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._unanswered: str | None = None
        threading.Thread(target=self._serve, name="ddpkit-store-requests", daemon=True).start()

    def _serve(self) -> None:
        while True:
            self._requests.get().run()

    def _ask(self, method: str, *args: Any) -> Any:
        if self._unanswered is not None:
            raise StoreRequestTimeout(self._unanswered)
        request = _Call(getattr(self._store, method), *args)
        self._requests.put(request)
        try:
            return request.outcome(self.seconds, f"the store did not answer a request ({method}) within "
                                                 f"{self.seconds:g} s")
        except StoreRequestTimeout as unanswered:
            self._unanswered = str(unanswered)
            raise

    def set(self, key: str, value: str | bytes) -> None:
        self._ask("set", key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._ask("get", key))

    def check(self, keys: list[str]) -> bool:
        return bool(self._ask("check", keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [bytes(value) for value in self._ask("multi_get", keys)]

    def add(self, key: str, amount: int) -> int:
        return int(self._ask("add", key, amount))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return bytes(self._ask("compare_set", key, expected, desired))

    def list_keys(self) -> list[str]:
        return list(self._ask("list_keys"))

    def delete_key(self, key: str) -> bool:
        return bool(self._ask("delete_key", key))


def never_give_up() -> str | None:
    return None


def import_distributed() -> ModuleType:
    """``torch.distributed``, imported with torch's C++ logging quiet in this process only (and the
    garbage collector paused: ``ddpkit._collector``)."""
    chosen = "TORCH_CPP_LOG_LEVEL" in os.environ
    if not chosen:
        os.environ["TORCH_CPP_LOG_LEVEL"] = _QUIET_LEVEL
    try:
        with collector_paused():
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
            return _try_to_connect(dist, address, port, try_seconds)
        except Exception as error:  # torch raises DistStoreError, DistNetworkError, RuntimeError or OSError
            reason = give_up()
            if reason is not None:
                raise GaveUpWaiting(reason) from None
            if time.monotonic() >= deadline:
                raise StoreUnreachableError(f"{type(error).__name__}: {error}") from None


# What a try to connect may take beyond its own timeout before it is taken for unanswered.
_CONNECT_MARGIN_SECONDS = 1.0


def _try_to_connect(dist: ModuleType, address: str, port: int, seconds: float) -> Any:
    """One try, on a daemon thread: torch's client waits for the store's first answer without end
    once connected, and a frozen store's host still accepts connections (its kernel does). A try
    left unanswered leaves its thread blocked, and raises ``StoreRequestTimeout``."""
    bound = seconds + _CONNECT_MARGIN_SECONDS
    attempt = _Call(functools.partial(dist.TCPStore, address, port, is_master=False, timeout=timedelta(seconds=seconds),
                                      wait_for_workers=False))
    threading.Thread(target=attempt.run, name="ddpkit-store-connect", daemon=True).start()
    return attempt.outcome(bound, f"the store at {address}:{port} took the connection but did not answer within "
                                   f"{bound:g} s")
