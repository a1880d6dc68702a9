"""News relayed by the launcher: a rank's watches read the store when something happened, not
several times a second.

A rank's peer watch (a peer's published failure) and hang watch (a request for its stack) used
to read the group's store four times a second and once a second each, which at a thousand nodes
of eight ranks is most of the store's load (issue 62). Under ``ddpkit run`` across nodes the
launcher already reads the job's count of news four times a second (``control_plane.nodes``): every
record a launcher writes raises it, and so, here, does every record a rank writes that the others
must react to (``announce``: a published failure, a lost peer's note, a hang request, the last
rank to count itself into a generation of the group; the workers' store is the launchers' then).
The launcher writes the count to a file of its own folder (``DDPKIT_NEWS_FILE``), and the watches
look at that file (a local read) and ask the store only
when it changed, and every ``FALLBACK_SECONDS`` besides. A rank's news thus reaches the others'
watches within the launcher's look and the watch's (about 0.5 s).

Without that file (no launcher, one node, torchrun) the watches read the store as before. A
blocking wait on the store was tried instead and left: docs/hazards.md says why.
"""

from __future__ import annotations

import os
from typing import Any

from ddpkit.store import keys as store_keys
from ddpkit.store.job_secret import RecordSigner, job_secret
from ddpkit.variables import DDPKIT_NEWS_FILE

__all__ = ["FALLBACK_SECONDS", "RelayedNews", "announce", "relayed_news", "tcp_store_under", "write_news_file"]

# How often a watch reads the store anyway when its launcher relays news (a record written by a
# process that raised no news, a launcher that stopped relaying): rarely, since every rank under a
# relaying launcher raises the news, and a launcher's end ends its workers.
FALLBACK_SECONDS = 15.0


def announce(store: Any) -> None:
    """Raise the job's count of news after a record the other ranks must react to was written in
    ``store`` (a group's store), when a launcher relays it (``DDPKIT_NEWS_FILE``); nothing otherwise."""
    if not os.environ.get(DDPKIT_NEWS_FILE):
        return
    tcp = tcp_store_under(store)
    if tcp is not None:
        tcp.add(store_keys.launchers_news(RecordSigner(job_secret()).namespace), 1)


class RelayedNews:
    """One watch's look at the launcher's file of news."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._seen: str | None = None

    def changed(self) -> bool:
        """Whether the count in the file changed since this watch last looked (True the first time,
        and when the file cannot be read: the watch then asks the store)."""
        try:
            with open(self._path, encoding="ascii") as handle:
                count = handle.read()
        except OSError:
            return True
        fresh = count != self._seen
        self._seen = count
        return fresh


def relayed_news() -> RelayedNews | None:
    """A watch's look at its launcher's news, or None when no launcher relays it here."""
    path = os.environ.get(DDPKIT_NEWS_FILE)
    return RelayedNews(path) if path and os.path.exists(path) else None


def write_news_file(path: str, count: int) -> None:
    """The launcher's side: the job's count of news, replaced at once (a reader sees the old or the new)."""
    partial = f"{path}.partial"
    with open(partial, "w", encoding="ascii") as handle:
        handle.write(str(count))
    os.replace(partial, path)


def tcp_store_under(store: Any) -> Any:
    """The TCP store under ``store``'s prefixes and wrappers (the job's, where the launchers count
    their news; ``failures.store_host_gone`` probes its address); None for another kind of store."""
    while store is not None and hasattr(store, "underlying_store"):
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return store if isinstance(host, str) and isinstance(port, int) else None
