"""The members of a group just formed prove to each other that they hold the job secret, over the
group's own connections, before anything is sent to a member or unpickled from one: the store is
anyone's, and a process outside the job can write its address there as a member's
(``Group.prove_members``; docs/security.md).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ddpkit.diagnostics.exits import leave_on_uncaught_exception
from ddpkit.diagnostics.settings import recovery_timeout_seconds
from ddpkit.diagnostics.waits import wait_for
from ddpkit.store.job_secret import JobSecret, member_proof
from ddpkit.variables import DDPKIT_RECOVERY_TIMEOUT_SECONDS

__all__ = ["MemberProofError", "prove_members"]

# Bytes each member draws for a formation's proofs (so a proof seen once proves nothing later).
_NONCE_BYTES = 16


class MemberProofError(RuntimeError):
    """A member of a newly formed group did not prove the job secret: a process outside the job
    wrote itself into the store as that rank. Nothing was sent to it."""


def prove_members(secret: JobSecret, scope: str, rank: int, world_size: int) -> None:
    """Every member of the default group proves ``secret`` for ``scope`` (the attempt and the
    generation): ``MemberProofError`` on every rank that did, naming the ranks that did not."""
    drawn = b"".join(_gather_proofs(os.urandom(_NONCE_BYTES), world_size, scope))
    proofs = _gather_proofs(member_proof(secret, scope, rank, drawn), world_size, scope)
    impostors = [member for member, given in enumerate(proofs)
                 if given != member_proof(secret, scope, member, drawn)]
    if impostors:
        raise MemberProofError(
            f"rank(s) {impostors} of the group just formed ({scope}) did not prove this job's secret "
            f"({secret.source}): a process outside the job wrote itself into the store as that rank (anyone "
            "who reaches the store's port can). Nothing was sent to it. Check who can reach the job's store port.")


def _gather_proofs(mine: bytes, world_size: int, scope: str) -> list[bytes]:
    """Every member's ``mine`` (all of one length), by rank; ``MemberProofError`` when a member
    does not take part within ``DDPKIT_RECOVERY_TIMEOUT_SECONDS``."""
    parts = [torch.empty(len(mine), dtype=torch.uint8) for _ in range(world_size)]
    pending = dist.all_gather(parts, torch.frombuffer(bytearray(mine), dtype=torch.uint8), async_op=True)
    seconds = recovery_timeout_seconds()
    try:
        wait_for(pending, within=seconds)
    except TimeoutError:
        leave_on_uncaught_exception()  # the gather stays pending in Gloo: exit without waiting for it
        raise MemberProofError(
            f"a member of the group just formed ({scope}) did not take part in proving the job's secret within "
            f"{seconds:g} s ({DDPKIT_RECOVERY_TIMEOUT_SECONDS}): a process outside the job most likely wrote "
            "itself into the store as a member. Nothing was sent to it.") from None
    return [bytes(part.tolist()) for part in parts]
