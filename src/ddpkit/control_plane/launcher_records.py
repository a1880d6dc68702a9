"""The launchers' signed records in the job's store: what ``control_plane.nodes`` and its parts read
and write to agree across nodes (their names: ``ddpkit.store.keys``, under ``launchers/``).

With a job secret every value carries its HMAC (``ddpkit.store.job_secret``) and a forged one reads as
absent. A record one node writes for itself is ``name/<node>``, with an unsigned count beside it
that only says when there may be something new to read, and every record written raises the job's
count of news (``news``): a launcher that polls for what the others said reads that one count, and
the records only when it changed, so that its requests do not grow with the records or the nodes.
What every launcher must learn of one by one (a node reported silent, the world shrunk or grown)
is also appended to a log of its own (``append``), which each reader reads on from where it
stopped (``read_log``): a change costs each launcher the entries it adds, not a read per node.
Every request is bounded (``BoundedStore``); a store that does not answer or is gone is
``NodeContactLostError``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ddpkit.store import keys
from ddpkit.store.client import BoundedStore, StoreRequestTimeout
from ddpkit.store.job_secret import RecordSigner, job_secret

__all__ = ["LauncherRecords", "NodeContactLostError", "clear_worker_keys", "launcher_key_prefixes", "may_wait_beyond_max"]


def launcher_key_prefixes() -> tuple[str, ...]:
    """Keys that belong to the launchers (``LauncherRecords``, ``launching.rendezvous``) and outlive
    attempts: under the job's prefix (``ddpkit.store.job_secret``; the store host has the launcher's
    environment), and the rendezvous id, which is outside it."""
    return keys.launcher_prefixes(RecordSigner(job_secret()).namespace)


def clear_worker_keys(store: Any) -> int:
    """Delete every key of ``store`` but the launchers'; the number deleted."""
    deleted = 0
    kept = launcher_key_prefixes()
    for key in store.list_keys():
        if not key.startswith(kept) and store.delete_key(key):
            deleted += 1
    return deleted


class NodeContactLostError(RuntimeError):
    """The job's store on node 0 stopped answering: node 0's launcher ended or its host is gone."""


def may_wait_beyond_max(store: Any, beyond: int) -> bool:
    """Whether a launcher that arrived at the rendezvous ``beyond`` places past MAX may wait as a
    spare node: once a launcher of the job shrank the world (it may bring a removed node back), or
    once the job recovered from at least ``beyond`` lost nodes (each lost node's launcher still
    counts among the arrivals, though it is gone: live launchers stay within MAX)."""
    signer = RecordSigner(job_secret(), "launchers")
    removals = keys.launcher_record(keys.count_of(keys.REMOVED_NODE), keys.JOB_WIDE)
    if int(store.add(signer.key(removals), 0)) > 0:
        return True
    return int(store.add(signer.key(keys.launcher_record(keys.NODE_LOSSES, keys.JOB_WIDE)), 0)) >= beyond


