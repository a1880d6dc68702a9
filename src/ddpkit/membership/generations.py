"""Where one generation of the workers' group keeps its keys in the job's store, and the records that
a spare node's launcher writes there for the workers (torch-free: the launcher imports it).

Every formation of the group under in-place recovery (``ddpkit.membership.group``) is a generation with keys of
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

When no spare node waits and enough nodes remain (``--nnodes MIN:MAX``), a survivor's launcher
shrinks the world instead (``control_plane.nodes``): it writes the next generation's **layout**
(``Layout``, ``write_layout``) before it says the node was lost, and holds the lost ranks there for
no process (``REMOVED``), which fences them out as a spare's claim would. A layout says which of
the job's ranks (``RANK`` as the launchers started them) are the group's members, in group-rank
order, and which shares of the data each trains: the world the job started with is kept as the
*data world* of ``data_world_size`` shares, so that the global batch, and with it the result, stay
those of the run without the loss. A generation without a layout record keeps the one before it
(``layout_at``); generation 0's is ``Layout.initial``.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from typing import Any

from ddpkit.store import keys as store_keys
from ddpkit.store.job_secret import JobSecret, RecordSigner, unsigned_namespace

__all__ = ["LAYOUT_LOOK_SECONDS", "REMOVED", "Layout", "RankTakenError", "announce_finished", "announce_growth",
           "announce_node_lost", "carry_layout_forward", "claim_rank", "generation_prefix", "generation_scope",
           "growth_requested", "job_finished", "latest_layout", "layout_at", "meet_periods", "member_identity",
           "node_lost", "announce_rejoin", "announce_waiting", "rejoin_announced", "waiting_for", "write_layout"]


#: The holder of a rank that the world shrank without (``claim_rank``): no process is it, so a lost
#: node's worker that comes back finds its rank held and ends.
REMOVED = "removed: the world shrank without this rank"


@dataclass(frozen=True)
class Layout:
    """Who the group's members are in a generation, and which shares of the data each trains.

    ``members``: the job's ranks present, by group rank (the order they were started in);
    ``shares``: for each member, the shares of the data world it trains, each one the batch that
    rank of the starting world trained. Every share is trained by exactly one member."""

    members: tuple[int, ...]
    shares: tuple[tuple[int, ...], ...]

    @classmethod
    def initial(cls, world_size: int) -> Layout:
        """The world as the job started: every rank trains its own share."""
        return cls(tuple(range(world_size)), tuple((rank,) for rank in range(world_size)))

    @property
    def data_world_size(self) -> int:
        return sum(len(held) for held in self.shares)

    def shrunk(self, lost: set[int]) -> Layout:
        """This layout without the job's ranks ``lost``: the survivors keep their order, and each lost
        share goes to the survivor that trains the fewest then (the lowest group rank among equals),
        so that no survivor trains more than one share beyond another. ``ValueError`` when no member
        would remain."""
        kept = [index for index, member in enumerate(self.members) if member not in lost]
        if not kept:
            raise ValueError(f"every member of the group ({list(self.members)}) would be lost: nothing to shrink to")
        shares = {index: list(self.shares[index]) for index in kept}
        orphaned = sorted(share for index, member in enumerate(self.members) if member in lost
                          for share in self.shares[index])
        for share in orphaned:
            taker = min(kept, key=lambda index: (len(shares[index]), index))
            shares[taker].append(share)
        return Layout(tuple(self.members[index] for index in kept), tuple(tuple(sorted(shares[index])) for index in kept))

    def grown(self, joining: set[int]) -> Layout:
        """This layout with the job's ranks ``joining`` back (a node that joins after a shrink): each
        takes its own share back from the member that trained it meanwhile; the members stay in the
        order the launchers started them. ``ValueError`` for a rank that is a member already, or
        beyond the data world."""
        if clash := sorted(joining & set(self.members)):
            raise ValueError(f"rank(s) {clash} (as the job started them) are members of the group already")
        if beyond := sorted(rank for rank in joining if not 0 <= rank < self.data_world_size):
            raise ValueError(f"rank(s) {beyond} are not ranks of the world of {self.data_world_size} the job started with")
        held = {member: [share for share in shares if share not in joining]
                for member, shares in zip(self.members, self.shares, strict=True)}
        held.update({rank: [rank] for rank in joining})
        members = sorted(held)
        return Layout(tuple(members), tuple(tuple(held[member]) for member in members))

    def place_of(self, job_rank: int) -> tuple[int, tuple[int, ...]]:
        """The group rank of the job's rank ``job_rank`` and the shares it trains; ``ValueError``
        when it is not a member."""
        if job_rank not in self.members:
            raise ValueError(f"rank {job_rank} (as the job started it) is not a member of the group now "
                             f"(members: {list(self.members)})")
        index = self.members.index(job_rank)
        return index, self.shares[index]

    def to_json(self) -> str:
        """The record every rank reads when it meets a generation: its members as runs of consecutive
        ranks, and only the shares of members that train other than their own, so that its size is
        that of the changes since the job started, not of the world (a list of 8,192 members is
        112 KB, which every one of them would read from the one store)."""
        runs: list[list[int]] = []
        for member in self.members:
            if runs and runs[-1][1] == member:
                runs[-1][1] = member + 1
            else:
                runs.append([member, member + 1])
        moved = {str(index): list(held) for index, (member, held) in enumerate(zip(self.members, self.shares, strict=True))
                 if held != (member,)}
        return json.dumps({"members": runs, "shares": moved}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Layout:
        value = json.loads(text)
        members = tuple(member for first, end in value["members"] for member in range(int(first), int(end)))
        moved = {int(index): tuple(int(share) for share in held) for index, held in value["shares"].items()}
        return cls(members, tuple(moved[index] if index in moved else (member,) for index, member in enumerate(members)))


class RankTakenError(RuntimeError):
    """This process's rank in the next generation is held by another process: a spare node took its
    node's place while it could not be reached. It must end, and not train as that rank."""


