"""One rank's recovery engine under in-place recovery, driven alike by ddpkit's own loop
(``training.recovery.InPlaceRecovery``) and by Lightning's strategy
(``lightning.trainer_recovery.TrainerRecovery``).

It owns what every recovery does, whatever loop runs around it:

- **the commit**: it listens at the optimizer's commit (``training.commit``) and keeps the snapshot
  a redo starts from: the module's buffers as of the last optimizer step, and the random state
  (taken at the commit by ddpkit's loop; by Lightning's driver as a window's first batch begins,
  after the loader drew the epoch's order);
- **a replacement's arrival**: past the survivors' block between steps, the state they send;
- **the next generation**: the group formed with the launcher's next layout and the state
  exchanged in it, formed again while a member is lost before it holds the state;
- **the words** every rank uses for a recovery in the replica check.

The drivers say what the state is (ddpkit's loop: model, optimizer, tracked objects and position;
Lightning: its checkpoint) and what is trained again (the batch in hand; the window).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from ddpkit.diagnostics.failures import PeerLostError
from ddpkit.logs import get_logger
from ddpkit.membership.group import Group, Membership
from ddpkit.ready_file import tell_the_launcher
from ddpkit.training.commit import OptimizerCommits, Stage
from ddpkit.training.state import BufferSnapshot
from ddpkit.training.state_transfer import Exchange, gather_places, places_after_the_survivors_block, send_state

__all__ = ["RecoveryEngine", "formed"]

_log = get_logger("recovery")

T = TypeVar("T")


class RecoveryEngine:
    """The snapshot, a replacement's arrival and the next generation (see the module's docstring).
    ``take_random``/``put_random`` read and set the random state a redo starts from."""

    def __init__(self, take_random: Callable[[], Any], put_random: Callable[[Any], None]) -> None:
        self.buffers = BufferSnapshot()  # the module's buffers as of the last optimizer step
        self._take_random, self._put_random = take_random, put_random
        self.random: Any = take_random()  # the random state a redo starts from
        self.replaced: list[int] = []  # the ranks of the current generation that replaced lost ones

    def follow(self, module: nn.Module, commits: OptimizerCommits, committed: Callable[[], None]) -> None:
        """Keep ``module``'s buffers from now on, and run ``committed`` (the driver's part of the
        commit, which calls ``keep``) after each optimizer step, at ``Stage.COMMIT``."""
        self.buffers = BufferSnapshot(module)
        commits.after_each_step(Stage.COMMIT, committed)

    def keep(self, module: nn.Module | None, random: bool = True) -> None:
        """The snapshot as of now: ``module``'s buffers, and the random state unless ``random`` is False."""
        if module is not None:
            self.buffers.keep(module)
        if random:
            self.keep_random()

    def keep_random(self) -> None:
        self.random = self._take_random()

    def restore_snapshot(self, module: nn.Module) -> None:
        """``module``'s buffers and the random state back as the snapshot has them."""
        self.buffers.restore(module)
        self._put_random(self.random)

    def receive(self) -> Exchange:
        """In a replacement, once connected: wait past a block between steps the survivors run again
        without it (the launcher is told it waits outside), then receive the state they send."""
        places = places_after_the_survivors_block(gather_places(True, -1), lambda: tell_the_launcher(outside=True))
        exchange = send_state(places, dict)  # (a replacement never sends: the survivors hold the state)
        self.replaced = exchange.replaced
        return exchange

    def next_generation(self, group: Group, exchange: Callable[[Membership], T],
                        refuse: Callable[[Membership], None] = lambda _: None) -> tuple[Membership, T]:
        """In a survivor: form the group's next generation and run ``exchange`` in it (its first
        collectives); while a member is lost before the exchange is done, the next one again.
        ``refuse`` may raise for a generation the driver cannot serve, before any collective."""
        while True:
            after = group.reconfigure()
            refuse(after)
            try:
                return after, exchange(after)
            except PeerLostError:  # a member of the new generation lost before it held the state: the next one
                _log.warning(f"ddpkit: a rank of generation {after.generation} of the group was lost while the "
                             f"training state was sent; forming generation {after.generation + 1}")


def formed(generation: int) -> str:
    """How the replica check names a recovery, in the same words on every rank."""
    return f"the in-place recovery that formed generation {generation} of the group"
