"""Claims on a silent node's place (under in-place recovery): the first launcher to write its claim
on a node's place, for the launcher that went silent there, decides what becomes of it. A spare
node's launcher claims it to take the node over (the claim names the spare); a survivor's claims
it to shrink the world without it, or, when the job may lose no more nodes or no spare claimed it in
time, to take it for lost. So a spare's claim written after the others took the node for lost
loses, and the spare waits on, rather than taking a place the others no longer hold for it.

A node that is alive but slow (a straggler, ``ddpkit run --stragglers replace``) is asked to step
aside: node 0's launcher writes a request for the launcher there, and a waiting spare node claims
its place as it would a silent one's; without a spare node 0's launcher may shrink the world
without it (``health.straggler_replacement``).
"""

from __future__ import annotations

import enum

from ddpkit.control_plane.launcher_records import LauncherRecords
from ddpkit.store import keys

__all__ = ["ClaimKind", "StepAsideRequests", "claim", "claim_kind", "claimant", "launcher_of", "lost_claim",
           "shrink_claim", "spare_claimed_first", "spent_claim", "step_aside_request"]


class ClaimKind(enum.Enum):
    """What the claim that won a node's place does with it."""

    SPARE = "a spare node takes its place"
    SHRINK = "the world shrank without it"
    SPENT = "no node loss left to recover from"
    LOST = "no spare node claimed its place in time"


def shrink_claim(who: str) -> str:
    """A survivor's claim that shrinks the world without the node (``who``: the survivor's launcher)."""
    return f"{ClaimKind.SHRINK.value} ({who} shrank it)"


def spent_claim(who: str) -> str:
    """A survivor's claim that the node is lost for good: the job may lose no more nodes."""
    return f"{ClaimKind.SPENT.value} ({who} found it lost)"


def lost_claim(who: str) -> str:
    """A survivor's claim that the node is lost: no spare node claimed its place while the others waited."""
    return f"{ClaimKind.LOST.value} ({who} found it lost)"


def claim_kind(text: str) -> ClaimKind:
    """The kind of the claim ``text`` (a spare's names the spare: anything else)."""
    for kind in (ClaimKind.SHRINK, ClaimKind.SPENT, ClaimKind.LOST):
        if text.startswith(kind.value):
            return kind
    return ClaimKind.SPARE


def launcher_of(beat: str) -> str:
    """The id of the launcher that wrote ``beat`` (``launcher id:count``)."""
    return beat.partition(":")[0]


def claim(records: LauncherRecords, node: int, beat: str, text: str) -> bool:
    """Claim the place of ``node``, whose launcher's last beat was ``beat``: True for the one
    launcher whose claim was written first."""
    return records.claim_first(keys.takeover(node, launcher_of(beat)), text)


def claimant(records: LauncherRecords, node: int, beat: str) -> str | None:
    """Who claimed the place of ``node`` after its launcher went silent at ``beat``, if anyone."""
    return records.read(keys.takeover(node, launcher_of(beat)), keys.JOB_WIDE)


def spare_claimed_first(records: LauncherRecords, node: int, beat: str, who: str) -> bool:
    """Settle that the silent ``node`` (whose launcher's last beat was ``beat``) is lost, once no
    spare node claimed its place while the others waited: claim the place for no one (``who``: this
    launcher). False when that claim, or another survivor's, was written first; True when a spare
    node's claim was (written since the others' last look: the caller waits for the spare's beat, as
    for any spare's claim). Without this claim a spare claiming late won a place the others had
    given up: they ended the job, the spare took the place, and waited at the restart meeting until
    its time out."""
    if claim(records, node, beat, lost_claim(who)):
        return False
    won = claimant(records, node, beat)
    return won is not None and claim_kind(won) is ClaimKind.SPARE


def step_aside_request(records: LauncherRecords, node: int, launcher: str) -> str | None:
    """Why ``node``'s launcher ``launcher`` (its id, ``launcher_of``) was asked to step aside, if it was."""
    return records.read(keys.step_aside(node, launcher), keys.JOB_WIDE)


class StepAsideRequests:
    """Node 0's requests that a slow node's launcher hand its place to a spare node (``ddpkit run
    --stragglers replace``), one per launcher there, and which node's launcher hosts the job's
    store (a node that must not step aside: the job would end with it)."""

    def __init__(self, records: LauncherRecords) -> None:
        self._records = records

    def ask(self, node: int, beat: str, reason: str) -> bool:
        """Ask a spare node to take the place of ``node``, whose launcher (that of ``beat``) is alive
        but slow: True the first time for that launcher. (Only node 0's launcher asks: no race.)"""
        name = keys.step_aside(node, launcher_of(beat))
        if self._records.has(name, keys.JOB_WIDE):
            return False
        self._records.put(name, reason, keys.JOB_WIDE)
        self._records.count(keys.count_of(keys.STEP_ASIDE), 1, keys.JOB_WIDE)
        return True

    def any_asked(self) -> bool:
        """Whether any node was asked to step aside yet (one read)."""
        return self._records.hint(keys.STEP_ASIDE, keys.JOB_WIDE) > 0

    def request(self, node: int, launcher: str) -> str | None:
        """Why ``node``'s launcher ``launcher`` (its id, ``launcher_of``) was asked to step aside, if it was."""
        return step_aside_request(self._records, node, launcher)

    def say_store_host(self) -> None:
        """Say that this node's launcher hosts the job's store."""
        self._records.put(keys.STORE_HOST, str(self._records.node_rank), keys.JOB_WIDE)

    def store_host_node(self) -> int | None:
        """The node whose launcher hosts the job's store (None: one outside the nodes, ``ddpkit store``)."""
        node = self._records.read(keys.STORE_HOST, keys.JOB_WIDE)
        return None if node is None else int(node)
