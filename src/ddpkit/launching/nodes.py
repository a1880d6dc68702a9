"""The launchers of a multi-node job restarting together (``ddpkit run --nnodes N --max-restarts M``).

Every node's launcher reaches the job's store, which node 0's launcher hosts
(``launching.store_host``; the workers meet through it too, one key prefix per attempt), and the
launchers agree through keys under ``<the job's prefix>launchers/attempt/A/``, A counting the
starts of the workers as ``DDPKIT_RESTART_COUNT`` does. With a job secret (``ddpkit.job_secret``)
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
- each launcher says it is alive once a second from a thread of its own (``beat_through``): one
  silent for ``_SILENT_SECONDS``, or never heard from within the join timeout, is taken for lost
  (``silent_node``), which ends the others' workers as its failure would have, since nothing else
  may tell them (a rank killed before the group formed breaks no connection). Under in-place
  recovery a spare node may claim a silent node's place (``launching.spare_node``) and beat as it;
  the lost launcher, if it answers again, finds the spare's beat where its own was (a beat
  replaces only its own last one) and ends its workers without announcing anything
  (``NodeReplacedError``);
- under in-place recovery with ``--nnodes MIN:MAX`` (``Shrinking``), a silent node that no spare
  node takes over while at least MIN nodes would remain is left out instead: the first survivor's
  launcher whose claim on its place wins lays the next generation of the workers' group out
  without its ranks (``ddpkit.generations.Layout``: the survivors train the lost ranks' shares of
  the data too, so the global batch stays), holds those ranks for no process, and tells the
  survivors' workers, which form that generation in place (``ddpkit.recovery``). The node is
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

Under a c10d rendezvous (``launching.rendezvous``) this agreement is used whenever there are several
nodes, restarts or not: the store is a launcher's, so the one that hosts it must outlive the others.

This module imports ``torch.distributed`` for the store's client (``launching.store_client``), and
only when a launcher connects: single-node launching stays free of torch (docs/architecture.md).
Every wait here also ends, with ``GaveUpWaiting``, when the launcher's ``give_up`` gives a reason
(a stop signal, the store host gone).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ddpkit.generations import (
    REMOVED,
    announce_growth,
    announce_node_lost,
    claim_rank,
    layout_at,
    write_layout,
)
from ddpkit.job_secret import RecordSigner, job_secret
from ddpkit.launching.rendezvous import StoreWaits
from ddpkit.launching.store_client import (
    BoundedStore,
    GaveUpWaiting,
    GiveUp,
    StoreRequestTimeout,
    StoreUnreachableError,
    connect,
    never_give_up,
)
from ddpkit.launching.store_host import clear_worker_keys
from ddpkit.logs import get_logger
from ddpkit.variables import DDPKIT_RECOVERY_TIMEOUT_SECONDS

__all__ = ["FailureCause", "NodeContactLostError", "NodeCoordination", "NodeReplacedError", "Shrinking", "may_wait_beyond_max"]

_log = get_logger("launching")

# How long a launcher whose workers failed before it reached the store still tries to, to tell the
# other nodes (which would otherwise wait for this node's ranks): a network that flapped as the job
# started comes back within it; a node 0 that is gone does not.
_ANNOUNCE_SECONDS = 20.0
_POLL_SECONDS = 0.02
# Each launcher says it is alive this often, from a thread of its own with a client of its own (its
# main thread may be busy ending workers for seconds); one that said nothing for _SILENT_SECONDS was
# killed with its workers, or its host is gone: the others then end theirs instead of leaving their
# ranks waiting for the lost node's (in a collective, or while the group forms) until torch's timeout.
_BEAT_SECONDS = 1.0
_SILENT_SECONDS = 10.0
# Under in-place recovery across nodes a lost node is taken over by a spare node while the others'
# workers wait for it, so it is noticed sooner: beats four times a second, lost after 2 s of silence.
_IN_PLACE_BEAT_SECONDS = 0.25
_IN_PLACE_SILENT_SECONDS = 2.0
# How long the others wait for a spare node to claim a silent node before taking it for lost, and
# then for the spare's launcher to say it is alive as that node.
_CLAIM_SECONDS = 2.0
_TAKEOVER_SECONDS = 15.0
# How a survivor's launcher signs its claim on a silent node's place when it shrinks the world
# without it (a spare node's claim names the spare's launcher).
_SHRINK_CLAIM = "the world shrank without it"
# How a survivor's launcher signs its claim on a silent node's place when the job may lose no more
# nodes (``NodeCoordination.node_losses_allowed``): the node is lost for every launcher.
_SPENT_CLAIM = "no node loss left to recover from"
# What a removed node's record starts with while it is out of the world.
_OUT = "out"


def may_wait_beyond_max(store: Any, beyond: int) -> bool:
    """Whether a launcher that arrived at the rendezvous ``beyond`` places past MAX may wait as a
    spare node: once a launcher of the job shrank the world (``Shrinking``; it may bring a removed
    node back), or once the job recovered from at least ``beyond`` lost nodes (each lost node's
    launcher still counts among the arrivals, though it is gone: live launchers stay within MAX)."""
    signer = RecordSigner(job_secret(), "launchers")
    if int(store.add(signer.key("launchers/removed/count"), 0)) > 0:
        return True
    return int(store.add(signer.key("launchers/node-losses"), 0)) >= beyond


def _launcher_of(beat: str) -> str:
    """The id of the launcher that wrote ``beat`` (``launcher id:count``)."""
    return beat.partition(":")[0]


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


class NodeReplacedError(NodeContactLostError):
    """A spare node took this node's place while its launcher could not reach the job's store."""


@dataclass(frozen=True)
class Shrinking:
    """Under in-place recovery with ``--nnodes MIN:MAX``: how far the world may shrink, and what a
    launcher needs to lay the next generation out without a lost node's ranks."""

    min_nodes: int  # MIN: the world never shrinks below it
    nproc_per_node: int  # node N's workers are the job's ranks N * nproc_per_node and on
    spares_possible: bool  # the rendezvous closed with fewer than MAX nodes: a spare node may take a lost one's place