# How often a rank waiting for a generation's members counts the arrivals, and looks at what the
# launchers wrote (a layout, the generation given up, the training ended: about four requests).
# In a small world every 5 ms and 50 ms; in a big one less often, so that all its members together
# ask the job's one store at most _MEET_REQUESTS_PER_SECOND times a second while the group forms
# (which leaves it free for the launchers' beats): with 8 ranks on each of 1,024 nodes, a count
# every 1.6 s and a look every 6.6 s. The price is that the last arrival is seen that much later.
_MEET_COUNT_SECONDS = 0.005
#: How often a rank waiting for a generation looks for its layout or its end, at the least (a
#: shrink's layout comes late); ``Group`` waits as often for a generation to be given up.
LAYOUT_LOOK_SECONDS = 0.05
_MEET_REQUESTS_PER_SECOND = 10_000
_LOOK_REQUESTS = 4


def meet_periods(members: int) -> tuple[float, float]:
    """How often a rank waiting for ``members`` ranks to arrive counts them, and looks at the
    launchers' records: each half of its share of the store's budget for meeting."""
    share = _MEET_REQUESTS_PER_SECOND / members / 2
    return max(_MEET_COUNT_SECONDS, 1 / share), max(LAYOUT_LOOK_SECONDS, _LOOK_REQUESTS / share)


def generation_prefix(secret: JobSecret | None, attempt: int, generation: int) -> str:
    """The prefix of ``generation``'s keys (of the workers' ``attempt``) in the job's store."""
    namespace = secret.namespace() if secret is not None else unsigned_namespace()
    return store_keys.generation_prefix(namespace, attempt, generation)


def generation_scope(attempt: int, generation: int) -> str:
    """What the generation's records are bound to (``RecordSigner``'s scope)."""
    return f"attempt {attempt} generation {generation}"


def member_identity(pid: int | None = None) -> str:
    """How a process names itself as a rank's holder: its host and pid (this process's by default)."""
    return f"{socket.gethostname()}:{os.getpid() if pid is None else pid}"


def claim_rank(store: Any, secret: JobSecret | None, attempt: int, generation: int, rank: int, holder: str) -> str:
    """Claim ``rank`` in ``generation`` for ``holder`` (``member_identity``) unless a process of the
    job holds it already; return who holds it now (a stranger's value holds nothing: replaced)."""
    key = generation_prefix(secret, attempt, generation) + store_keys.member(rank)
    return RecordSigner(secret, generation_scope(attempt, generation)).write_first(store, key, holder)


def announce_waiting(store: Any, secret: JobSecret | None, attempt: int, generation: int, holder: str) -> None:
    """Say that a process of the job (``holder``, the first to say it) waits for ``generation`` to form:
    a generation before it that is still forming will not (a member of it was replaced)."""
    signer, key = _record(secret, attempt, generation, store_keys.WAITING)
    signer.write_first(store, key, holder)


def waiting_for(store: Any, secret: JobSecret | None, attempt: int, generation: int) -> str | None:
    """Which process of the job waits for ``generation`` (``announce_waiting``), or None: signed, so
    that a stranger's write counts as none (the count of arrivals beside it cannot be signed)."""
    signer, key = _record(secret, attempt, generation, store_keys.WAITING)
    return signer.read(store, key)


def announce_node_lost(store: Any, secret: JobSecret | None, attempt: int, generation: int, why: str) -> None:
    """Tell the workers of ``generation`` that a node of theirs was lost (``why``)."""
    signer, key = _node_lost_record(secret, attempt, generation)
    signer.write(store, key, why)