class LauncherRecords:
    """One launcher's reader and writer of the launchers' records. ``attempt`` is the attempt its
    records belong to unless one is named (``store_keys.JOB_WIDE``: the job's); ``node_rank`` the
    node it writes as (a spare node's launcher takes a lost node's)."""

    def __init__(self, store: BoundedStore, node_rank: int, where: str) -> None:
        self.store = store
        self.node_rank = node_rank
        self.attempt = 0
        self._where = where  # the store's address, for the errors
        self._signer = RecordSigner(job_secret(), "launchers")
        self._news_key = keys.launchers_news(self._signer.namespace)
        # Keys seen in the store: a launcher's keys are never deleted while the job runs, so these
        # can be read together with one ``multi_get`` (which would wait for a key not there).
        self._present: set[str] = set()
        # What ``nodes_that_said`` read of each (name, attempt): the log's entries read, the nodes in them.
        self._said: dict[tuple[str, int], tuple[int, set[int]]] = {}

    def key(self, name: str, attempt: int | None = None) -> str:
        """The store key of ``name`` in ``attempt`` (the current one by default)."""
        return self._signer.key(keys.launcher_record(name, self.attempt if attempt is None else attempt))

    def sign(self, key: str, value: str) -> str:
        return self._signer.sign(key, value)

    def put(self, name: str, value: str, attempt: int | None = None, news: bool = True) -> None:
        """Write the signed record ``name``; ``news``: raise the job's count of news after it (False
        for a record no launcher polls for, such as a health window: raising it would make every
        launcher read the records again)."""
        self.call(self._signer.write, self.store, self.key(name, attempt), value)
        if news:
            self.raise_news()

    def news(self) -> int:
        """The job's count of records written: unchanged since a read, no record was written since
        (raised after each write, so a record is there once the count says so). Not signed: a
        stranger who raises it only makes the launchers read the records again."""
        return int(self.call("add", self._news_key, 0))

    def raise_news(self) -> None:
        """Raise the job's count of news: after a record written through ``call`` that the launchers or
        the workers must react to (a node's loss announced to a generation)."""
        self.call("add", self._news_key, 1)

    def news_and_reads(self, names: list[str], attempt: int | None = None) -> tuple[int, list[str | None]]:
        """The job's count of news (``news``) and ``read`` of each of ``names``, in one request
        (a ``multi_get``) once each key was seen in the store; a key not seen yet costs a ``check``
        until it is there (a node's first beat). How a launcher looks at the job each period."""
        found = [self.key(name, attempt) for name in names]
        if self._news_key not in self._present:
            self.news()  # creates the count
            self._present.add(self._news_key)
        unseen = [key for key in found if key not in self._present]
        for key in unseen:
            if self.call("check", [key]):
                self._present.add(key)
        present = [key for key in found if key in self._present]
        values = self.call("multi_get", [self._news_key, *present])
        read = dict(zip(present, values[1:], strict=True))
        return int(values[0]), [None if key not in read else self._signer.verify(key, read[key]) for key in found]

    def append(self, name: str, value: str, attempt: int | None = None) -> None:
        """Append the signed ``value`` to the log ``name`` (``read_log``), and raise the news after it."""
        index = self.count(keys.count_of(name), 1, attempt)
        self.put(keys.log_entry(name, index), value, attempt)

    def append_once(self, name: str, once: str, value: str) -> bool:
        """``append`` to the job-wide log ``name``, unless a launcher appended for ``once`` already
        (the first to ask does): True when this one did."""
        key = self.key(keys.log_entry(name, once), keys.JOB_WIDE)
        signed = self._signer.sign(key, value)
        if self.call("compare_set", key, "", signed) != signed.encode():
            return False
        self.append(name, value, keys.JOB_WIDE)
        return True

    def read_log(self, name: str, after: int, attempt: int | None = None) -> list[str]:
        """The entries of the log ``name`` after the first ``after``, in order, up to the first not
        written yet (its writer raises the news once it is: read on then), in two requests. A
        forged entry reads as an empty one."""
        count = self.hint(name, attempt)
        wanted = [self.key(keys.log_entry(name, index), attempt) for index in range(after + 1, count + 1)]
        if not wanted:
            return []
        if self.call("check", wanted):
            values = self.call("multi_get", wanted)
            return [self._signer.verify(key, value) or "" for key, value in zip(wanted, values, strict=True)]
        entries = []
        for index in range(after + 1, count + 1):
            entry = self.read(keys.log_entry(name, index), attempt)
            if entry is None:
                break
            entries.append(entry)
        return entries

    def read(self, name: str, attempt: int | None = None) -> str | None:
        """The value a launcher of the job wrote under ``name``; None when there is none (or a forged one)."""
        value: str | None = self.call(self._signer.read, self.store, self.key(name, attempt))
        return value

    def all_written(self, names: list[str], attempt: int | None = None) -> bool:
        """Whether a record is written under each of ``names`` (one request; not checked for a signature)."""
        return not names or bool(self.call("check", [self.key(name, attempt) for name in names]))

    def has(self, name: str, attempt: int | None = None) -> bool:
        return self.read(name, attempt) is not None

    def claim_first(self, name: str, claimant: str) -> bool:
        """Write ``claimant`` under the job-wide ``name`` unless something is there: True for the one
        launcher whose claim was written first."""
        key = self.key(name, keys.JOB_WIDE)
        signed = self._signer.sign(key, claimant)
        won = bool(self.call("compare_set", key, "", signed) == signed.encode())
        if won:
            self.raise_news()
        return won

    def count(self, name: str, by: int = 0, attempt: int | None = None) -> int:
        """The counter ``name`` raised by ``by`` (0: read)."""
        return int(self.call("add", self.key(name, attempt), by))

    def hint(self, name: str, attempt: int | None = None) -> int:
        """The count beside ``name``'s signed records: a change to read them for (not itself believed)."""
        return self.count(keys.count_of(name), 0, attempt)

    def say(self, node: int, name: str, value: str = "1", attempt: int | None = None) -> None:
        """The signed ``name/<node>`` of ``node`` (this launcher's, or one the world shrank without),
        then the node in the log ``name`` (its count raised first), then the news: a launcher that
        reads the news reads the count raised (``nodes_that_said``)."""
        self.call(self._signer.write, self.store, self.key(keys.of(name, node), attempt), value)
        index = self.count(keys.count_of(name), 1, attempt)
        self.call(self._signer.write, self.store, self.key(keys.log_entry(name, index), attempt), str(node))
        self.raise_news()

    def nodes_that_said(self, name: str, nodes: Iterable[int], attempt: int | None = None) -> list[int]:
        """Those of ``nodes`` that said ``name``: the log ``name`` read on from where this launcher
        stopped (one request when nothing was said since; the entries said since otherwise, never
        a read per node)."""
        attempt = self.attempt if attempt is None else attempt
        read, said = self._said.setdefault((name, attempt), (0, set()))
        entries = self.read_log(name, read, attempt)
        if entries:
            said = said | {int(entry) for entry in entries if entry.lstrip("-").isdigit()}
            self._said[(name, attempt)] = (read + len(entries), said)
        return [node for node in nodes if node in said]

    def call(self, method: str | Callable[..., Any], *args: Any) -> Any:
        """The store's ``method`` (or a function of the store, given it in ``args``) called; a store that
        does not answer or is gone is ``NodeContactLostError``."""
        try:
            return method(*args) if callable(method) else getattr(self.store, method)(*args)
        except StoreRequestTimeout:
            raise NodeContactLostError(
                f"node {self.node_rank}'s launcher got no answer from the job's store at {self._where}: it did not "
                f"answer a request within {self.store.seconds:g} s (--rdzv-conf read_timeout). The launcher that "
                "hosts it (node 0's, or the one on the rendezvous endpoint's host) is frozen, or its host unreachable."
            ) from None
        except Exception as error:  # the store's client raises several kinds, all meaning the same here
            raise NodeContactLostError(
                f"node {self.node_rank}'s launcher lost contact with the job's store at {self._where} "
                f"({type(error).__name__}: {error}): the launcher that hosts it (node 0's, or the one on the "
                "rendezvous endpoint's host) ended or its host is unreachable. Its output says why.") from None
