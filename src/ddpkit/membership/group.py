"""The group this process trains in, as ddpkit keeps it: who is in it now, and the one place
where that changes.

``init_dist_connection`` makes one ``Group`` per connection (``current_group()``). It owns what
torch's default process group does not say about itself:

- the **store**: the launcher's (``ddpkit run`` hosts it under in-place recovery and when nodes
  restart together: it outlives any rank, and each attempt and each generation of the group keeps
  its keys under a prefix of its own), or None when the group's own store is rank 0's;
- the **membership**: generation, rank and world size (``Membership``);
- ``abort()``: leave torch's group (a rank of it vanished) and free it in a thread of its own,
  since freeing waits for any collective of it still pending in a Gloo thread;
- ``reconfigure()``: form the next generation, laid out as the launchers said (``ddpkit.membership.generations``:
  the same members, a replacement taking a lost rank's place, or fewer when the world shrank),
  once every member has arrived;
- ``on_reconfigure(callback)``: **the one hook** through which whatever caches membership learns
  of a new generation. Called in registration order, after the new torch group exists and
  before anything else runs on it. Who registers: the diagnostics (the hang watch and the peer
  watch follow the new group), the DDP module (rank, world size, its Reducer's scale), the
  sampler of ``ddpkit.training.data.shard`` (its share of the data), ``StepAgreement`` (a round pending on
  the abandoned group is dropped). A comm hook's state (PowerSGD's) does not: in-place recovery
  refuses a comm hook state, since it would not reach a replacement.

With a job secret (``ddpkit.store.job_secret``), the group's keys live under the job's prefix, its
records are bound to its attempt and generation, and every formation of it (at connection, and
each ``reconfigure``) begins with ``prove_members``: each member proves over the group's own
connections that it holds the secret, before anything is sent to it or unpickled from it (a
process outside the job that wrote itself into the store as a member is named, and the ranks
stop).

The membership knows two worlds. The **group**'s (rank, world size) is torch's: who sends to whom.
The **data world** is the one the job started with (``ddpkit.membership.generations.Layout``): each of its
ranks trained one share of every global batch, and when the world shrinks a survivor trains the
lost ranks' shares as well as its own (``Membership.shares``), so the global batch stays the same.
A process is known across generations by its **job rank**, ``RANK`` as the launcher started it.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpkit.diagnostics.failures import PeerLostError, expect_vanished_peers, sign_records_in
from ddpkit.diagnostics.hangs import start_hang_watch
from ddpkit.diagnostics.peer_watch import abort_nccl_communicators, watch_peers
from ddpkit.diagnostics.relayed_news import announce, relayed_news
from ddpkit.diagnostics.settings import recovery_timeout_seconds
from ddpkit.logs import get_logger
from ddpkit.membership.abandoned import free_in_background
from ddpkit.membership.generations import (
    LAYOUT_LOOK_SECONDS,
    Layout,
    RankTakenError,
    announce_finished,
    announce_rejoin,
    announce_waiting,
    claim_rank,
    generation_prefix,
    generation_scope,
    growth_requested,
    job_finished,
    layout_at,
    meet_periods,
    member_identity,
    node_lost,
    rejoin_announced,
    waiting_for,
)
from ddpkit.membership.member_proofs import MemberProofError, prove_members
from ddpkit.process_state import PROCESS
from ddpkit.store import keys as store_keys
from ddpkit.store.forming import GenerationAbandonedError, forming
from ddpkit.store.job_secret import JobSecret, RecordSigner
from ddpkit.store.signed import signed
from ddpkit.variables import DDPKIT_RECOVERY_TIMEOUT_SECONDS

__all__ = ["Group", "MemberProofError", "Membership", "current_group"]

_log = get_logger("recovery")

# How often a member left out of its generation's block looks whether it may rejoin (a block may last minutes).
_OUTSIDE_LOOK_SECONDS = 0.1
# How often a rank waiting for a generation's members looks at its launcher's relayed news (a local
# file): the last arrival's news then reaches it within its launcher's look and this.
_NEWS_LOOK_SECONDS = 0.01

# Gloo waits for a member to connect to this one for several times the timeout it is given (five
# times with torch 2.13's), so forming a group is given a share of the recovery timeout.
_GLOO_CONNECT_WAITS = 5

@dataclass(frozen=True)
class Membership:
    """Who this process is in the group now."""

    generation: int  # 0 at connection; each ``reconfigure`` forms the next
    rank: int
    world_size: int
    # The shares of the data world this rank trains, and that world's size (see the module
    # docstring); empty and 0: its own share of a world that never shrank.
    held_shares: tuple[int, ...] = ()
    data_world: int = 0

    @property
    def members(self) -> list[int]:
        """The ranks of the group (global ranks: the group is the default one)."""
        return list(range(self.world_size))

    @property
    def shares(self) -> tuple[int, ...]:
        """The shares of every global batch this rank trains, as ranks of the data world."""
        return self.held_shares or (self.rank,)

    @property
    def data_world_size(self) -> int:
        """How many shares each global batch has: the world size the job started with."""
        return self.data_world or self.world_size

    @property
    def weight(self) -> float | None:
        """This rank's part of the global batch, what its gradient counts for in the average, in a
        world that shrank; None otherwise (every rank counts for 1/world_size)."""
        return len(self.shares) / self.data_world_size if self.data_world_size != self.world_size else None


Reaction = Callable[[Membership], None]


class Group:
    """This process's place in the job's default process group (see the module docstring)."""

    def __init__(self, membership: Membership, backend: str, timeout: timedelta,
                 launcher_store: Any = None, attempt: int = 0, survivors_go_on: bool = False,
                 secret: JobSecret | None = None) -> None:
        if survivors_go_on and launcher_store is None:
            raise ValueError("A group that can be formed again needs the launcher's store: the group's own store "
                             "may die with the rank that hosts it.")
        self._membership = membership
        # How the launcher started this process (``RANK``): its name in every generation's layout.
        self.job_rank = membership.rank
        self._started_world = membership.world_size  # the data world: WORLD_SIZE as the launcher started it
        self._backend = backend
        self._timeout = timeout
        self._launcher_store = launcher_store
        self._attempt = attempt
        self._survivors_go_on = survivors_go_on
        self._secret = secret
        self._part = ""  # the part of the generation formed now (``form_part``); "" for the whole of it
        # The last generation this process met and its layout, and the last that formed with it (no
        # layout of it or of an earlier generation is written after): reading a later generation's
        # layout stops there instead of reading back to generation 1.
        self._met: tuple[int, Layout] | None = None
        self._formed_layout: tuple[int, Layout] | None = None
        self._reactions: dict[int, Callable[[], Reaction | None]] = {}
        self._next_reaction = 0

    # -- what it is ------------------------------------------------------------------------------

    @property
    def membership(self) -> Membership:
        return self._membership

    @property
    def generation(self) -> int:
        return self._membership.generation

    @property
    def rank(self) -> int:
        return self._membership.rank

    @property
    def world_size(self) -> int:
        return self._membership.world_size

    @property
    def survivors_go_on(self) -> bool:
        """Whether the group can be formed again (``ddpkit run --recovery in-place``)."""
        return self._survivors_go_on

    def store_of(self, generation: int, part: str = "") -> Any:
        """The launcher's store under ``generation``'s prefix (and ``part``'s, ``form_part``): that
        generation's torch group's store (torch's values in it signed, with a job secret:
        ``ddpkit.store.signed``)."""
        return self.signed(dist.PrefixStore(self._prefix(generation) + part, self._launcher_store),  # type: ignore[attr-defined]
                           generation, part)

    def signed(self, store: Any, generation: int | None = None, part: str | None = None) -> Any:
        """``store`` with torch's values signed for ``generation`` and ``part`` (the current ones by
        default), so that a process outside the job cannot write itself in as a member; ``store``
        itself without a job secret."""
        generation = self.generation if generation is None else generation
        return signed(store, RecordSigner(self._secret, self._scope(generation, self._part if part is None else part)))

    # -- the one hook ------------------------------------------------------------------------------

    def on_reconfigure(self, reaction: Reaction) -> Callable[[], None]:
        """Call ``reaction(membership)`` after each ``reconfigure``; return a function that stops it.

        A bound method is held weakly (a DDP module or a sampler that is dropped is not kept
        alive by the group, and its reaction ends with it); any other callable strongly.
        """
        key = self._next_reaction
        self._next_reaction += 1
        if hasattr(reaction, "__self__") and hasattr(reaction, "__func__"):
            self._reactions[key] = weakref.WeakMethod(reaction)
        else:
            self._reactions[key] = lambda: reaction

        def stop() -> None:
            self._reactions.pop(key, None)

        return stop

    # -- changes --------------------------------------------------------------------------------

    def install_diagnostics(self) -> None:
        """Start the diagnostics that follow the group: its records bound to this generation, the hang
        watch (when hang diagnosis is on) and the peer watch; under in-place recovery a collective
        failing without a record means a lost rank."""
        sign_records_in(self._scope(self.generation, self._part))
        start_hang_watch()
        watch_peers()
        if self._survivors_go_on:
            attempt, generation = self._attempt, self.generation
            # A node lost behind a link that went down closes no connection: its spare's launcher says so.
            expect_vanished_peers(lambda: node_lost(self._launcher_store, self._secret, attempt, generation))

    def abort(self) -> None:
        """Leave torch's default group (a rank of it vanished): destroyed here, freed in a thread. On
        NCCL its communicators are aborted first (torch's documented way to end kernels that wait
        for a peer that is gone; the peer watch may have done so already)."""
        if dist.is_initialized() and self._backend == "nccl":
            abort_nccl_communicators()
        if dist.is_initialized():
            abandoned = [dist.distributed_c10d._get_default_group()]  # no reference of this thread's outlives it
            dist.destroy_process_group()
            free_in_background(abandoned, self.generation)

    def reconfigure(self) -> Membership:
        """Abandon the current torch group and form the next generation as the launchers laid it out
        (``ddpkit.membership.generations.layout_at``: the same members, a replacement taking a lost rank's place,
        or the survivors of a world that shrank) once every member has arrived (``form``); then tell
        every reaction. ``TimeoutError`` when not all arrive within ``DDPKIT_RECOVERY_TIMEOUT_SECONDS``."""
        if not self._survivors_go_on:
            raise RuntimeError("Forming the group again needs in-place recovery (ddpkit run --recovery in-place): "
                               "this process's store is its group's own and may have died with the lost rank.")
        self.abort()
        self.form(self._membership.generation + 1)  # or a later one
        _tell(self._reactions, self._membership)
        return self._membership

    def form_part(self, part: str, without: list[int] | None = None) -> Membership:
        """Abandon the current torch group and form, within this generation, a part of its members
        under the generation's keys and ``part``'s: the survivors alone (``store.keys.BLOCK_PART``,
        ``without`` the members of those group ranks, whose shares of the data the others take) while
        they run a block between steps again, and every member once they are done (``REJOIN_PART``:
        those waiting outside are told first); then tell every reaction. ``PeerLostError`` when it
        does not form (a member lost meanwhile): the next generation is the recovery's to form."""
        self.abort()
        generation = self.generation
        layout = self._layout(generation)
        if without:
            layout = layout.shrunk({layout.members[rank] for rank in without})
        if part == store_keys.REJOIN_PART:
            announce_rejoin(self._launcher_store, self._secret, self._attempt, generation)
        rank, shares = layout.place_of(self.job_rank)
        membership = Membership(generation, rank, len(layout.members), shares, layout.data_world_size)
        try:
            self._connect(membership, {}, part)
            self._membership, self._part = membership, part
            self.prove_members()
        except MemberProofError:
            raise
        except Exception as failure:
            why = self._given_up(generation, wait=not isinstance(failure, GenerationAbandonedError))
            raise PeerLostError(f"a rank of the group vanished while a part of generation {generation} formed "
                                f"({why or failure}); in-place recovery replaces it") from failure
        self.install_diagnostics()
        _tell(self._reactions, membership)
        return membership

    def wait_outside(self) -> bool:
        """A member the survivors left out of their block (``form_part``): leave the torch group and
        wait until they ask it to rejoin (True), or until the generation is given up (False: a member
        was lost meanwhile; the next generation is the caller's to meet). When the training ends
        first (``finish``), the process ends with 0: nothing is left for it to train."""
        self.abort()
        generation = self.generation
        while True:
            if rejoin_announced(self._launcher_store, self._secret, self._attempt, generation):
                return True
            if job_finished(self._launcher_store, self._secret, self._attempt, generation + 1):
                _log.warning(f"ddpkit: the training ended while this rank ({self.job_rank}) waited to join the others "
                             "after their block: nothing is left to train")
                raise SystemExit(0)
            if self._given_up(generation) is not None:
                return False
            time.sleep(_OUTSIDE_LOOK_SECONDS)

    def form(self, generation: int, **init_options: Any) -> Membership:
        """Meet ``generation`` (``meet``), form torch's default group there (``init_options``: more
        of ``init_process_group``'s arguments), have its members prove the job secret and start the
        diagnostics. A generation given up while it forms (a member died after it was counted in, as
        a joining node killed in its takeover: ``_given_up``) is left for the one after it, which
        the launchers lay out, instead of waiting for the dead member until the group's timeout.
        Generation 0, the workers as the launcher started them, is not met first: every member has
        the group's whole timeout to arrive (a start is slow: imports, data read before ``setup``),
        and it is given up the same way (a node killed while its ranks start: the launchers shrink
        the world or a spare node takes its place)."""
        membership = self._membership if generation == 0 else self.meet(generation)
        while True:
            try:
                self._connect(membership, init_options)
                self._membership, self._part = membership, ""
                if self._met is not None and self._met[0] == membership.generation:
                    self._formed_layout = self._met
                self.prove_members()
                break
            except MemberProofError:
                raise
            except Exception as failure:
                # Gloo's connection to a member that died fails at once, before its launcher says so.
                why = self._given_up(membership.generation, wait=not isinstance(failure, GenerationAbandonedError))
                if why is None:
                    raise
                _log.warning(f"ddpkit: generation {membership.generation} of the group was given up while it formed "
                             f"({why}); forming the next one")
                self.abort()
                membership = self.meet(membership.generation + 1)
        self.install_diagnostics()
        return membership

    def _connect(self, membership: Membership, init_options: dict[str, Any], part: str = "") -> None:
        """``init_process_group`` for ``membership``, through a store whose waits end when the
        generation is given up (``ddpkit.store.forming``). Connecting is bounded by the recovery
        timeout too (a member that died once its address was out, or whose link went down, never
        connects); the group's own timeout is set once it is formed. Generation 0 (not met first)
        has the group's timeout for both."""
        generation = membership.generation
        if generation == 0:
            seconds, connect_within = self._timeout.total_seconds(), self._timeout
        else:
            seconds = recovery_timeout_seconds()
            connect_within = min(self._timeout, timedelta(seconds=seconds / _GLOO_CONNECT_WAITS))
        store = forming(self.store_of(generation, part), lambda: self._given_up(generation), seconds)
        dist.init_process_group(self._backend, store=store, rank=membership.rank, world_size=membership.world_size,
                                timeout=connect_within, **init_options)
        if connect_within < self._timeout:
            dist.distributed_c10d._set_pg_timeout(self._timeout)

    def _given_up(self, generation: int, wait: bool = False) -> str | None:
        """Why ``generation`` will not form, or None: a launcher said a node of it was lost (and laid
        the next one out), or a process already waits for the next one (a launcher replaced a member
        that died after it was counted in). ``wait``: look until the recovery timeout before None."""
        deadline = time.monotonic() + (recovery_timeout_seconds() if wait else 0.0)
        while True:
            why = node_lost(self._launcher_store, self._secret, self._attempt, generation)
            if why is not None:
                return why
            if waiting_for(self._launcher_store, self._secret, self._attempt, generation + 1) is not None:
                return f"a process waits for generation {generation + 1} already: a member of {generation} was replaced"
            if time.monotonic() > deadline:
                return None
            time.sleep(LAYOUT_LOOK_SECONDS)

    def meet(self, generation: int) -> Membership:
        """Claim this process's rank in ``generation``, count it in and wait until every member of
        the generation's layout is counted (the layout may come while it waits: a launcher that
        shrinks the world writes it seconds after the loss); return this process's membership there.
        A generation given up before it formed (``_given_up``: a joining node that died, a second node
        lost while the world shrinks, a member replaced) moves the wait on to the generation after it,
        which the launchers lay out. ``RankTakenError`` when another process holds the rank there (a spare
        node took this process's node's place while it could not be reached) or the world shrank without it."""
        seconds = recovery_timeout_seconds()
        deadline = time.monotonic() + seconds
        # Under a launcher that relays the job's news (across nodes), the last rank to count itself in
        # raises it, and the others count again when their launcher's file changes (a local read).
        news = relayed_news()
        if news is not None:
            news.changed()  # the count as it is before this rank counts in: only a change after it is news
        while True:
            arrived, layout = self._count_in(generation)
            if arrived == len(layout.members):
                announce(self._launcher_store)
            count_every, look_every = meet_periods(len(layout.members))
            next_look = time.monotonic() + look_every
            next_count = time.monotonic() + count_every
            while arrived < len(layout.members):
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError(
                        f"in-place recovery: only {arrived} of the {len(layout.members)} ranks arrived for generation "
                        f"{generation} of the group within {seconds:g} s ({DDPKIT_RECOVERY_TIMEOUT_SECONDS}); the "
                        "replacement of the lost rank did not start, or another rank failed meanwhile. The launcher's "
                        "output names the failures.")
                if now > next_look:
                    if job_finished(self._launcher_store, self._secret, self._attempt, generation):
                        _log.warning(f"ddpkit: the training ended before generation {generation} of the group formed "
                                     f"with this rank ({self.job_rank}, which was to join it): nothing is left to train")
                        raise SystemExit(0)
                    if (self._given_up(generation) is not None
                            and self._launcher_store.add(self._prefix(generation) + store_keys.ARRIVED, 0) < len(layout.members)):
                        break  # it will never form: on to the next one
                    layout = self._layout(generation)
                    count_every, look_every = meet_periods(len(layout.members))
                    next_look = now + look_every
                time.sleep(min(count_every, _NEWS_LOOK_SECONDS) if news is not None else count_every)
                fresh = news is not None and news.changed()
                if fresh:  # the last arrival, or a launcher's record: the shrink's layout may be one
                    layout = self._layout(generation)
                if fresh or news is None or time.monotonic() >= next_count:
                    next_count = time.monotonic() + count_every
                    arrived = self._launcher_store.add(self._prefix(generation) + store_keys.ARRIVED, 0)
            else:
                break
            generation += 1
        layout = self._layout(generation)
        if self.job_rank not in layout.members:
            raise RankTakenError(f"in-place recovery: the world shrank without rank {self.job_rank} in generation "
                                 f"{generation} of the group (its members: {list(layout.members)}). This process ends; "
                                 "the job goes on without it.")
        rank, shares = layout.place_of(self.job_rank)
        self._met = (generation, layout)
        return Membership(generation, rank, len(layout.members), shares, layout.data_world_size)

    def _count_in(self, generation: int) -> tuple[int, Layout]:
        """Claim this process's rank in ``generation`` and count it in: how many have arrived, and
        the generation's layout as known now. ``RankTakenError`` when another process holds the rank."""
        this_process = member_identity()
        holder = claim_rank(self._launcher_store, self._secret, self._attempt, generation, self.job_rank, this_process)
        if holder != this_process:
            raise RankTakenError(
                f"in-place recovery: rank {self.job_rank} of generation {generation} of the group is held by {holder!r}, "
                f"not by this process ({this_process}): this node was taken for lost (its launcher could not be "
                "reached), and a spare node took its ranks or the world shrank without them. This process ends; the "
                "job goes on without it.")
        announce_waiting(self._launcher_store, self._secret, self._attempt, generation, this_process)
        return self._launcher_store.add(self._prefix(generation) + store_keys.ARRIVED, 1), self._layout(generation)

    def finish(self) -> None:
        """The training ended in this generation: ranks that wait for the next one (a node that asked
        to join, or the replacement of a rank lost after the last step) will find no step to form it
        at; tell them that nothing is left to train (they end with 0). Every rank that ends says so:
        rank 0 may be the lost one."""
        if self._survivors_go_on:
            announce_finished(self._launcher_store, self._secret, self._attempt, self.generation + 1)

    def growth_requested(self) -> str | None:
        """Who waits to join the group, when a launcher asked this generation to grow (a node that
        joins after a shrink: ``launching.spare_node``); else None."""
        if not self._survivors_go_on:
            return None
        return growth_requested(self._launcher_store, self._secret, self._attempt, self.generation)

    def _layout(self, generation: int) -> Layout:
        return layout_at(self._launcher_store, self._secret, self._attempt, generation, self._started_world,
                         self._formed_layout)

    def prove_members(self) -> None:
        """With a job secret, have every member of the torch group just formed prove that it holds
        it (``ddpkit.membership.member_proofs``); without one, or on NCCL, nothing."""
        if self._secret is None or self.world_size == 1 or self._backend != "gloo":
            return
        prove_members(self._secret, self._scope(self.generation, self._part), self.rank, self.world_size)

    def _scope(self, generation: int, part: str = "") -> str:
        return generation_scope(self._attempt, generation) + (f" part {part}" if part else "")

    def _prefix(self, generation: int) -> str:
        return generation_prefix(self._secret, self._attempt, generation)



def _tell(reactions: dict[int, Callable[[], Reaction | None]], membership: Membership) -> None:
    """Call each reaction still alive with ``membership`` (``Group.on_reconfigure``); forget the dead."""
    for key, reference in list(reactions.items()):
        reaction = reference()
        if reaction is None:
            del reactions[key]
        else:
            reaction(membership)


def current_group() -> Group | None:
    """The group ``init_dist_connection`` formed (None without one, or when the process group
    was made by other code, e.g. a plain ``torch.distributed.init_process_group``)."""
    group: Group | None = PROCESS.connection.group
    if group is not None and not dist.is_initialized():
        return None  # the connection ended without ddpkit (destroy_process_group called directly)
    return group


def set_current_group(group: Group | None) -> None:
    """For ``ddpkit.membership.connection`` only: the group it formed, or None after tearing it down."""
    PROCESS.connection.group = group
