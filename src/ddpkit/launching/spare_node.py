"""A launcher that waits as a spare node (``ddpkit run --nnodes MIN:MAX --rdzv-backend c10d
--recovery in-place``), and takes a lost node's place while the other nodes' workers go on.

The rendezvous closes with the world's nodes (``launching.rendezvous``); a launcher that arrives
later, up to MAX, is a spare. It starts one warm spare worker per local rank (torch and ddpkit
imported, waiting for a rank: ``workers.worker --spare``) and waits for a launcher of the world
to report a node silent (``JobLook.silent_launchers``: the launchers that watch a node's
beat report it; the spare reads the reports when the job's news changes, and then the silent
node's beat). When one goes silent (its launcher and workers killed, its host lost), the spare claims its place
(the first claim written wins, so two spares never take one node), becomes that node, and hands
its warm spares the lost node's ranks in the next generation of the group
(``NodeWorld.next_generation``). It holds those ranks of that generation for its warm
spares, then tells the survivors' generation that a node was lost (``NodeWorld.hand_over``,
``ddpkit.membership.generations``): a node whose link went down closed no connection, and its ranks, alive
behind it, must find their places taken should the link come back. The survivors' workers, whose
collectives failed (or were told), form that generation (``ddpkit.membership.group``); they meet the new
ranks there and hand them the state (``ddpkit.training.recovery``), as on one node. The other launchers see
the claim and do not end their workers; the lost node's launcher, if it answers again, finds
that it was replaced and ends its own (``NodeReplacedError``).

A node alive but slow, which node 0's launcher asked to step aside (``ddpkit run --stragglers
replace``, ``health.straggler_replacement``), is claimed the same way, for the launcher there: that
launcher then finds its place taken and leaves.

When the world shrank without a node instead (no spare was waiting then: ``control_plane.nodes``), a
spare that waits later brings it back: its claim on the removed node's place (the first written
wins) makes it that node, its warm spares take the node's ranks and shares of the data again in
the group's next generation, and the survivors' workers form it at a step boundary they agree on
(``NodeWorld.bring_back``, ``ddpkit.training.recovery``).

When every node's launcher has left (the job finished or ended), or was taken for lost before
the spare could claim its place (the others then end the job without it), the spare ends too: exit 0, and
its warm spares are stopped. torch-free, as the launcher is (the store's client comes from
``launching.store_client`` through ``NodeCoordination``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from ddpkit.control_plane.job_look import LOOK_SECONDS
from ddpkit.control_plane.node_claims import ClaimKind, claim_kind, launcher_of
from ddpkit.control_plane.nodes import NodeCoordination
from ddpkit.logs import get_logger
from ddpkit.store import keys
from ddpkit.store.client import GaveUpWaiting, GiveUp
from ddpkit.workers.processes import WorkerProcess

__all__ = ["Takeover", "wait_as_spare"]

_log = get_logger("launching")

_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class Takeover:
    """A lost node's place, taken: its node rank, the generation of the group its ranks join, the
    attempt (``DDPKIT_RESTART_COUNT``) the nodes run, and the warm spares that take its ranks."""

    node_rank: int
    generation: int
    attempt: int
    spares: list[WorkerProcess]
    why: str  # what became of the lost node, for the survivors' workers (``NodeWorld.hand_over``)
    returns: bool = False  # the node was removed from the world (it shrank): it joins again (``bring_back``)


def wait_as_spare(nodes: NodeCoordination, start_spare: Callable[[], WorkerProcess], count: int,
                  give_up: GiveUp, spares_start_at_once: Callable[[], bool] = lambda: True) -> Takeover | None:
    """Wait, with ``count`` warm spares (``start_spare``), until a node of the world is lost, or was
    removed when the world shrank, and this spare's claim on its place wins (the place taken), or
    every node's launcher left or was taken for lost (None). ``GaveUpWaiting`` when ``give_up`` gives a reason.

    The spares start once ``spares_start_at_once`` says that starting one does not wait (the node's
    template has done its imports: ``WorkerTemplate.forks_at_once``), and at the latest when a place
    is taken. The claim must not wait for them: the other nodes take a silent node for lost when no
    claim came within seconds, and a template importing Lightning takes longer than that."""
    claimant = f"spare launcher pid {os.getpid()}"
    # A spare looks at the job at every poll: the survivors wait for its claim, and there are few spares.
    nodes.looks.seconds = _POLL_SECONDS
    try:
        return _wait(nodes, _Spares([], start_spare, count, spares_start_at_once), claimant, give_up)
    finally:
        nodes.looks.seconds = LOOK_SECONDS


@dataclass
class _Spares:
    """A spare node's warm spares: started when that does not hold up the wait, kept alive while it waits."""

    started: list[WorkerProcess]
    start: Callable[[], WorkerProcess]
    count: int
    start_at_once: Callable[[], bool]

    def tend(self) -> None:
        """Start the missing ones if that takes no wait; start one again that ended."""
        if len(self.started) < self.count and self.start_at_once():
            self.all()
        for number, spare in enumerate(self.started):
            if spare.process.poll() is not None:  # a takeover needs one warm spare per local rank
                self.started[number] = self.start()

    def all(self) -> list[WorkerProcess]:
        """Every spare, started now if need be (waiting for the template's imports)."""
        while len(self.started) < self.count:
            self.started.append(self.start())
        return self.started


