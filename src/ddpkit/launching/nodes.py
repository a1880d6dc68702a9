"""The launchers of a multi-node job restarting together (``ddpkit run --nnodes N --max-restarts M``).

Every node's launcher reaches the job's store, which node 0's launcher hosts
(``launching.store_host``; the workers meet through it too, one key prefix per attempt), and the
launchers agree through keys under ``ddpkit/launchers/attempt/A/``, A counting the starts of
the workers as ``DDPKIT_RESTART_COUNT`` does:

- a launcher whose workers failed says so at once (``announce_failure``): the other launchers
  poll for it beside their workers (``ended_elsewhere``) and end theirs; then every launcher
  publishes what it saw (``publish_cause``) and, once all have, names the same root cause
  (``root_cause``): a rank that ended without recording an exception comes first (its peers'
  errors are consequences), else the earliest recorded exception, as on one node;
- a launcher stopped by a signal says so (``announce_stop``): the others end their workers and
  none restarts;
- a launcher whose workers all succeeded waits for the other nodes' (``finish``): a failure
  elsewhere is this attempt's failure too;
- before a restart every launcher waits for the others (``meet``, within
  ``DDPKIT_RECOVERY_TIMEOUT_SECONDS``). Each counts its restarts itself: with the same
  ``--max-restarts`` on every node they agree on when to give up;
- the launcher that hosts the store (node 0's; under a c10d rendezvous the one on the endpoint's
  host) keeps it until every launcher has left (``leave``), or a few seconds.

Under a c10d rendezvous (``launching.rendezvous``) this agreement is used whenever there are several
nodes, restarts or not: the store is a launcher's, so the one that hosts it must outlive the others.

This module imports ``torch.distributed`` for the store's client, and only when a launcher
connects: single-node launching stays free of torch (docs/architecture.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = ["FailureCause", "NodeContactLostError", "NodeCoordination"]

# How long a launcher waits for node 0's store to answer one request once connected: a node 0
# that vanished from the network (no connection reset) must not hold the others longer.
_REQUEST_TIMEOUT = timedelta(seconds=30)
# How long a launcher waits for node 0's store to come up at the start: the nodes of a job are
# rarely started at the same second (torchrun's rendezvous waits 600 s by default too).
_CONNECT_TIMEOUT = timedelta(minutes=10)
# While waiting for it, how often the launcher looks up from the store's client to ask whether its
# own workers are still worth the wait (the client cannot be interrupted).
_CONNECT_TRY_SECONDS = 2.0
_POLL_SECONDS = 0.02


class NodeContactLostError(RuntimeError):
    """The job's store on node 0 stopped answering: node 0's launcher ended or its host is gone."""


@dataclass(frozen=True)
class FailureCause:
    """What one node's launcher saw as the root cause of its workers' failure."""

    node: int
    text: str  # the summary (``WorkerProcesses.describe_root_cause``)
    recorded_at: float | None  # when the exception was recorded; None: the rank ended without recording one

    def rank_key(self) -> tuple[int, float, int]:
        """Sorts the likelier root cause first: no record (killed, exited) before the earliest record."""
        return (0 if self.recorded_at is None else 1, self.recorded_at or 0.0, self.node)


class NodeCoordination:
    """One launcher's side of the agreement between the launchers of a multi-node job."""

    def __init__(self, store: Any, node_rank: int, nnodes: int, address: str, port: int,
                 hosts_store: bool | None = None) -> None:
        self._store = store
        self.node_rank = node_rank
        self.nnodes = nnodes
        self._where = f"{address}:{port}"
        # Whether this launcher hosts the store (then it leaves last): node 0's, or under a c10d
        # rendezvous the one on the endpoint's host (``launching.rendezvous``).
        self.hosts_store = node_rank == 0 if hosts_store is None else hosts_store
        self.attempt = 0

    @classmethod
    def connect(cls, address: str, port: int, node_rank: int, nnodes: int,
                workers_failed: Callable[[], str | None] = lambda: None) -> NodeCoordination:
        """Reach the job's store on node 0, waiting for it to come up (up to 10 minutes) while
        ``workers_failed`` returns None. The workers start before this: when they fail meanwhile
        (it describes how), the store is not awaited any longer. Node 0's launcher may have
        ended after its workers met this node's, and a store that is gone never comes up."""
        import torch.distributed as dist

        deadline = time.monotonic() + _CONNECT_TIMEOUT.total_seconds()
        while True:
            try_seconds = max(0.1, min(_CONNECT_TRY_SECONDS, deadline - time.monotonic()))
            try:
                store = dist.TCPStore(address, port, is_master=False,  # type: ignore[attr-defined]
                                      timeout=timedelta(seconds=try_seconds), wait_for_workers=False)
                break
            except Exception as error:  # torch raises DistStoreError, RuntimeError or OSError, by cause
                failure = workers_failed()
                if failure is not None:
                    raise NodeContactLostError(
                        f"node {node_rank}'s launcher lost contact with the job's store at {address}:{port} before "
                        f"it could join it ({error}), and meanwhile {failure}: the launcher that hosts the store "
                        "(node 0's) ended or its host is unreachable. Its output says why.") from None
                if time.monotonic() >= deadline:
                    raise NodeContactLostError(
                        f"node {node_rank}'s launcher could not reach the job's store at {address}:{port} (hosted "
                        f"by the launcher of node 0) within {_CONNECT_TIMEOUT.total_seconds():g} s: {error}. Start "
                        "`ddpkit run --node-rank 0` with the same --master-addr and --master-port, and check that "
                        "this host can reach it.") from None
        store.set_timeout(_REQUEST_TIMEOUT)
        return cls(store, node_rank, nnodes, address, port)

    def _key(self, name: str, attempt: int | None = None) -> str:
        return f"ddpkit/launchers/attempt/{self.attempt if attempt is None else attempt}/{name}"

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._store, method)(*args)
        except Exception as error:  # the store's client raises several kinds, all meaning the same here
            raise NodeContactLostError(
                f"node {self.node_rank}'s launcher lost contact with the job's store at {self._where} "
                f"({type(error).__name__}: {error}): the launcher that hosts it (node 0's, or the one on the "
                "rendezvous endpoint's host) ended or its host is unreachable. Its output says why.") from None

    def _has(self, name: str, attempt: int | None = None) -> bool:
        return bool(self._call("check", [self._key(name, attempt)]))

    def announce_failure(self) -> None:
        """Tell the other launchers that this node's workers failed in the current attempt."""
        self._call("add", self._key("failed"), 1)

    def announce_stop(self, reason: str) -> None:
        """Tell the other launchers to end their workers and not restart (a stop signal here)."""
        self._call("set", self._key("stop"), f"node {self.node_rank}'s launcher {reason}")

    def ended_elsewhere(self) -> bool:
        """Whether another node's launcher announced a failure or a stop in the current attempt."""
        return self._has("failed") or self._has("stop")

    def stop_reason(self, attempt: int | None = None) -> str | None:
        """Why another launcher stopped the job (no restart), when one did."""
        if not self._has("stop", attempt):
            return None
        return bytes(self._call("get", self._key("stop", attempt))).decode()

    def publish_cause(self, cause: FailureCause | None) -> None:
        """Publish this node's view of the attempt's end, for ``root_cause``: the cause of its
        workers' failure, or None (they were ended because of another node, or by a signal)."""
        value = json.dumps(None if cause is None else {"text": cause.text, "recorded_at": cause.recorded_at})
        self._call("set", self._key(f"cause/{self.node_rank}"), value)

    def root_cause(self, wait_seconds: float) -> FailureCause | None:
        """The root cause of the current attempt's failure, once every node published its view
        (``publish_cause``), or from those that did within ``wait_seconds`` (a node whose
        launcher vanished publishes nothing); None when no node saw a failure of its own.

        Waiting for every node is what makes every launcher name the same cause: a node's
        workers may fail first while its launcher notices last."""
        deadline = time.monotonic() + wait_seconds
        while True:
            views = {node: self._view(node) for node in range(self.nnodes)
                     if self._has(f"cause/{node}")}
            if len(views) == self.nnodes or time.monotonic() > deadline:
                causes = [cause for cause in views.values() if cause is not None]
                return min(causes, key=FailureCause.rank_key) if causes else None
            time.sleep(_POLL_SECONDS)

    def _view(self, node: int) -> FailureCause | None:
        value = json.loads(bytes(self._call("get", self._key(f"cause/{node}"))).decode())
        return None if value is None else FailureCause(node, str(value["text"]), value["recorded_at"])

    def finish(self, poll: float = 0.05) -> bool:
        """Count this node's workers as done and wait until every node's are (True), or another
        launcher announces a failure or a stop in this attempt (False)."""
        self._call("add", self._key("succeeded"), 1)
        while int(self._call("add", self._key("succeeded"), 0)) < self.nnodes:
            if self.ended_elsewhere():
                return False
            time.sleep(poll)
        return True

    def meet(self, attempt: int, timeout_seconds: float) -> None:
        """Wait until every node's launcher is ready to start ``attempt`` (a restart), then make it
        the current one. Raises ``TimeoutError`` naming the nodes that did not come."""
        self._call("set", self._key(f"arrived/{self.node_rank}", attempt), "1")
        deadline = time.monotonic() + timeout_seconds
        while True:
            missing = [node for node in range(self.nnodes) if not self._has(f"arrived/{node}", attempt)]
            if not missing:
                self.attempt = attempt
                return
            stopped = self.stop_reason(attempt - 1)
            ended = [node for node in missing if self._call("check", [f"ddpkit/launchers/left/{node}"])]
            if stopped is not None or ended or time.monotonic() > deadline:
                why = (f"({stopped})" if stopped else "(they ended)" if ended else
                       f"within {timeout_seconds:g} s (DDPKIT_RECOVERY_TIMEOUT_SECONDS)")
                raise TimeoutError(
                    f"restart {attempt}: the launchers of node(s) {', '.join(map(str, missing))} did not come back "
                    f"{why}; every node's `ddpkit run` needs the same --nnodes and --max-restarts, and their output "
                    "says why they ended.")
            time.sleep(_POLL_SECONDS)

    def leave(self, wait_seconds: float) -> None:
        """Count this launcher out; the one that hosts the store waits for the others first, up to
        ``wait_seconds``, so that none loses the store while it still reads it."""
        try:
            self._call("set", f"ddpkit/launchers/left/{self.node_rank}", "1")
            left = int(self._call("add", "ddpkit/launchers/left", 1))
            deadline = time.monotonic() + wait_seconds
            while self.hosts_store and left < self.nnodes and time.monotonic() < deadline:
                time.sleep(_POLL_SECONDS)
                left = int(self._call("add", "ddpkit/launchers/left", 0))
        except NodeContactLostError:
            pass  # node 0 already gone: nothing to wait for
