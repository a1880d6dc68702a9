"""Which nodes the job's world holds, and how it changes under in-place recovery across nodes:
a spare node taking a lost node's place, the world shrinking without a lost node (``Shrinking``,
``--nnodes MIN:MAX``) and growing back when a spare brings a removed node back, each counted
against the job's budget of lost nodes (``--max-restarts``) and each a new generation of the
workers' group (``ddpkit.membership.generations``), numbered once for the whole job.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from ddpkit.control_plane.heartbeats import Heartbeats
from ddpkit.control_plane.launcher_records import LauncherRecords, NodeContactLostError
from ddpkit.control_plane.node_claims import (
    ClaimKind,
    claim,
    claim_kind,
    claimant,
    shrink_claim,
    spent_claim,
    step_aside_request,
)
from ddpkit.logs import get_logger
from ddpkit.membership.generations import REMOVED, announce_growth, announce_node_lost, claim_rank, layout_at, write_layout
from ddpkit.store import keys
from ddpkit.store.job_secret import job_secret

__all__ = ["NodeReplacedError", "NodeSteppedAside", "NodeWorld", "Shrinking"]

_log = get_logger("launching")

# What a removed node's record starts with while it is out of the world (then "back <generation>").
_OUT = "out"


class NodeReplacedError(NodeContactLostError):
    """A spare node took this node's place while its launcher could not reach the job's store."""


class NodeSteppedAside(NodeReplacedError):
    """A spare node took this node's place after node 0's launcher asked it to step aside (a straggler)."""


@dataclass(frozen=True)
class Shrinking:
    """Under in-place recovery with ``--nnodes MIN:MAX``: how far the world may shrink, and what a
    launcher needs to lay the next generation out without a lost node's ranks."""

    min_nodes: int  # MIN: the world never shrinks below it
    nproc_per_node: int  # node N's workers are the job's ranks N * nproc_per_node and on
    spares_possible: bool  # the rendezvous closed with fewer than MAX nodes: a spare node may take a lost one's place


