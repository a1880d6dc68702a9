"""Where one generation of the workers' group keeps its keys in the job's store, and the records that
a spare node's launcher writes there for the workers (torch-free: the launcher imports it).

Every formation of the group under in-place recovery (``ddpkit.group``) is a generation with keys of
its own under ``generation_prefix``, its records bound to ``generation_scope`` by the job secret.
When a spare node takes a lost node's place (``launching.spare_node``), its launcher writes two
things there before its warm spares join:

- **who holds the lost ranks in the next generation** (``claim_rank``): the first holder written
  for a rank wins, and every rank claims its own before it counts itself in (``Group.meet``).
  A node taken for lost may be alive behind a link that went down; when the link comes back, its
  workers find their ranks held by the spare's and end (``RankTakenError``) instead of meeting
  the next generation as a second copy of a rank (fenced);
- **that the generation the survivors are in lost a node** (``announce_node_lost``): a node whose
  link went down closed no connection, so the survivors' collectives would wait on it; their waits
  read this between slices (``ddpkit.diagnostics.failures``) and they form the next generation.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from ddpkit.job_secret import JobSecret, RecordSigner, unsigned_namespace

__all__ = ["RankTakenError", "announce_node_lost", "claim_rank", "generation_prefix", "generation_scope",
           "member_identity", "node_lost"]

_NODE_LOST = "node_lost"


class RankTakenError(RuntimeError):
    """This process's rank in the next generation is held by another process: a spare node took its
    node's place while it could not be reached. It must end, and not train as that rank."""


def generation_prefix(secret: JobSecret | None, attempt: int, generation: int) -> str:
    """The prefix of ``generation``'s keys (of the workers' ``attempt``) in the job's store."""
    namespace = secret.namespace() if secret is not None else unsigned_namespace()
    return f"{namespace}attempt/{attempt}/generation/{generation}/"


def generation_scope(attempt: int, generation: int) -> str:
    """What the generation's records are bound to (``RecordSigner``'s scope)."""
    return f"attempt {attempt} generation {generation}"


def member_identity(pid: int | None = None) -> str:
    """How a process names itself as a rank's holder: its host and pid (this process's by default)."""
    return f"{socket.gethostname()}:{os.getpid() if pid is None else pid}"


def claim_rank(store: Any, secret: JobSecret | None, attempt: int, generation: int, rank: int, holder: str) -> str:
    """Claim ``rank`` in ``generation`` for ``holder`` (``member_identity``) unless a process of the
    job holds it already; return who holds it now (a stranger's value holds nothing: replaced)."""
    key = f"{generation_prefix(secret, attempt, generation)}member/{rank}"
    return RecordSigner(secret, generation_scope(attempt, generation)).write_first(store, key, holder)


def announce_node_lost(store: Any, secret: JobSecret | None, attempt: int, generation: int, why: str) -> None:
    """Tell the workers of ``generation`` that a node of theirs was lost (``why``)."""
    signer, key = _node_lost_record(secret, attempt, generation)
    store.set(key, signer.sign(key, why))


def node_lost(store: Any, secret: JobSecret | None, attempt: int, generation: int) -> str | None:
    """Why a node of ``generation`` was lost, when a spare node's launcher said so; else None."""
    signer, key = _node_lost_record(secret, attempt, generation)
    if not store.check([key]):
        return None
    return signer.verify(key, store.get(key))


def _node_lost_record(secret: JobSecret | None, attempt: int, generation: int) -> tuple[RecordSigner, str]:
    return (RecordSigner(secret, generation_scope(attempt, generation)),
            f"{generation_prefix(secret, attempt, generation)}{_NODE_LOST}")