def node_lost(store: Any, secret: JobSecret | None, attempt: int, generation: int) -> str | None:
    """Why a node of ``generation`` was lost, when a spare node's launcher said so; else None."""
    signer, key = _node_lost_record(secret, attempt, generation)
    return signer.read(store, key)


def write_layout(store: Any, secret: JobSecret | None, attempt: int, generation: int, layout: Layout) -> None:
    """Lay ``generation`` of the workers' group out as ``layout`` (a launcher that shrinks the world)."""
    signer, key = _record(secret, attempt, generation, store_keys.LAYOUT)
    signer.write(store, key, layout.to_json())


def layout_at(store: Any, secret: JobSecret | None, attempt: int, generation: int, world_size: int,
              known: tuple[int, Layout] | None = None) -> Layout:
    """The layout of ``generation``: the latest written for it or a generation before it, else the
    world of ``world_size`` ranks as the job started (a forged record counts as none). ``known``: a
    generation at most ``generation`` and its layout, read before (one that formed: no layout of it
    or of a generation before it is written after), where the reads back stop; without it they go
    back to generation 1, one request each (fewer once finished generations were removed:
    ``carry_layout_forward``)."""
    stop, layout = known if known is not None and known[0] <= generation else (0, Layout.initial(world_size))
    found = latest_layout(store, secret, attempt, generation, stop)
    return layout if found is None else found[1]


def latest_layout(store: Any, secret: JobSecret | None, attempt: int, generation: int,
                  stop: int = 0) -> tuple[int, Layout] | None:
    """The latest layout written for ``generation`` or a generation before it down to ``stop``
    (excluded), and the generation it was written for; None when there is none."""
    for earlier in range(generation, stop, -1):
        signer, key = _record(secret, attempt, earlier, store_keys.LAYOUT)
        if (text := signer.read(store, key)) is not None:
            return earlier, Layout.from_json(text)
    return None


def carry_layout_forward(store: Any, secret: JobSecret | None, attempt: int, generation: int) -> None:
    """Write at ``generation`` the layout in force there when it was written for an earlier one, so
    that the generations before it can be removed and a read back stops there. Only where none is
    written yet (a launcher that lays ``generation`` out itself writes over it)."""
    found = latest_layout(store, secret, attempt, generation)
    if found is not None and found[0] < generation:
        signer, key = _record(secret, attempt, generation, store_keys.LAYOUT)
        signer.write_first(store, key, found[1].to_json())


def announce_growth(store: Any, secret: JobSecret | None, attempt: int, generation: int, why: str) -> None:
    """Ask the workers of ``generation`` to form the next one, laid out with more members (``why``:
    who joins), at their next step boundary."""
    signer, key = _record(secret, attempt, generation, store_keys.GROW)
    signer.write(store, key, why)


def growth_requested(store: Any, secret: JobSecret | None, attempt: int, generation: int) -> str | None:
    """Who waits to join, when a launcher asked the workers of ``generation`` to grow; else None."""
    signer, key = _record(secret, attempt, generation, store_keys.GROW)
    return signer.read(store, key)


def announce_finished(store: Any, secret: JobSecret | None, attempt: int, generation: int) -> None:
    """Tell the ranks waiting to form ``generation`` (a node that asked to join) that the training
    ended before it formed: there is nothing left for them to train."""
    signer, key = _record(secret, attempt, generation, store_keys.FINISHED)
    signer.write(store, key, "finished")


def job_finished(store: Any, secret: JobSecret | None, attempt: int, generation: int) -> bool:
    """Whether the training ended before ``generation`` formed (``announce_finished``)."""
    signer, key = _record(secret, attempt, generation, store_keys.FINISHED)
    return signer.read(store, key) is not None


def announce_rejoin(store: Any, secret: JobSecret | None, attempt: int, generation: int) -> None:
    """Tell the members of ``generation`` that waited outside its survivors' block (``Group.form_part``)
    to form the whole generation with them now."""
    signer, key = _record(secret, attempt, generation, store_keys.REJOIN)
    signer.write(store, key, "rejoin")


def rejoin_announced(store: Any, secret: JobSecret | None, attempt: int, generation: int) -> bool:
    """Whether the survivors of ``generation`` asked the members waiting outside to rejoin."""
    signer, key = _record(secret, attempt, generation, store_keys.REJOIN)
    return signer.read(store, key) is not None


def _record(secret: JobSecret | None, attempt: int, generation: int, name: str) -> tuple[RecordSigner, str]:
    return (RecordSigner(secret, generation_scope(attempt, generation)),
            f"{generation_prefix(secret, attempt, generation)}{name}")


def _node_lost_record(secret: JobSecret | None, attempt: int, generation: int) -> tuple[RecordSigner, str]:
    return _record(secret, attempt, generation, store_keys.NODE_LOST)