class NodeWorld:
    """One launcher's view of the world's nodes and its part in changing them."""

    def __init__(self, records: LauncherRecords, heartbeats: Heartbeats, nnodes: int, survivors_go_on: bool,
                 shrinking: Shrinking | None, node_losses_allowed: int | None) -> None:
        self._records = records
        self._heartbeats = heartbeats
        self.nnodes = nnodes
        self.survivors_go_on = survivors_go_on
        self.shrinking = shrinking if survivors_go_on else None
        # Under in-place recovery, how many lost nodes the job recovers from (``--max-restarts``; None: any).
        self.node_losses_allowed = node_losses_allowed if survivors_go_on else None
        self._removed: set[int] = set()  # nodes the world shrank without (and not brought back), as read so far
        self.removals_seen = 0  # the entries of the log of removals and returns read so far

    # -- the world -------------------------------------------------------------------------------

    def nodes(self) -> list[int]:
        """The nodes of the world as this launcher last read them (``refresh``): every node the
        rendezvous closed with, but those it shrank without."""
        return [node for node in range(self.nnodes) if node not in self._removed]

    def refresh(self) -> None:
        """Read on the log of the world's removals and returns (``remove``, ``bring_back``): the
        launcher asks at each change of the job's news, and pays for the entries added since."""
        if self.shrinking is None:
            return
        for entry in self._records.read_log(keys.REMOVED_NODE, self.removals_seen, keys.JOB_WIDE):
            self.removals_seen += 1
            node, _, what = entry.partition(" ")
            if not node.isdigit():
                continue  # a forged entry: nothing
            if what.startswith(_OUT):
                self._removed.add(int(node))
            else:
                self._removed.discard(int(node))

    def removed(self) -> list[int]:
        """The nodes the world shrank without and no spare node brought back yet."""
        world = self.nodes()
        return [node for node in range(self.nnodes) if node not in world]

    def said_left(self, node: int) -> bool:
        """Whether ``node``'s launcher said it left the job."""
        return self._records.has(keys.of(keys.LEFT, node), keys.JOB_WIDE)

    def nodes_left(self) -> list[int]:
        """The nodes of the world whose launchers said they left the job."""
        return self._records.nodes_that_said(keys.LEFT, self.nodes(), keys.JOB_WIDE)

    def job_over(self, lost: Collection[int] = ()) -> bool:
        """Whether every node's launcher left the job or was taken for lost (``lost``: a claim on its
        place found it lost, and the others end the job without it): a spare then has nothing to wait for."""
        return set(self.nodes()) <= set(self.nodes_left()) | set(lost)

    # -- the budget of lost nodes and the generations -------------------------------------------

    def node_losses_left(self) -> bool:
        """Whether the job may still recover from a lost node (``node_losses_allowed``)."""
        allowed = self.node_losses_allowed
        return allowed is None or self._records.count(keys.NODE_LOSSES, 0, keys.JOB_WIDE) < allowed

    def spend_node_loss(self) -> None:
        """Count one lost node recovered from (by the launcher whose claim on its place won)."""
        self._records.count(keys.NODE_LOSSES, 1, keys.JOB_WIDE)

    def next_generation(self) -> int:
        """Count one more formation of the workers' group across the job (an in-place recovery on any
        node, or a spare node's takeover) and return its number: every node's workers agree on it.
        ``NodeReplacedError`` when a spare node took this node's place (its count is the spare's).
        One atomic ``add``: two changes at once (a rank replaced on one node while another node is
        lost) get two numbers, where a read and then a write could give both the same. The count is
        not signed; its key is under the job's namespace, which a stranger without the secret cannot
        name."""
        self.check_not_replaced(ask_store=True)
        return self._records.count(keys.GENERATION_COUNT, 1, keys.JOB_WIDE)

    # -- claims on a silent node's place ------------------------------------------------------------

    def claim(self, node: int, beat: str, text: str) -> bool:
        return claim(self._records, node, beat, text)

    def claimant(self, node: int, beat: str) -> str | None:
        return claimant(self._records, node, beat)

    def shrinks_without(self, node: int, beat: str) -> bool:
        """Whether the world goes on without the silent ``node`` (whose last beat was ``beat``): at
        least MIN nodes remain, and this launcher's claim on its place won (it then lays the next
        generation out, ``remove``) or another survivor's did."""
        if self.shrinking is None:
            return False
        world = self.nodes()
        if node not in world:
            # Another survivor's claim won and removed it since this launcher read the world: the
            # world is already without it (and may be at MIN now, which must not read as a loss below it).
            return True
        if not self._may_lose_one_of(world):
            return False
        if not self.node_losses_left():
            if self.claim(node, beat, spent_claim(self._heartbeats.who())):
                return False  # the others read this claim and end the job
        elif self._shrink_on_claim(node, beat, None):
            return True
        won = self.claimant(node, beat)
        return won is not None and claim_kind(won) is ClaimKind.SHRINK

    def shrink_without_straggler(self, node: int, beat: str, reason: str) -> bool:
        """Shrink the world without ``node``, alive but slow (asked to step aside for ``reason``, and no
        spare node took its place), when at least MIN nodes remain and the job may lose one more:
        True when this launcher's claim on its place won (not a spare node's) and the world shrank."""
        world = self.nodes()
        if node not in world or not self._may_lose_one_of(world) or not self.node_losses_left():
            return False
        return self._shrink_on_claim(node, beat, f"node {node} stepped aside ({reason}) and no spare node took its place")

    def _may_lose_one_of(self, world: list[int]) -> bool:
        """Whether the world (``world``'s nodes) may shrink by one node: MIN nodes would remain."""
        return self.shrinking is not None and len(world) - 1 >= self.shrinking.min_nodes

    def _shrink_on_claim(self, node: int, beat: str, why: str | None) -> bool:
        """Claim ``node``'s place to shrink the world without it; when this claim is the first, spend
        one node loss and remove it (``why``: see ``remove``)."""
        if not self.claim(node, beat, shrink_claim(self._heartbeats.who())):
            return False
        self.spend_node_loss()
        self.remove(node, why)
        return True

    def remove(self, node: int, why: str | None = None) -> None:
        """Shrink the world without ``node``: lay the next generation out without its ranks (their
        shares of the data go to the survivors), hold those ranks there for no process (its workers,
        should its link come back, end), say it is removed, then tell the survivors' workers."""
        if self.shrinking is None:
            raise RuntimeError("NodeWorld.remove: the world shrinks only under in-place recovery with --nnodes MIN:MAX")
        records, count = self._records, self.shrinking.nproc_per_node
        lost = set(range(node * count, (node + 1) * count))
        generation = self.next_generation()
        secret = job_secret()
        before = records.call(layout_at, records.store, secret, records.attempt, generation - 1, self.nnodes * count)
        layout = before.shrunk(lost)
        for rank in sorted(lost):
            records.call(claim_rank, records.store, secret, records.attempt, generation, rank, REMOVED)
        records.call(write_layout, records.store, secret, records.attempt, generation, layout)
        self._say_removal(node, f"{_OUT} {generation}")
        self._removed.add(node)
        lost_because = why or f"node {node}'s launcher went silent and no spare node took its place"
        why = f"{lost_because}: the world shrank to {len(layout.members)} ranks"
        records.call(announce_node_lost, records.store, secret, records.attempt, generation - 1, why)
        records.raise_news()  # the survivors' workers read it when their launcher relays the news
        _log.warning(f"ddpkit run: {why} on {len(self.nodes())} node(s) in generation {generation} of the group; "
                     f"the survivors train the lost ranks' shares of each global batch too (the global batch stays "
                     f"{layout.data_world_size} shares)")

    # -- a spare node taking a place (``launching.spare_node``) -------------------------------------

    def hand_over(self, attempt: int, generation: int, holders: Mapping[int, str], why: str) -> None:
        """As the spare node that took a lost node's place: hold its ranks in ``generation`` of the
        workers' group for this node's warm spares (``holders``: rank -> ``member_identity``), then
        tell the workers of the generation before that a node was lost (``why``; ``ddpkit.membership.generations``).
        In this order: the lost node's workers, if its link comes back, find their ranks held and end."""
        records, secret = self._records, job_secret()
        for rank, holder in holders.items():
            records.call(claim_rank, records.store, secret, attempt, generation, rank, holder)
        records.call(announce_node_lost, records.store, secret, attempt, generation - 1, why)
        records.raise_news()  # the survivors' workers read it when their launcher relays the news

    def _say_removal(self, node: int, what: str) -> None:
        """Say that ``node`` is out of the world, or back (``what``): its record (``claim_return``
        reads it) and an entry in the log every launcher reads on (``refresh``)."""
        self._records.put(keys.of(keys.REMOVED_NODE, node), what, keys.JOB_WIDE, news=False)
        self._records.append(keys.REMOVED_NODE, f"{node} {what}", keys.JOB_WIDE)

    def claim_return(self, node: int, text: str) -> bool:
        """Claim the place of ``node``, which the world shrank without, to bring it back: True for the
        one spare whose claim was written first."""
        removal = self._records.read(keys.of(keys.REMOVED_NODE, node), keys.JOB_WIDE) or ""
        return self._records.claim_first(keys.node_return(node, removal.partition(" ")[2]), text)

    def bring_back(self, attempt: int, generation: int, holders: Mapping[int, str], why: str) -> None:
        """As the spare node whose claim on a removed node's place won (``claim_return``): lay
        ``generation`` out with that node's ranks again (each takes its own share of the data back),
        hold them there for this node's warm spares (``holders``), count the node in the world
        again, then ask the survivors' workers to form ``generation`` at their next step boundary."""
        if self.shrinking is None:
            raise RuntimeError("NodeWorld.bring_back: only a world that may shrink (--nnodes MIN:MAX) grows back")
        records, secret = self._records, job_secret()
        before = records.call(layout_at, records.store, secret, attempt, generation - 1,
                              self.nnodes * self.shrinking.nproc_per_node)
        layout = before.grown(set(holders))
        for rank, holder in holders.items():
            records.call(claim_rank, records.store, secret, attempt, generation, rank, holder)
        records.call(write_layout, records.store, secret, attempt, generation, layout)
        self._say_removal(records.node_rank, f"back {generation}")
        self._removed.discard(records.node_rank)
        records.call(announce_growth, records.store, secret, attempt, generation - 1, why)
        records.raise_news()  # the survivors' workers read it when their launcher relays the news
        _log.warning(f"ddpkit run: this node (node {records.node_rank}) joins the world again in generation "
                     f"{generation} of the group, at the survivors' next step boundary: {len(layout.members)} ranks")

    def take_place_of(self, node: int) -> None:
        """This spare launcher is node ``node`` from now on (its claim won)."""
        self._records.node_rank = node
        self._heartbeats.forget(node)

    # -- this node's place taken ----------------------------------------------------------------

    def replaced_by(self) -> str | None:
        """The spare node that claimed this launcher's place after the others took it for lost, if one did."""
        return self._records.read(keys.takeover(self._records.node_rank, self._heartbeats.launcher_id), keys.JOB_WIDE)

    def was_replaced(self, ask_store: bool) -> bool:
        """Whether a spare node took this node's place: a beat found the spare's, or (``ask_store``,
        under in-place recovery, where spares exist) its claim on this launcher's place is written."""
        if self._heartbeats.replaced.is_set():
            return True
        if not (ask_store and self.survivors_go_on):
            return False
        # A claim that found the node lost (no node loss left, or no spare in time) replaces nothing.
        by = self.replaced_by()
        return by is not None and claim_kind(by) in (ClaimKind.SPARE, ClaimKind.SHRINK)

    def check_not_replaced(self, ask_store: bool) -> None:
        """``NodeReplacedError`` when a spare node took this node's place: known from a beat that found
        the spare's there, or (``ask_store``) read from its claim. A replaced launcher must neither
        announce a failure nor count a generation: the node it was is the spare's now."""
        if self.was_replaced(ask_store):
            by = self.replaced_by() or "unnamed"
            what = by if claim_kind(by) is ClaimKind.SHRINK else f"a spare node ({by}) took its place and its ranks"
            asked = step_aside_request(self._records, self._records.node_rank, self._heartbeats.launcher_id)
            if asked is not None:
                raise NodeSteppedAside(
                    f"node {self._records.node_rank} stepped aside ({asked}), and {what}: this node's workers are "
                    "ended and this launcher leaves the job, which goes on without it.")
            raise NodeReplacedError(
                f"node {self._records.node_rank}'s launcher could not reach the job's store for more than "
                f"{self._heartbeats.silent_seconds:g} s, so the other nodes took this node for lost, and {what}: this "
                "node's workers are ended (they must not meet the job's group again) and this launcher leaves the "
                "job, which goes on without it. Check this host's network.")
