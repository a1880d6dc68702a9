"""News in a group's store: what a rank must react to, pushed to it instead of polled for.

A rank's watches (``diagnostics.peer_watch``: a peer's published failure; ``diagnostics.hangs``:
a request for its stack) used to read the store several times a second each, which at a
thousand nodes of eight ranks is most of the store's load (issue 62). Now every record another
rank must react to is followed by *news*: a count raised (``add``) and a key per raise, under
the group's scope (its attempt and generation) in the job's namespace, written to the TCP store
under the group's own prefixes. Each process has one ``NewsWatch`` per group: a daemon thread
that waits for the next key on a connection of its own (a wait holds the connection it is sent
on), one request the store holds open instead of several a second, and wakes whoever waits for
news. The watches then read what changed. A store that dies ends the wait at once (its
connection closes), which the peer watch then reads as the store's host gone.

The count and the keys are not signed: a stranger who raises the count only makes the ranks read
the (signed) records once more. A group whose store is not a TCP store gives no ``NewsWatch``:
the watches then poll as before.
"""

from __future__ import annotations

import threading
import weakref
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpkit.logs import get_logger
from ddpkit.process_state import PROCESS
from ddpkit.store import keys as store_keys

__all__ = ["NewsWatch", "announce", "default_group_news", "tcp_store_under"]

_log = get_logger("store")

# A wait long enough never to end in a job without news (its end prints a warning of torch's):
# the thread is a daemon, and it ends at the next news once its group is gone.
_WAIT = timedelta(days=7)
# How long the watch's own connection may take to open.
_CONNECT = timedelta(seconds=30)


def tcp_store_under(store: Any) -> Any:
    """The TCP store under ``store``'s prefixes and wrappers; None when there is none."""
    while store is not None and hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store if isinstance(getattr(store, "host", None), str) and isinstance(getattr(store, "port", None), int) \
        else None


def announce(store: Any, namespace: str, scope: str) -> None:
    """Tell every ``NewsWatch`` of the group (``scope`` in the job's ``namespace``) whose store
    ``store`` is that something happened, after writing it."""
    tcp = tcp_store_under(store)
    if tcp is None:
        return  # no watch waits: the watches poll
    base = store_keys.news_base(namespace, scope)
    number = tcp.add(base + store_keys.NEWS_COUNT, 1)
    tcp.set(base + store_keys.news(number), b"")


class NewsWatch:
    """The news of one group, as a count that rises (``wait_for_more``); ``ended`` once its wait
    failed for good (the store is gone), when the watches go back to polling."""

    def __init__(self, address: tuple[str, int], base: str, owner: object) -> None:
        self._address, self._base = address, base
        self._owner = weakref.ref(owner)  # the group: the thread ends at the next news once it is gone
        self._changed = threading.Condition()
        self.count = 0
        self.ended = False
        threading.Thread(target=self._run, name="ddpkit-news", daemon=True).start()

    def wait_for_more(self, seen: int, seconds: float) -> int:
        """The count of news, once it is above ``seen``, or after ``seconds``, or at once when the
        watch has ended."""
        with self._changed:
            self._changed.wait_for(lambda: self.count > seen or self.ended, timeout=seconds)
            return self.count

    def _run(self) -> None:
        count_key = self._base + store_keys.NEWS_COUNT
        try:
            connection = dist.TCPStore(  # type: ignore[attr-defined]
                *self._address, is_master=False, wait_for_workers=False, timeout=_CONNECT)
            number = connection.add(count_key, 0)
            self._note(number)
            while self._owner() is not None:
                try:
                    connection.wait([self._base + store_keys.news(number + 1)], _WAIT)
                except RuntimeError:
                    pass  # the long wait ran out, or the store is gone: the count read next says which
                number = connection.add(count_key, 0)
                self._note(number)
        except RuntimeError as error:
            _log.debug(f"ddpkit: the wait for news ended ({error}): the watches read the store themselves")
        finally:
            with self._changed:
                self.ended = True
                self._changed.notify_all()

    def _note(self, number: int) -> None:
        with self._changed:
            self.count = max(self.count, number)
            self._changed.notify_all()


def default_group_news(namespace: str, scope: str) -> NewsWatch | None:
    """The ``NewsWatch`` of this process's default group (``scope`` in the job's ``namespace``),
    started at the first call for that group; None without a group or a TCP store under it."""
    try:
        group, store = dist.distributed_c10d._get_default_group(), dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
    with PROCESS.news_lock:
        held = PROCESS.news
        if held is not None and held[0]() is group:
            known: NewsWatch | None = held[1]
            return known
        tcp = tcp_store_under(store)
        watch = None if tcp is None else NewsWatch((tcp.host, tcp.port), store_keys.news_base(namespace, scope), group)
        PROCESS.news = (weakref.ref(group), watch)
        return watch