def _wait(nodes: NodeCoordination, spares: _Spares, claimant: str, give_up: GiveUp) -> Takeover | None:
    world = nodes.world
    # (node, its launcher's id) whose place another claim took first: a claim is on that launcher's
    # place (``node_claims.claim``), so asking again, even at a later beat of a straggler, finds the same.
    settled: set[tuple[int, str]] = set()
    lost: set[int] = set()  # the nodes the others took for lost first: they end the job without them
    while True:
        # Asked first: a spare stopped as the job ends was still stopped (128 + the signal).
        if (reason := give_up()) is not None:
            raise GaveUpWaiting(reason)
        # The records are read only when the job's news changed (``JobLook.look``).
        fresh = nodes.looks.news_since("spare")
        if fresh:
            if world.job_over(lost):
                return None
            for node in world.removed():
                if _training_ends(nodes):
                    break  # no step boundary is left to join at
                if world.claim_return(node, claimant):
                    world.take_place_of(node)
                    generation, attempt = world.next_generation(), _latest_attempt(nodes)
                    why = f"node {node} joins the world again ({claimant})"
                    _log.warning(f"ddpkit run: the world shrank without node {node}; this spare node takes its place "
                                 f"and its ranks in generation {generation} of the group, at the other nodes' next step "
                                 "boundary")
                    return Takeover(node, generation, attempt, spares.all(), why, returns=True)
        candidates = {node: (beat, "went silent") for node, beat in nodes.looks.silent_launchers().items()}
        if fresh and nodes.step_asides.any_asked():
            for node in world.nodes():
                # Alive but slow: node 0's launcher asked it to step aside (``--stragglers replace``).
                if node not in candidates and (beat := nodes.heartbeats.last_beat(node)) is not None and (
                        request := nodes.step_asides.request(node, launcher_of(beat))) is not None:
                    candidates[node] = (beat, f"was asked to step aside ({request})")
        for node, (beat, what) in sorted(candidates.items()):
            if (node, launcher_of(beat)) in settled or world.said_left(node) or not world.node_losses_left():
                continue  # (with no node loss left, the others end the job: this spare leaves with it)
            if world.claim(node, beat, claimant):
                world.spend_node_loss()
                world.take_place_of(node)
                generation, attempt = world.next_generation(), _latest_attempt(nodes)
                _log.warning(f"ddpkit run: node {node}'s launcher {what}; this spare node takes its place and "
                             f"its ranks in generation {generation} of the group (the other nodes' workers go on)")
                why = f"node {node}'s launcher {what}; {claimant} took its place"
                return Takeover(node, generation, attempt, spares.all(), why)
            settled.add((node, launcher_of(beat)))
            if claim_kind(by := world.claimant(node, beat) or "") in (ClaimKind.LOST, ClaimKind.SPENT):
                lost.add(node)
                _log.warning(f"ddpkit run: node {node}'s launcher {what}, and the other nodes took it for lost "
                             f"before this spare node claimed its place ({by}); this spare node waits on")
                if world.job_over(lost):  # (the others may have left before this look)
                    return None
        spares.tend()
        time.sleep(_POLL_SECONDS)


def _latest_attempt(nodes: NodeCoordination) -> int:
    """The attempt the nodes run now: the last one opened (``NodeCoordination.meet``)."""
    attempt = 0
    while nodes.records.has(keys.OPEN, attempt + 1):
        attempt += 1
    return attempt


def _training_ends(nodes: NodeCoordination) -> bool:
    """Whether a node's workers all finished in the attempt the nodes run: a node brought back now
    would find no step left to join at."""
    return bool(nodes.records.nodes_that_said(keys.SUCCEEDED, nodes.world.nodes(), _latest_attempt(nodes)))
