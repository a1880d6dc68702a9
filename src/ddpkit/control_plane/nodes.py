"""The launchers of a multi-node job restarting together (``ddpkit run --nnodes N --max-restarts M``).

Every node's launcher reaches the job's store, which node 0's launcher hosts
(``launching.store_host``; the workers meet through it too, one key prefix per attempt), and the
launchers agree through keys under ``<the job's prefix>launchers/attempt/A/``, A counting the
starts of the workers as ``DDPKIT_RESTART_COUNT`` does. With a job secret (``ddpkit.store.job_secret``)
every value they read carries its HMAC, and a forged one is ignored: a stranger who reaches the
store cannot stop the job, fail an attempt or name its cause. Where a count would do, each
launcher writes a signed key of its own, and a count (which cannot be signed) only says that
one may be there to read:

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
  ``DDPKIT_RECOVERY_TIMEOUT_SECONDS``); the one that hosts the store then clears the workers' keys
  of the attempts so far (``StoreHost.clear_worker_keys``), and no node starts the next attempt
  before it has. Each counts its restarts itself: with the same ``--max-restarts`` on every node they agree on
  when to give up;
- the launcher that hosts the store (node 0's; under a c10d rendezvous the one on the endpoint's
  host) keeps it until every launcher has left (``leave``), or a few seconds;
- each launcher says it is alive once a second from a thread of its own (``control_plane.heartbeats``): one
  silent for the silent time (``control_plane.heartbeats``), or never heard from within the join timeout, is taken for lost
  (``silent_node``), which ends the others' workers as its failure would have, since nothing else
  may tell them (a rank killed before the group formed breaks no connection). A launcher reads only
  the beats it watches (the first live node's all, each other's the two before it) and the nodes
  reported silent, together with the job's count of news, in one request a look
  (``control_plane.job_look``): the launcher that finds a node silent reports it to the others. Under in-place
  recovery a spare node may claim a silent node's place (``launching.spare_node``) and beat as it;
  the lost launcher, if it answers again, finds the spare's beat where its own was (a beat
  replaces only its own last one) and ends its workers without announcing anything
  (``NodeReplacedError``);
- under in-place recovery with ``--nnodes MIN:MAX`` (``Shrinking``, ``control_plane.node_world``), a silent node that no spare
  node takes over while at least MIN nodes would remain is left out instead: the first survivor's
  launcher whose claim on its place wins lays the next generation of the workers' group out
  without its ranks (``ddpkit.membership.generations.Layout``: the survivors train the lost ranks' shares of
  the data too, so the global batch stays), holds those ranks for no process, and tells the
  survivors' workers, which form that generation in place (``ddpkit.training.recovery``). The node is
  *removed*: no launcher waits for it, counts it, or restarts it. A launcher that arrives later
  (``may_wait_beyond_max`` admits it beyond MAX) waits as a spare node and brings a removed node back
  (``bring_back``): the next generation laid out with its ranks again, each taking its own share
  back, which the survivors' workers form at a step boundary they agree on;
- under in-place recovery each node lost and recovered from (taken over by a spare node, or left
  out when the world shrinks) spends one of the job's ``--max-restarts`` (``node_losses_allowed``,
  counted in the store for the whole job; a rank replaced on its own node spends its node's, as
  on one node). Once none is left, a silent node is lost for every launcher, naming the budget;
- a launcher that passes a preemption on says so (``announce_preemption``); one whose workers
  stopped for a preemption no signal brought it names its source (``preemption_source``): another
  launcher's signal, or a lost launcher, whose workers the kernel sent SIGTERM.

``NodeCoordination`` is the facade the launcher holds: the outcome of an attempt (failures, stops,
root cause, the restart barrier, leaving) is its own; its parts are the signed records
(``control_plane.launcher_records``, every key named in ``ddpkit.store.keys``), the heartbeats
(``control_plane.heartbeats``), the claims on a silent node's place (``control_plane.node_claims``) and
the world's nodes as they change (``NodeCoordination.world``: ``control_plane.node_world``).

Under a c10d rendezvous (``launching.rendezvous``) this agreement is used whenever there are several
nodes, restarts or not: the store is a launcher's, so the one that hosts it must outlive the others.

This module imports ``torch.distributed`` for the store's client (``launching.store_client``), and
only when a launcher connects: single-node launching stays free of torch (docs/architecture.md).
Every wait here also ends, with ``GaveUpWaiting``, when the launcher's ``give_up`` gives a reason
(a stop signal, the store host gone).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from ddpkit.control_plane.finished_generations import FinishedGenerations
from ddpkit.control_plane.heartbeats import Heartbeats
from ddpkit.control_plane.job_look import JobLook
from ddpkit.control_plane.launcher_records import (
    LauncherRecords,
    NodeContactLostError,
    clear_worker_keys,
    may_wait_beyond_max,
)
from ddpkit.control_plane.node_claims import ClaimKind, StepAsideRequests, claim_kind, spare_claimed_first
from ddpkit.control_plane.node_world import NodeReplacedError, NodeWorld, Shrinking
from ddpkit.logs import get_logger
from ddpkit.store import keys
from ddpkit.store.client import (
    BoundedStore,
    GaveUpWaiting,
    GiveUp,
    never_give_up,
)
from ddpkit.variables import DDPKIT_RECOVERY_TIMEOUT_SECONDS

_log = get_logger("launching")

__all__ = ["FailureCause", "NodeContactLostError", "NodeCoordination", "NodeReplacedError", "Shrinking", "may_wait_beyond_max"]

_POLL_SECONDS = 0.02
# How long a node's launcher may take to reach the job's store (torchrun's join_timeout, as
# ``launching.rendezvous.StoreWaits``, which the launcher passes on).
_JOIN_SECONDS = 600.0
# How long the others wait for a spare node to claim a silent node before taking it for lost, and
# then for the spare's launcher to say it is alive as that node.
_CLAIM_SECONDS = 2.0
# How often the first live node's launcher reads the count of generations without news.
_GENERATIONS_LOOK_SECONDS = 10.0
_TAKEOVER_SECONDS = 15.0


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
    """One launcher's side of the agreement between the launchers of a multi-node job: the outcome
    of each attempt here, the heartbeats (``heartbeats``) and the world's nodes (``world``) in parts."""

    def __init__(self, store: BoundedStore, node_rank: int, nnodes: int, address: str, port: int,
                 hosts_store: bool | None = None, give_up: GiveUp = never_give_up,
                 join_seconds: float = _JOIN_SECONDS, survivors_go_on: bool = False,
                 shrinking: Shrinking | None = None, node_losses_allowed: int | None = None) -> None:
        self.records = LauncherRecords(store, node_rank, f"{address}:{port}")
        self.heartbeats = Heartbeats(self.records, survivors_go_on)
        # Under in-place recovery (``launching.spare_node``): a silent node may be taken over by a
        # spare, or (``shrinking``) left out of the world.
        self.world = NodeWorld(self.records, self.heartbeats, nnodes, survivors_go_on, shrinking, node_losses_allowed)
        self.step_asides = StepAsideRequests(self.records)  # ``--stragglers replace``
        self._give_up = give_up  # asked while ``finish`` and ``meet`` wait: a reason ends them (GaveUpWaiting)
        self.nnodes = nnodes
        self.survivors_go_on = survivors_go_on
        # Whether this launcher hosts the store (then it leaves last): node 0's, or under a c10d
        # rendezvous the one on the endpoint's host (``launching.rendezvous``).
        self.hosts_store = node_rank == 0 if hosts_store is None else hosts_store
        self._join_seconds = join_seconds
        self._joined_by = time.monotonic() + join_seconds  # a node not heard from by then is not coming
        self._lost: tuple[int, str] | None = None  # another node's launcher taken for lost, and why
        # What this launcher reads of the job at each look (``control_plane.job_look``).
        self.looks = JobLook(self.records, self.heartbeats, self.world)
        self._judged_at = -1.0  # the look whose beats ``silent_node`` judged last
        self._ended_elsewhere = False  # what the records said at the last look that read them
        self._reported: set[tuple[int, str]] = set()  # the silences this launcher reported
        self._arrivals_checked = False  # whether every node's first beat was looked for after the join timeout
        # The first live node's launcher removes the keys of the workers' finished generations.
        self.finished_generations = FinishedGenerations(self.records)
        self._next_generations_look = 0.0
        self._first_of_the_world = False  # this launcher's node is the world's first (``tidy``)

    @property
    def node_rank(self) -> int:
        """The node this launcher is (a spare node's launcher becomes the node whose place it took)."""
        return self.records.node_rank

    @property
    def attempt(self) -> int:
        """The attempt the workers run now (``meet`` opens the next)."""
        return self.records.attempt

    def beat_through(self, store: Any) -> None:
        """Say this launcher is alive, through ``store`` (a client for this alone), until ``leave``."""
        self.heartbeats.beat_through(store)

    def silent_node(self) -> str | None:
        """Why another node's launcher is taken for lost (no beat for the silent time and no word that
        it left, nor, under in-place recovery, a spare node that claimed its place), or None;
        judged at each look (``look``: the nodes this launcher watches, and those reported silent),
        and once lost, always lost. A node found silent here is reported to every launcher."""
        if self._lost is not None:
            return self._lost[1]
        looks = self.looks
        looks.look()
        if self._judged_at == looks.looked_at:
            return None
        now = self._judged_at = looks.looked_at
        silent_seconds = self.heartbeats.silent_seconds
        world = self.world.nodes()
        if now > self._joined_by and not self._arrivals_checked:
            # Once, for every node (not only those watched): a launcher that never beat is not coming.
            self._arrivals_checked = True
            if unheard := self._nodes_never_heard():
                looks.lost_node = unheard[0]
                self._lost = (unheard[0], f"node {unheard[0]}'s launcher did not reach the job's store within "
                                          f"{self._join_seconds:g} s of this one's (--rdzv-conf join_timeout): it ended "
                                          "or was lost before it did")
                return self._lost[1]
        for node, beat in looks.beats.items():
            if node not in world or node in looks.left or node == self.node_rank or beat is None:
                continue  # (None: not arrived yet; its launcher may still be starting)
            if looks.reports.get(node) == beat:
                self.heartbeats.believe_silent(node, beat, now)
            if self.heartbeats.silent_for(node, beat, now) <= silent_seconds:
                continue
            if node not in looks.reports and (node, beat) not in self._reported:
                self._reported.add((node, beat))
                self.heartbeats.report_silent(node, beat)
            if self._taken_over(node, beat, now) or self.world.shrinks_without(node, beat):
                continue
            if self.survivors_go_on and spare_claimed_first(self.records, node, beat, self.heartbeats.who()) and \
                    now - self.heartbeats.seen_silent_since(node, now) < _TAKEOVER_SECONDS:
                continue  # a spare's claim came first after all: its beat is waited for (``_taken_over``)
            spent = ""
            if not self.world.node_losses_left():
                allowed = self.world.node_losses_allowed
                spent = (f"; the job recovered from {allowed} lost node(s) already, all that "
                         f"--max-restarts={allowed} allows, so it ends")
            self._lost = (node, f"node {node}'s launcher went silent: no word from it for "
                                f"{silent_seconds:g} s (killed with its workers, or its host lost){spent}")
            looks.lost_node = node
            break
        return None if self._lost is None else self._lost[1]

    def _taken_over(self, node: int, beat: str, now: float) -> bool:
        """Under in-place recovery, whether the silent ``node`` (whose last beat was ``beat``) is being
        taken over by a spare node: claimed within ``_CLAIM_SECONDS``, the claimant then given
        ``_TAKEOVER_SECONDS`` to beat as that node."""
        if not self.survivors_go_on:
            return False
        since = self.heartbeats.seen_silent_since(node, now)
        claimant = self.world.claimant(node, beat)
        if claimant is None:
            # Once the world shrank, a launcher that arrives later waits as a spare, whatever MAX.
            shrinking = self.world.shrinking
            spares_possible = shrinking is None or shrinking.spares_possible or self.world.removals_seen > 0
            return spares_possible and now - since < _CLAIM_SECONDS and self.world.node_losses_left()
        return claim_kind(claimant) is ClaimKind.SPARE and now - since < _TAKEOVER_SECONDS

    def announce_failure(self) -> None:
        """Tell the other launchers that this node's workers failed in the current attempt
        (``NodeReplacedError`` instead when a spare node took this node's place)."""
        self.world.check_not_replaced(ask_store=True)
        self.records.say(self.node_rank, keys.FAILED)

    def announce_stop(self, reason: str) -> None:
        """Tell the other launchers to end their workers and not restart (a stop signal here)."""
        self.records.put(keys.STOP, f"node {self.node_rank}'s launcher {reason}")

    def ended_elsewhere(self) -> bool:
        """Whether another node's launcher announced a failure or a stop in the current attempt, left
        the job, or went silent (``silent_node``): its workers are gone, and this node's would wait.
        ``NodeReplacedError`` when a spare node took this node's place (``replaced_by``)."""
        # Under in-place recovery the store is asked too whether a claim on this node's place was
        # written: a node asked to step aside (``--stragglers replace``) that the world shrank without
        # has no spare beating over its beat.
        # The records are read only when a launcher wrote one since the last look (a claim on this
        # node's place, a failure, a stop, a node that left: ``JobLook.news_since``).
        if self.looks.news_since("ended_elsewhere"):
            self.world.check_not_replaced(ask_store=True)
            self._ended_elsewhere = (bool(self._nodes_that_said(keys.FAILED)) or self.records.has(keys.STOP)
                                     or bool(self.looks.left))
        else:
            self.world.check_not_replaced(ask_store=False)
        return self._ended_elsewhere or self.silent_node() is not None

    def tidy(self) -> None:
        """Between the watch's polls, under in-place recovery: the first live node's launcher removes
        the finished generations' keys (``control_plane.finished_generations``), looking at the count
        of generations when news came (a node lost or back) and every ``_GENERATIONS_LOOK_SECONDS``
        besides (a rank replaced on its node raises no news)."""
        if not self.survivors_go_on:
            return
        # Whether this node is the world's first is asked again only then: the world changes with news.
        if self.looks.news_since("finished generations") or time.monotonic() >= self._next_generations_look:
            self._next_generations_look = time.monotonic() + _GENERATIONS_LOOK_SECONDS
            self._first_of_the_world = self.node_rank == min(self.world.nodes(), default=-1)
            if self._first_of_the_world:
                self.finished_generations.on_news()
        if self._first_of_the_world:
            self.finished_generations.remove_some()

    def announce_preemption(self, reason: str) -> None:
        """Tell the other launchers that this one passed a preemption on to its workers (they stop
        with the others' at the same step through their own agreement)."""
        self.records.put(keys.of(keys.PREEMPTED, self.node_rank), f"node {self.node_rank}'s launcher {reason}")

    def preemption_source(self) -> str:
        """Where the preemption this node's workers stopped for came from, when no signal came to
        this launcher: another launcher that announced one, or a launcher gone silent (its workers
        had SIGTERM from the kernel when it died, and saved as for a preemption); waits up to
        the silent time out of place (``control_plane.heartbeats``) and a little for either."""
        deadline = time.monotonic() + Heartbeats.SILENT_SECONDS + 2.0
        while True:
            said = [text for node in self.world.nodes()
                    if (text := self.records.read(keys.of(keys.PREEMPTED, node))) is not None]
            if said:
                return "; ".join(said)
            if (silent := self.silent_node()) is not None:
                return f"the workers of a lost launcher, which saved as for a preemption: {silent}"
            if time.monotonic() > deadline:
                # A launcher killed while it still imported torch or reached the store never beat:
                # its workers had SIGTERM from the kernel as well.
                if unheard := self._nodes_never_heard():
                    return (f"the workers of node(s) {', '.join(map(str, unheard))}, whose launcher never reached "
                            "the job's store: lost before it did (its workers had SIGTERM when it died), or "
                            "signalled by a user there")
                return "no launcher: a worker was signalled by itself"
            time.sleep(0.1)

    def _nodes_never_heard(self) -> list[int]:
        """The world's other nodes whose launcher never beat, nor said it left (one request when all did)."""
        others = [node for node in self.world.nodes() if node != self.node_rank]
        if self.records.all_written([keys.of(keys.BEAT, node) for node in others], keys.JOB_WIDE):
            return []
        left = set(self.world.nodes_left())
        return [node for node in others if node not in left and self.heartbeats.last_beat(node) is None]

    def stop_reason(self, attempt: int | None = None) -> str | None:
        """Why another launcher stopped the job (no restart), when one did."""
        return self.records.read(keys.STOP, attempt)

    def publish_cause(self, cause: FailureCause | None) -> None:
        """Publish this node's view of the attempt's end, for ``root_cause``: the cause of its
        workers' failure, or None (they were ended because of another node, or by a signal)."""
        self.records.put(keys.of(keys.CAUSE, self.node_rank), json.dumps(
            None if cause is None else {"text": cause.text, "recorded_at": cause.recorded_at}))

    def root_cause(self, wait_seconds: float) -> FailureCause | None:
        """The root cause of the current attempt's failure, once every node published its view
        (``publish_cause``), or from those that did within ``wait_seconds`` (a node whose
        launcher vanished publishes nothing); None when no node saw a failure of its own.

        Waiting for every node is what makes every launcher name the same cause: a node's
        workers may fail first while its launcher notices last."""
        deadline = time.monotonic() + wait_seconds
        while True:
            world = self.world.nodes()
            views = {node: self._view(node, view) for node in world
                     if (view := self.records.read(keys.of(keys.CAUSE, node))) is not None}
            # A launcher taken for lost publishes nothing: not waited for.
            if len(views) == len(world) - (self._lost is not None) or time.monotonic() > deadline:
                causes = [cause for cause in views.values() if cause is not None]
                return min(causes, key=FailureCause.rank_key) if causes else None
            time.sleep(_POLL_SECONDS)

    @staticmethod
    def _view(node: int, published: str) -> FailureCause | None:
        value = json.loads(published)
        return None if value is None else FailureCause(node, str(value["text"]), value["recorded_at"])

    def finish(self, poll: float = 0.05) -> bool:
        """Count this node's workers as done and wait until every node's are (True), or another
        launcher announces a failure or a stop in this attempt (False)."""
        self.records.say(self.node_rank, keys.SUCCEEDED)
        succeeded: list[int] = []
        while True:
            if self.looks.news_since("finish"):  # a node that says it succeeded raises the news
                succeeded = self._nodes_that_said(keys.SUCCEEDED)
                if len(succeeded) >= len(self.world.nodes()):
                    return True
            # A node that finished too may leave between the two reads: its success counts first.
            if self.ended_elsewhere() and self._nodes_that_said(keys.SUCCEEDED) == succeeded:
                return False
            self._check_give_up()
            time.sleep(poll)

    def meet(self, attempt: int, timeout_seconds: float) -> None:
        """Wait until every node's launcher is ready to start ``attempt`` (a restart), then make it
        the current one. Raises ``TimeoutError`` naming the nodes that did not come.

        Node 0's launcher then clears the workers' keys of the attempts before through its client
        (a plain torch script's ``env://`` connection keeps no keys per attempt; the store may be
        any launcher's, or outside the nodes: ``ddpkit store``) and says the attempt is open; the
        others wait for that before they start workers."""
        self._refuse_a_shrunk_world(attempt)
        self.records.say(self.node_rank, keys.ARRIVED_NODE, "1", attempt)
        deadline = time.monotonic() + timeout_seconds
        said_waiting = False
        while True:
            # A stop signal comes first: its exit code (128 + the signal) says the user ended the job.
            self._check_give_up()
            # Looked at on every pass: the world may shrink while this launcher waits (a node lost in
            # a collective between steps fails the survivors' workers about as soon as it is gone,
            # and the world shrinks without it a heartbeat's silence later).
            self._refuse_a_shrunk_world(attempt)
            arrived = set(self.records.nodes_that_said(keys.ARRIVED_NODE, range(self.nnodes), attempt))
            missing = [node for node in range(self.nnodes) if node not in arrived]
            if not missing:
                break
            if not said_waiting:  # a launcher that waits says for whom, once
                _log.info(f"ddpkit run: restart {attempt}: waiting for the launchers of node(s) "
                          f"{', '.join(map(str, missing))} (up to {timeout_seconds:g} s, {DDPKIT_RECOVERY_TIMEOUT_SECONDS})")
                said_waiting = True
            stopped = self.stop_reason(attempt - 1)
            ended = [node for node in missing if self.world.said_left(node)]
            silent = self.silent_node()
            if stopped is not None or ended or silent or time.monotonic() > deadline:
                why = (f"({stopped})" if stopped else "(they ended)" if ended else f"({silent})" if silent else
                       f"within {timeout_seconds:g} s ({DDPKIT_RECOVERY_TIMEOUT_SECONDS})")
                raise TimeoutError(
                    f"restart {attempt}: the launchers of node(s) {', '.join(map(str, missing))} did not come back "
                    f"{why}; every node's `ddpkit run` needs the same --nnodes and --max-restarts, and their output "
                    "says why they ended.")
            time.sleep(_POLL_SECONDS)
        if self.node_rank == 0:
            self.records.call(clear_worker_keys, self.records.store)
            self.records.put(keys.OPEN, "1", attempt)
        while not self.records.has(keys.OPEN, attempt):
            if time.monotonic() > deadline:
                raise TimeoutError(f"restart {attempt}: node 0's launcher did not open it within "
                                   f"{timeout_seconds:g} s ({DDPKIT_RECOVERY_TIMEOUT_SECONDS}); its output says why.")
            self._check_give_up()
            time.sleep(_POLL_SECONDS)
        self.records.attempt = attempt

    def _refuse_a_shrunk_world(self, attempt: int) -> None:
        if removed := self.world.removed():
            raise TimeoutError(
                f"restart {attempt}: the world shrank without node(s) {', '.join(map(str, removed))} (in-place recovery "
                "with --nnodes MIN:MAX), and a restart starts every node's workers as the rendezvous formed them. Run "
                "the job again to restart it (with --checkpoint ... --resume in the example).")

    def _nodes_that_said(self, name: str) -> list[int]:
        """The world's nodes that said ``name`` in the current attempt."""
        return self.records.nodes_that_said(name, self.world.nodes())

    def _check_give_up(self) -> None:
        if (reason := self._give_up()) is not None:
            raise GaveUpWaiting(reason)

    def leave(self, wait_seconds: float) -> None:
        """Count this launcher out; the one that hosts the store waits for the others first, up to
        ``wait_seconds``, so that none loses the store while it still reads it. A launcher whose place
        a spare node took says nothing: the node it was is the spare's now."""
        self.heartbeats.stop()
        try:
            if self.world.was_replaced(ask_store=True):
                return
            self.records.say(self.node_rank, keys.LEFT, attempt=keys.JOB_WIDE)
            deadline = time.monotonic() + wait_seconds
            # A launcher taken for lost (``silent_node``) never says it left: not waited for.
            expected = len(self.world.nodes()) - (self._lost is not None)
            while self.hosts_store and time.monotonic() < deadline and len(self.world.nodes_left()) < expected:
                time.sleep(_POLL_SECONDS)
        except NodeContactLostError:
            pass  # node 0 already gone: nothing to wait for

