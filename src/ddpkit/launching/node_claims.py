"""Claims on a silent node's place (under in-place recovery): the first launcher to write its claim
on a node's place, for the launcher that went silent there, decides what becomes of it. A spare
node's launcher claims it to take the node over (the claim names the spare); a survivor's claims
it to shrink the world without it, or, when the job may lose no more nodes, to end the job.

A node that is alive but slow (a straggler, ``ddpkit run --stragglers replace``) is asked to step
aside: node 0's launcher writes a request for the launcher there, and a waiting spare node claims
its place as it would a silent one's. Without a spare nothing happens: the node stays.
"""

from __future__ import annotations

import enum

from ddpkit.launching.launcher_records import LauncherRecords
from ddpkit.store import keys

__all__ = ["ClaimKind", "ask_to_step_aside", "claim", "claim_kind", "claimant", "launcher_of", "shrink_claim",
           "spent_claim", "step_aside_request"]


class ClaimKind(enum.Enum):
    """What the claim that won a node's place does with it."""

    SPARE = "a spare node takes its place"
    SHRINK = "the world shrank without it"
    SPENT = "no node loss left to recover from"


def shrink_claim(who: str) -> str:
    """A survivor's claim that shrinks the world without the node (``who``: the survivor's launcher)."""
    return f"{ClaimKind.SHRINK.value} ({who} shrank it)"


def spent_claim(who: str) -> str:
    """A survivor's claim that the node is lost for good: the job may lose no more nodes."""
    return f"{ClaimKind.SPENT.value} ({who} found it lost)"


def claim_kind(text: str) -> ClaimKind:
    """The kind of the claim ``text`` (a spare's names the spare: anything else)."""
    for kind in (ClaimKind.SHRINK, ClaimKind.SPENT):
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


def ask_to_step_aside(records: LauncherRecords, node: int, beat: str, reason: str) -> bool:
    """Ask a spare node to take the place of ``node``, whose launcher (that of ``beat``) is alive but
    slow: True the first time for that launcher. (Only node 0's launcher asks: no race to settle.)"""
    name = keys.step_aside(node, launcher_of(beat))
    if records.has(name, keys.JOB_WIDE):
        return False
    records.put(name, reason, keys.JOB_WIDE)
    records.count(keys.count_of(keys.STEP_ASIDE), 1, keys.JOB_WIDE)
    return True


def step_aside_request(records: LauncherRecords, node: int, launcher: str) -> str | None:
    """Why ``node``'s launcher ``launcher`` (its id, ``launcher_of``) was asked to step aside, if it was."""
    return records.read(keys.step_aside(node, launcher), keys.JOB_WIDE)