class NodeCoordination:
    """One launcher's side of the agreement between the launchers of a multi-node job."""

    def __init__(self, store: BoundedStore, node_rank: int, nnodes: int, address: str, port: int,
                 hosts_store: bool | None = None, give_up: GiveUp = never_give_up,
                 join_seconds: float = StoreWaits.join_timeout, in_place: bool = False,
                 shrinking: Shrinking | None = None, node_losses_allowed: int | None = None) -> None:
        self._store = store
        self._give_up = give_up  # asked while ``finish`` and ``meet`` wait: a reason ends them (GaveUpWaiting)
        self.node_rank = node_rank
        self.nnodes = nnodes
        self._where = f"{address}:{port}"
        # Whether this launcher hosts the store (then it leaves last): node 0's, or under a c10d
        # rendezvous the one on the endpoint's host (``launching.rendezvous``).
        self.hosts_store = node_rank == 0 if hosts_store is None else hosts_store
        self.attempt = 0
        self._signer = RecordSigner(job_secret(), "launchers")
        self._heard: dict[int, tuple[str, float]] = {}  # node -> (its last beat, when it changed here)
        self._join_seconds = join_seconds
        self._joined_by = time.monotonic() + join_seconds  # a node not heard from by then is not coming
        self._next_look = 0.0
        self._lost: tuple[int, str] | None = None  # another node's launcher taken for lost, and why
        self._beating = threading.Event()  # set: stop beating
        # Under in-place recovery (``launching.spare_node``): a silent node may be taken over by a spare.
        self.in_place = in_place
        self._beat_seconds = _IN_PLACE_BEAT_SECONDS if in_place else _BEAT_SECONDS
        self._silent_seconds = _IN_PLACE_SILENT_SECONDS if in_place else _SILENT_SECONDS
        self._launcher_id = os.urandom(6).hex()  # tells this launcher's beats from a former one's of the same node
        self._silent_since: dict[int, float] = {}  # node -> when it was seen silent (waiting for a claim)
        self._replaced = threading.Event()  # set: a spare node beats as this node (``replaced_by``)
        self.shrinking = shrinking if in_place else None
        self._removed: set[int] = set()  # nodes the world shrank without (and not brought back), as read so far
        self._removed_hint = 0  # the count of removals and returns when ``_removed`` was read
        # Under in-place recovery, how many lost nodes the job recovers from (``--max-restarts``; None: any).
        self.node_losses_allowed = node_losses_allowed if in_place else None

    def beat_through(self, store: Any) -> None:
        """Say this launcher is alive every beat (``_BEAT_SECONDS``), through ``store`` (a client for
        this alone), from a daemon thread, until ``leave``. A beat is this launcher's id and a count."""
        key = self._key(f"beat/{self.node_rank}", -1)

        def beat() -> None:
            count, last = 0, None
            while not self._beating.is_set():
                count += 1
                value = self._signer.sign(key, f"{self._launcher_id}:{count}")
                try:
                    # Under in-place recovery a beat after the first replaces only this launcher's last: one
                    # that finds another launcher's there was taken for lost, and a spare node beats as this node.
                    if last is None or not self.in_place:
                        store.set(key, value)
                    elif bytes(store.compare_set(key, last, value)) != value.encode():
                        self._replaced.set()
                        return
                except Exception:  # the store is gone: the main thread finds out at its next request
                    return
                last = value
                self._beating.wait(self._beat_seconds)

        threading.Thread(target=beat, name="ddpkit-launcher-beat", daemon=True).start()

    def silent_node(self) -> str | None:
        """Why another node's launcher is taken for lost (no beat for the silent time and no word that
        it left, nor, under in-place recovery, a spare node that claimed its place), or None;
        looked at once a second (in place: ten times), and once lost, always lost."""
        now = time.monotonic()
        if self._lost is not None or now < self._next_look:
            return None if self._lost is None else self._lost[1]
        self._next_look = now + (0.1 if self.in_place else 1.0)
        left = set(self._nodes_that_said("left", -1))
        for node in self.world():
            if node == self.node_rank or node in left:
                continue
            beat = self._read(f"beat/{node}", -1)
            if beat is None:  # not arrived yet: its launcher may still be starting, or be gone before it arrived
                if now > self._joined_by:
                    self._lost = (node, f"node {node}'s launcher did not reach the job's store within "
                                        f"{self._join_seconds:g} s of this one's (--rdzv-conf join_timeout): it ended or "
                                        "was lost before it did")
                continue
            if self._silent_for(node, beat, now) > self._silent_seconds and not self._taken_over(node, beat, now):
                if self._shrinks_without(node, beat):
                    continue
                spent = ""
                if not self.node_losses_left():
                    spent = (f"; the job recovered from {self.node_losses_allowed} lost node(s) already, all that "
                             f"--max-restarts={self.node_losses_allowed} allows, so it ends")
                self._lost = (node, f"node {node}'s launcher went silent: no word from it for "
                                    f"{self._silent_seconds:g} s (killed with its workers, or its host lost){spent}")
        return None if self._lost is None else self._lost[1]

    def _silent_for(self, node: int, beat: str, now: float) -> float:
        """How long ``node``'s launcher has been silent as this launcher heard it, ``beat`` being its
        beat read ``now`` (0 when it changed since the last read: then remembered). A beat from a
        new launcher of the node is a spare that took its place, said once."""
        last = self._heard.get(node)
        if last is not None and last[0] == beat:
            return now - last[1]
        if last is not None and _launcher_of(last[0]) != _launcher_of(beat):
            claimant = self.claimant(node, last[0]) or "unnamed"
            if claimant.startswith(_SHRINK_CLAIM):
                _log.warning(f"ddpkit run: node {node} is back in the world: a spare node's launcher took its place")
            else:
                _log.warning(f"ddpkit run: node {node}'s launcher went silent; a spare node ({claimant}) took its "
                             "place, and this node's workers go on")
        self._heard[node] = (beat, now)
        self._silent_since.pop(node, None)
        return 0.0

    def _taken_over(self, node: int, beat: str, now: float) -> bool:
        """Under in-place recovery, whether the silent ``node`` (whose last beat was ``beat``) is being
        taken over by a spare node: claimed within ``_CLAIM_SECONDS``, the claimant then given
        ``_TAKEOVER_SECONDS`` to beat as that node."""
        if not self.in_place:
            return False
        since = self._silent_since.setdefault(node, now)
        claimant = self.claimant(node, beat)
        if claimant is None:
            # Once the world shrank, a launcher that arrives later waits as a spare, whatever MAX.
            spares_possible = self.shrinking is None or self.shrinking.spares_possible or self._removed_hint > 0
            return spares_possible and now - since < _CLAIM_SECONDS and self.node_losses_left()
        return not claimant.startswith((_SHRINK_CLAIM, _SPENT_CLAIM)) and now - since < _TAKEOVER_SECONDS

    # -- shrinking the world (``Shrinking``) --------------------------------------------------------

    def world(self) -> list[int]:
        """The nodes of the world now: every node the rendezvous closed with, but those it shrank without."""
        if self.shrinking is not None and (hint := self._hint("removed", -1)) != self._removed_hint:
            self._removed_hint = hint
            self._removed = {node for node in range(self.nnodes)
                             if (self._read(f"removed/{node}", -1) or "").startswith(_OUT)}
        return [node for node in range(self.nnodes) if node not in self._removed]

    def removed(self) -> list[int]:
        """The nodes the world shrank without and no spare node brought back yet."""
        world = self.world()
        return [node for node in range(self.nnodes) if node not in world]

    def _shrinks_without(self, node: int, beat: str) -> bool:
        """Whether the world goes on without the silent ``node`` (whose last beat was ``beat``): at
        least MIN nodes remain, and this launcher's claim on its place won (it then lays the next
        generation out, ``_remove``) or another survivor's did."""
        if self.shrinking is None:
            return False
        world = self.world()
        if node not in world:
            # Another survivor's claim won and removed it since this launcher read the world: the
            # world is already without it (and may be at MIN now, which must not read as a loss below it).
            return True
        if len(world) - 1 < self.shrinking.min_nodes:
            return False
        spent = not self.node_losses_left()
        who = f"node {self.node_rank}'s launcher {self._launcher_id}"
        if self.claim(node, beat, f"{_SPENT_CLAIM} ({who} found it lost)" if spent else f"{_SHRINK_CLAIM} ({who} shrank it)"):
            if spent:
                return False
            self.spend_node_loss()
            self._remove(node)
            return True
        claimant = self.claimant(node, beat)
        return claimant is not None and claimant.startswith(_SHRINK_CLAIM)

    def node_losses_left(self) -> bool:
        """Whether the job may still recover from a lost node (``node_losses_allowed``)."""
        allowed = self.node_losses_allowed
        return allowed is None or int(self._call("add", self._key("node-losses", -1), 0)) < allowed

    def spend_node_loss(self) -> None:
        """Count one lost node recovered from (by the launcher whose claim on its place won)."""
        self._call("add", self._key("node-losses", -1), 1)

    def _remove(self, node: int) -> None:
        """Shrink the world without ``node``: lay the next generation out without its ranks (their
        shares of the data go to the survivors), hold those ranks there for no process (its workers,
        should its link come back, end), say it is removed, then tell the survivors' workers."""
        assert self.shrinking is not None
        count = self.shrinking.nproc_per_node
        lost = set(range(node * count, (node + 1) * count))
        generation = self.next_generation()
        secret = job_secret()
        before = self._call(layout_at, self._store, secret, self.attempt, generation - 1, self.nnodes * count)
        layout = before.shrunk(lost)
        for rank in sorted(lost):
            self._call(claim_rank, self._store, secret, self.attempt, generation, rank, REMOVED)
        self._call(write_layout, self._store, secret, self.attempt, generation, layout)
        self._say_of(node, "removed", f"{_OUT} {generation}", -1)
        self._removed.add(node)
        why = (f"node {node}'s launcher went silent and no spare node took its place: the world shrank to "
               f"{len(layout.members)} ranks")
        self._call(announce_node_lost, self._store, secret, self.attempt, generation - 1, why)
        _log.warning(f"ddpkit run: {why} on {len(self.world())} node(s) in generation {generation} of the group; "
                     f"the survivors train the lost ranks' shares of each global batch too (the global batch stays "
                     f"{layout.data_world_size} shares)")

    # -- spare nodes (``launching.spare_node``) -------------------------------------------------------

    def silent_launcher(self, node: int) -> str | None:
        """The last beat of ``node``'s launcher when it has been silent for the silent time (read now
        and compared with what this launcher heard before), else None."""
        beat = self._read(f"beat/{node}", -1)
        if beat is None:
            return None
        return beat if self._silent_for(node, beat, time.monotonic()) > self._silent_seconds else None

    def claim(self, node: int, beat: str, claimant: str) -> bool:
        """Claim the place of ``node``, whose launcher's last beat was ``beat``: True for the one
        spare whose claim was written first."""
        key = self._key(f"takeover/{node}/{_launcher_of(beat)}", -1)
        signed = self._signer.sign(key, claimant)
        return bool(self._call("compare_set", key, "", signed) == signed.encode())

    def claimant(self, node: int, beat: str) -> str | None:
        """Who claimed the place of ``node`` after its launcher went silent at ``beat``, if anyone."""
        return self._read(f"takeover/{node}/{_launcher_of(beat)}", -1)

    def _check_not_replaced(self, ask_store: bool) -> None:
        """``NodeReplacedError`` when a spare node took this node's place: known from a beat that found
        the spare's there, or (``ask_store``) read from its claim. A replaced launcher must neither
        announce a failure nor count a generation: the node it was is the spare's now."""
        if self._was_replaced(ask_store):
            by = self.replaced_by() or "unnamed"
            what = (f"{by}" if by.startswith(_SHRINK_CLAIM) else f"a spare node ({by}) took its place and its ranks")
            raise NodeReplacedError(
                f"node {self.node_rank}'s launcher could not reach the job's store for more than {self._silent_seconds:g} s, "
                f"so the other nodes took this node for lost, and {what}: this node's workers are ended (they must not "
                "meet the job's group again) and this launcher leaves the job, which goes on without it. Check this "
                "host's network.")

    def _was_replaced(self, ask_store: bool) -> bool:
        """Whether a spare node took this node's place: a beat found the spare's, or (``ask_store``,
        under in-place recovery, where spares exist) its claim on this launcher's place is written."""
        if self._replaced.is_set():
            return True
        # A claim that found no node loss left replaces nothing: the others end the job instead.
        return ask_store and self.in_place and not (self.replaced_by() or _SPENT_CLAIM).startswith(_SPENT_CLAIM)

    def replaced_by(self) -> str | None:
        """The spare node that claimed this launcher's place after the others took it for lost, if one did."""
        return self._read(f"takeover/{self.node_rank}/{self._launcher_id}", -1)

    def hand_over(self, attempt: int, generation: int, holders: Mapping[int, str], why: str) -> None:
        """As the spare node that took a lost node's place: hold its ranks in ``generation`` of the
        workers' group for this node's warm spares (``holders``: rank -> ``member_identity``), then
        tell the workers of the generation before that a node was lost (``why``; ``ddpkit.generations``).
        In this order: the lost node's workers, if its link comes back, find their ranks held and end."""
        secret = job_secret()
        for rank, holder in holders.items():
            self._call(claim_rank, self._store, secret, attempt, generation, rank, holder)
        self._call(announce_node_lost, self._store, secret, attempt, generation - 1, why)

    def training_ends(self) -> bool:
        """Whether a node's workers all finished in the attempt the nodes run: a node brought back
        now would find no step left to join at."""
        return bool(self._nodes_that_said("succeeded", self.latest_attempt()))

    def claim_return(self, node: int, claimant: str) -> bool:
        """Claim the place of ``node``, which the world shrank without, to bring it back: True for the
        one spare whose claim was written first."""
        removal = self._read(f"removed/{node}", -1) or ""
        key = self._key(f"return/{node}/{removal.partition(' ')[2]}", -1)
        signed = self._signer.sign(key, claimant)
        return bool(self._call("compare_set", key, "", signed) == signed.encode())

    def bring_back(self, attempt: int, generation: int, holders: Mapping[int, str], why: str) -> None:
        """As the spare node whose claim on a removed node's place won (``claim_return``): lay
        ``generation`` out with that node's ranks again (each takes its own share of the data back),
        hold them there for this node's warm spares (``holders``), count the node in the world
        again, then ask the survivors' workers to form ``generation`` at their next step boundary."""
        assert self.shrinking is not None
        secret = job_secret()
        before = self._call(layout_at, self._store, secret, attempt, generation - 1,
                            self.nnodes * self.shrinking.nproc_per_node)
        layout = before.grown(set(holders))
        for rank, holder in holders.items():
            self._call(claim_rank, self._store, secret, attempt, generation, rank, holder)
        self._call(write_layout, self._store, secret, attempt, generation, layout)
        self._say_of(self.node_rank, "removed", f"back {generation}", -1)
        self._call(announce_growth, self._store, secret, attempt, generation - 1, why)
        _log.warning(f"ddpkit run: this node (node {self.node_rank}) joins the world again in generation {generation} "
                     f"of the group, at the survivors' next step boundary: {len(layout.members)} ranks")

    def take_place_of(self, node: int) -> None:
        """This spare launcher is node ``node`` from now on (its claim won)."""
        self.node_rank = node
        self._heard.pop(node, None)
        self._silent_since.pop(node, None)

    def said_left(self, node: int) -> bool:
        """Whether ``node``'s launcher said it left the job."""
        return self._has(f"left/{node}", -1)

    def job_over(self) -> bool:
        """Whether every node's launcher left the job (a spare then has nothing to wait for)."""
        return len(self._nodes_that_said("left", -1)) >= len(self.world())

    def latest_attempt(self) -> int:
        """The attempt the nodes run now: the last one opened (``meet``)."""
        attempt = 0
        while self._has("open", attempt + 1):
            attempt += 1
        return attempt

    def next_generation(self) -> int:
        """Count one more formation of the workers' group across the job (an in-place recovery on any
        node, or a spare node's takeover) and return its number: every node's workers agree on it.
        ``NodeReplacedError`` when a spare node took this node's place (its count is the spare's)."""
        self._check_not_replaced(ask_store=True)
        generation = int(self._read("generation", -1) or 0) + 1
        self._put("generation", str(generation), -1)
        return generation

    @classmethod
    def connect(cls, address: str, port: int, node_rank: int, nnodes: int, waits: StoreWaits,
                workers_failed: Callable[[], str | None] = never_give_up,
                workers_ended: Callable[[], bool] = lambda: False,
                give_up: GiveUp = never_give_up) -> NodeCoordination:
        """Reach the job's store on node 0, waiting for it to come up (up to ``waits.join_timeout``;
        each request then bounded by ``waits.read_timeout``). The workers start before this: when
        they fail meanwhile (``workers_failed`` describes how) the store is not awaited any longer
        (``NodeContactLostError``): node 0's launcher may have ended after its workers met this
        node's, and a store that is gone never comes up. It is still tried for ``_ANNOUNCE_SECONDS``
        after the failure: when it answers (a network that flapped), the failure is announced as any
        other, and the other nodes do not wait for this node's ranks. When the workers all ended
        without a failure (``workers_ended``), or ``give_up`` gives a reason (a stop signal), the
        wait ends with ``GaveUpWaiting``; ``give_up`` is also what ``finish`` and ``meet`` ask while
        they wait."""
        failure: list[str] = []
        failed_at: list[float] = []

        def stop_waiting() -> str | None:
            if not failure and (failed := workers_failed()) is not None:
                failure.append(failed)
                failed_at.append(time.monotonic())
            if failure:
                return failure[0] if time.monotonic() - failed_at[0] > _ANNOUNCE_SECONDS else give_up()
            return "every worker of this node ended" if workers_ended() else give_up()

        join_seconds = waits.join_timeout
        try:
            store = connect(address, port, join_seconds, stop_waiting)
        except GaveUpWaiting as stopped:
            if not failure or stopped.reason != failure[0]:
                raise
            raise NodeContactLostError(
                f"node {node_rank}'s launcher could not reach the job's store at {address}:{port}, and meanwhile "
                f"{failure[0]}; nor within {_ANNOUNCE_SECONDS:g} s after that: the launcher that hosts the store "
                "(node 0's) ended or its host is unreachable. Its output says why.") from None
        except StoreUnreachableError as error:
            raise NodeContactLostError(
                f"node {node_rank}'s launcher could not reach the job's store at {address}:{port} (hosted by the "
                f"launcher of node 0) within {join_seconds:g} s (--rdzv-conf join_timeout): {error}. Start "
                "`ddpkit run --node-rank 0` with the same --master-addr and --master-port, and check that this host "
                "can reach it.") from None
        coordination = cls(BoundedStore(store, waits.read_timeout), node_rank, nnodes, address, port, give_up=give_up,
                           join_seconds=join_seconds)
        coordination.beat_through(connect(address, port, waits.read_timeout))
        return coordination

    def _key(self, name: str, attempt: int | None = None) -> str:
        """The store key of ``name`` in ``attempt`` (the current one by default); ``attempt`` -1: the
        job's keys outside any attempt."""
        attempt = self.attempt if attempt is None else attempt
        return self._signer.key(f"launchers/{name}" if attempt < 0 else f"launchers/attempt/{attempt}/{name}")

    def _put(self, name: str, value: str, attempt: int | None = None) -> None:
        key = self._key(name, attempt)
        self._call("set", key, self._signer.sign(key, value))

    def _read(self, name: str, attempt: int | None = None) -> str | None:
        """The value a launcher of the job wrote under ``name``; None when there is none (or a forged one)."""
        key = self._key(name, attempt)
        if not self._call("check", [key]):
            return None
        return self._signer.verify(key, self._call("get", key))

    def _hint(self, name: str, attempt: int | None = None) -> int:
        """The count beside ``name``'s signed keys: a change to read them for (not itself believed)."""
        return int(self._call("add", self._key(f"{name}/count", attempt), 0))

    def _say(self, name: str, value: str = "1", attempt: int | None = None) -> None:
        """This node's signed ``name/<node>``, and its count raised."""
        self._say_of(self.node_rank, name, value, attempt)

    def _say_of(self, node: int, name: str, value: str = "1", attempt: int | None = None) -> None:
        """The signed ``name/<node>`` of ``node`` (this node's, or one the world shrank without), and its count raised."""
        self._put(f"{name}/{node}", value, attempt)
        self._call("add", self._key(f"{name}/count", attempt), 1)

    def _nodes_that_said(self, name: str, attempt: int | None = None, every_node: bool = False) -> list[int]:
        """The nodes of the world (``every_node``: of the rendezvous) that said ``name``."""
        if self._hint(name, attempt) == 0:
            return []
        nodes = range(self.nnodes) if every_node else self.world()
        return [node for node in nodes if self._read(f"{name}/{node}", attempt) is not None]

    def _call(self, method: str | Callable[..., Any], *args: Any) -> Any:
        """The store's ``method`` (or a function of the store, given it in ``args``) called; a store that
        does not answer or is gone is ``NodeContactLostError``."""
        try:
            return method(*args) if callable(method) else getattr(self._store, method)(*args)
        except StoreRequestTimeout:
            raise NodeContactLostError(
                f"node {self.node_rank}'s launcher got no answer from the job's store at {self._where}: it did not "
                f"answer a request within {self._store.seconds:g} s (--rdzv-conf read_timeout). The launcher that "
                "hosts it (node 0's, or the one on the rendezvous endpoint's host) is frozen, or its host unreachable."
            ) from None
        except Exception as error:  # the store's client raises several kinds, all meaning the same here
            raise NodeContactLostError(
                f"node {self.node_rank}'s launcher lost contact with the job's store at {self._where} "
                f"({type(error).__name__}: {error}): the launcher that hosts it (node 0's, or the one on the "
                "rendezvous endpoint's host) ended or its host is unreachable. Its output says why.") from None

    def _has(self, name: str, attempt: int | None = None) -> bool:
        return self._read(name, attempt) is not None

    def announce_failure(self) -> None:
        """Tell the other launchers that this node's workers failed in the current attempt
        (``NodeReplacedError`` instead when a spare node took this node's place)."""
        self._check_not_replaced(ask_store=True)
        self._say("failed")

    def announce_stop(self, reason: str) -> None:
        """Tell the other launchers to end their workers and not restart (a stop signal here)."""
        self._put("stop", f"node {self.node_rank}'s launcher {reason}")

    def ended_elsewhere(self) -> bool:
        """Whether another node's launcher announced a failure or a stop in the current attempt, left
        the job, or went silent (``silent_node``): its workers are gone, and this node's would wait.
        ``NodeReplacedError`` when a spare node took this node's place (``replaced_by``)."""
        self._check_not_replaced(ask_store=False)
        return (bool(self._nodes_that_said("failed")) or self._has("stop") or bool(self._nodes_that_said("left", -1))
                or self.silent_node() is not None)

    def announce_preemption(self, reason: str) -> None:
        """Tell the other launchers that this one passed a preemption on to its workers (they stop
        with the others' at the same step through their own agreement)."""
        self._put(f"preempted/{self.node_rank}", f"node {self.node_rank}'s launcher {reason}")

    def preemption_source(self) -> str:
        """Where the preemption this node's workers stopped for came from, when no signal came to
        this launcher: another launcher that announced one, or a launcher gone silent (its workers
        had SIGTERM from the kernel when it died, and saved as for a preemption); waits up to
        ``_SILENT_SECONDS`` and a little for either."""
        deadline = time.monotonic() + _SILENT_SECONDS + 2.0
        while True:
            said = [text for node in self.world() if (text := self._read(f"preempted/{node}")) is not None]
            if said:
                return "; ".join(said)
            if (silent := self.silent_node()) is not None:
                return f"the workers of a lost launcher, which saved as for a preemption: {silent}"
            if time.monotonic() > deadline:
                return "no launcher: a worker was signalled by itself"
            time.sleep(0.1)

    def stop_reason(self, attempt: int | None = None) -> str | None:
        """Why another launcher stopped the job (no restart), when one did."""
        return self._read("stop", attempt)

    def publish_cause(self, cause: FailureCause | None) -> None:
        """Publish this node's view of the attempt's end, for ``root_cause``: the cause of its
        workers' failure, or None (they were ended because of another node, or by a signal)."""
        self._put(f"cause/{self.node_rank}", json.dumps(
            None if cause is None else {"text": cause.text, "recorded_at": cause.recorded_at}))

    def root_cause(self, wait_seconds: float) -> FailureCause | None:
        """The root cause of the current attempt's failure, once every node published its view
        (``publish_cause``), or from those that did within ``wait_seconds`` (a node whose
        launcher vanished publishes nothing); None when no node saw a failure of its own.

        Waiting for every node is what makes every launcher name the same cause: a node's
        workers may fail first while its launcher notices last."""
        deadline = time.monotonic() + wait_seconds
        while True:
            world = self.world()
            views = {node: self._view(node, view) for node in world if (view := self._read(f"cause/{node}")) is not None}
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
        self._say("succeeded")
        while len(succeeded := self._nodes_that_said("succeeded")) < len(self.world()):
            # A node that finished too may leave between the two reads: its success counts first.
            if self.ended_elsewhere() and self._nodes_that_said("succeeded") == succeeded:
                return False
            self._check_give_up()
            time.sleep(poll)
        return True

    def meet(self, attempt: int, timeout_seconds: float) -> None:
        """Wait until every node's launcher is ready to start ``attempt`` (a restart), then make it
        the current one. Raises ``TimeoutError`` naming the nodes that did not come.

        Node 0's launcher then clears the workers' keys of the attempts before through its client
        (a plain torch script's ``env://`` connection keeps no keys per attempt; the store may be
        any launcher's, or outside the nodes: ``ddpkit store``) and says the attempt is open; the
        others wait for that before they start workers."""
        if removed := self.removed():
            raise TimeoutError(
                f"restart {attempt}: the world shrank without node(s) {', '.join(map(str, removed))} (in-place recovery "
                "with --nnodes MIN:MAX), and a restart starts every node's workers as the rendezvous formed them. Run "
                "the job again to restart it (with --checkpoint ... --resume in the example).")
        self._put(f"arrived/{self.node_rank}", "1", attempt)
        deadline = time.monotonic() + timeout_seconds
        while True:
            missing = [node for node in range(self.nnodes) if not self._has(f"arrived/{node}", attempt)]
            if not missing:
                break
            stopped = self.stop_reason(attempt - 1)
            ended = [node for node in missing if self._has(f"left/{node}", -1)]
            silent = self.silent_node()
            if stopped is not None or ended or silent or time.monotonic() > deadline:
                why = (f"({stopped})" if stopped else "(they ended)" if ended else f"({silent})" if silent else
                       f"within {timeout_seconds:g} s ({DDPKIT_RECOVERY_TIMEOUT_SECONDS})")
                raise TimeoutError(
                    f"restart {attempt}: the launchers of node(s) {', '.join(map(str, missing))} did not come back "
                    f"{why}; every node's `ddpkit run` needs the same --nnodes and --max-restarts, and their output "
                    "says why they ended.")
            self._check_give_up()
            time.sleep(_POLL_SECONDS)
        if self.node_rank == 0:
            self._call(clear_worker_keys, self._store)
            self._put("open", "1", attempt)
        while not self._has("open", attempt):
            if time.monotonic() > deadline:
                raise TimeoutError(f"restart {attempt}: node 0's launcher did not open it within "
                                   f"{timeout_seconds:g} s ({DDPKIT_RECOVERY_TIMEOUT_SECONDS}); its output says why.")
            self._check_give_up()
            time.sleep(_POLL_SECONDS)
        self.attempt = attempt

    def _check_give_up(self) -> None:
        if (reason := self._give_up()) is not None:
            raise GaveUpWaiting(reason)

    def leave(self, wait_seconds: float) -> None:
        """Count this launcher out; the one that hosts the store waits for the others first, up to
        ``wait_seconds``, so that none loses the store while it still reads it. A launcher whose place
        a spare node took says nothing: the node it was is the spare's now."""
        self._beating.set()
        try:
            if self._was_replaced(ask_store=True):
                return
            self._say("left", attempt=-1)
            deadline = time.monotonic() + wait_seconds
            # A launcher taken for lost (``silent_node``) never says it left: not waited for.
            expected = len(self.world()) - (self._lost is not None)
            while self.hosts_store and time.monotonic() < deadline and len(self._nodes_that_said("left", -1)) < expected:
                time.sleep(_POLL_SECONDS)
        except NodeContactLostError:
            pass  # node 0 already gone: nothing to wait for
