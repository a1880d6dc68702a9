"""In-place recovery: a lost rank replaced while the others keep their processes.

Under ``ddpkit run --recovery in-place`` the launcher hosts the store, keeps a warm spare (a
process that has imported torch and ddpkit) and, when a worker is killed, hands the spare that
worker's rank. What the ranks do, with ``DDPStrategy``'s loop helpers:

    for epoch in strategy.epochs(epochs):
        for x, y in strategy.batches(loader):
            with strategy.step():
                ...forward, strategy.backward(loss), optimizer.step()...

- **Survivors.** A collective of the step fails (the killed rank closed its connections; the
  first rank to see it tells the others through the store: ``PeerLostError``; a ``torch.distributed``
  call of the script's own fails with Gloo's error, which ``step()`` reads the same way), or a spare node's
  launcher says that a node was lost (its link down: nothing was closed; ``ddpkit.membership.generations``). ``step()`` catches
  it, abandons the group and forms the next generation (``ddpkit.membership.group.Group.reconfigure``): with the
  same ranks, replacements taking the lost ones' places, or, when the world shrank, without them.
  Then ``InPlaceRecovery.recover`` runs the exchange below and ``batches()`` hands out again the
  batches after the last optimizer step; a survivor that now trains lost ranks' shares of the data
  too reads them from its loader anew, from that batch on (``ddpkit.training.data``).
- **Between steps**, a rank lost during ``DDPStrategy.save_checkpoint`` is handled the same
  way by the survivors waiting in the save (see there); the replacement starts at the next
  batch, or at the next epoch once the loop has left ``batches()``. In a block of
  ``strategy.between_steps(function)`` the survivors run ``function`` again on their own (the
  block's part of the generation, ``Group.form_part``; the replacements wait outside) and the
  replacements join at the next step boundary (``rejoin``). Any other collective between steps
  cannot be redone: the survivors fail.
- **The replacement** runs the script from the top. ``DDPStrategy.setup`` connects to the new
  generation, receives the state (``join``) before wrapping the model, and ``epochs()`` and
  ``batches()`` start where the survivors continue.
- **The exchange.** The ranks gather (is a replacement, optimizer steps taken); the survivor with
  the most steps (the lowest rank among equals) sends its state by broadcast: parameters,
  buffers as they were after its last optimizer step, optimizer state, the state of every object
  the loop tracks (``ddpkit.training.state``: schedules, the ``GradScaler``, EMA weights...), the
  position (epoch, next batch), the step count, its RNG state as of that step, and the bucket order.
  Every other rank loads it, so a survivor whose last all-reduce failed while another's completed
  also continues from the later step: no step is lost and none is applied twice. No file is read.
  The replicas are compared at the end of the next step trained (``ddpkit.training.replicas``).

The commit point is the optimizer step (``ddpkit.training.commit``): the position moves past a
batch when the optimizer has stepped on it, so with gradient accumulation the whole window is
trained again. With ``overlap_optimizer`` the step is applied bucket by bucket by the next forward:
the commit waits for it (``_unapplied``), the model keeps what each bucket's step overwrote, and a
recovery before it is applied first puts the step back (``_go_back_to_the_applied_commit``: the
parameters, the optimizer's state and hyperparameters, the tracked objects as they were when the
step was called) and trains its batch again. What a lost rank computed for itself only (its RNG stream, per-rank metrics) is
gone: the replacement takes the sender's RNG state, and ``InPlaceRecovery.recovered`` tells the
strategy's callers so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddpkit.diagnostics.failures import PeerLostError
from ddpkit.logs import get_logger
from ddpkit.membership.group import Group, Membership, current_group
from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.ready_file import tell_the_launcher
from ddpkit.store.keys import BLOCK_PART, REJOIN_PART
from ddpkit.training.agreement import GrowthWatch
from ddpkit.training.commit import OptimizerCommits
from ddpkit.training.recovery_engine import RecoveryEngine, formed
from ddpkit.training.replicas import ReplicaCheck
from ddpkit.training.resume_point import ResumePoint
from ddpkit.training.state import BufferSnapshot, TrackedState
from ddpkit.training.state_transfer import Places, gather_places, send_state

__all__ = ["BatchReadAgain", "InPlaceRecovery", "Progress"]

_log = get_logger("recovery")


@dataclass
class Progress:
    """Where the training loop is (``DDPStrategy.epochs`` / ``batches`` keep it)."""

    epoch: int = 0  # the epoch in progress
    batch: int = -1  # index, within the epoch, of the batch in hand (-1: none yet)
    steps: int = 0  # optimizer steps taken (equal on every rank; a replacement takes the survivors' count)


class InPlaceRecovery:
    """One rank's side of in-place recovery (see the module docstring). The loop (``ResumableLoop``)
    asks it where to start and tells it where training has got to; the resume point and the
    pending replay are its own."""

    def __init__(self, progress: Progress, tracked: TrackedState) -> None:
        self.progress = progress
        self.tracked = tracked  # what the loop keeps beside model and optimizer: it moves with them
        # (epoch, index of the next batch) right after the last optimizer step: where a recovery continues.
        # Where a recovery continues: the loop asks it where to start and tells it where it got to.
        self.position = ResumePoint()
        self._recoveries = 0
        self._model: DistributedDataParallel | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        # The snapshot (buffers, random state as of the last optimizer step), a replacement's arrival
        # and the next generation: the engine's, shared with Lightning's driver.
        self.engine = RecoveryEngine(torch.get_rng_state, torch.set_rng_state)
        # With overlap_optimizer: the commit before the last optimizer step while that step is not yet
        # applied (the next forward applies it), which a recovery then goes back to; and a second
        # buffer snapshot, so that the one of that commit is kept while the next is taken.
        self._unapplied: _Commit | None = None
        self._spare_buffers: BufferSnapshot | None = None
        self._growth: GrowthWatch | None = None  # in a world that shrank: whether a node waits to join
        # Whether the tracked state was checked since the start or the last recovery (``before_step``),
        # and whether this process looked for state left untracked (once: a pass over the heap).
        self._state_checked = False
        self._looked_for_untracked = False
        self._replica_check: ReplicaCheck | None = None
        # After a loss in a block between steps: the survivors run it again without the replacements,
        # which wait outside until the next step boundary (``rejoin``); what the survivors were before.
        self._outside: Membership | None = None
        # In a replacement that joined there: the blocks the survivors finished at its starting point.
        self.blocks_to_skip = 0
        # The batch in hand was read with shares this rank no longer trains (``BatchReadAgain``).
        self.batch_to_read_again = False

    @property
    def joined(self) -> bool:
        """Whether this process replaced a lost rank (``join`` ran): the loop starts at the survivors' place."""
        return self.position.joined

    @property
    def recovered(self) -> bool:
        """Whether this process replaced a lost rank or survived the loss of one."""
        return self.position.joined or self._recoveries > 0

    @property
    def replaced(self) -> list[int]:
        """The ranks of the current generation that replaced lost ones (set by each exchange)."""
        return list(self.engine.replaced)

    @property
    def applied_at(self) -> tuple[int, int] | None:
        """Where the last commit whose step is applied left the loop, while the last optimizer step
        is not applied yet (``overlap_optimizer``); None otherwise (``ResumePoint.committed``)."""
        return self._unapplied.resume if self._unapplied is not None else None

    # -- set-up --------------------------------------------------------------------------------

    def join(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """In a replacement, before its module is wrapped: receive the state of the survivors and
        load it into ``module`` and ``optimizer``; return it (``attach`` takes the bucket order)."""
        state = self.engine.receive().state
        self._load(state, module, optimizer)
        self.position.joined = True
        self.position.rewind = False  # the loop starts at the resume point (first_epoch, first_batch)
        return state

    def attach(self, model: nn.Module, commits: OptimizerCommits, replica_check: ReplicaCheck,
               joined_state: dict[str, Any] | None = None) -> None:
        """Follow the optimizer's steps (each one commits the batch in hand) and keep what a redo
        needs: the buffers and RNG state as of the last step. Then tell the launcher, through the
        ready file, that this rank can take part in a recovery (a replacement: that it holds the
        survivors' state); it replaces a lost rank in place only once every other rank has.
        ``replica_check`` runs at each step boundary and learns of each recovery (in a replacement:
        this one)."""
        if not isinstance(model, DistributedDataParallel):
            raise ValueError("in-place recovery needs ddpkit's DistributedDataParallel: drop use_torch_ddp=True, or "
                             "use ddpkit run --recovery fail-fast.")
        self._model, self._optimizer = model, commits.optimizer
        self._replica_check = replica_check
        if joined_state is not None:
            model.adopt_bucket_order(joined_state["bucket_order"], joined_state["bucket_order_may_change"])
            group = current_group()
            replica_check.recovered(formed(group.generation if group is not None else 0))
        self.engine.follow(model.module, commits, self._keep_the_commit)
        model.when_step_applied(self._applied)
        model.register_forward_pre_hook(self._refuse_a_stale_batch)
        tell_the_launcher()

    def _refuse_a_stale_batch(self, *_: Any) -> None:
        if self.batch_to_read_again:
            self.batch_to_read_again = False
            raise BatchReadAgain("the batch in hand was read before the world shrank: it is read again")

    def _keep_the_commit(self) -> None:
        progress, model = self.progress, self._model
        if model is not None and model.step_deferred:
            # Applied bucket by bucket by the next forward: until it is, a recovery goes back to the
            # commit before it. The tracked objects are as they were when the step was asked for (a
            # schedule or a scaler moves after optimizer.step()).
            engine = self.engine
            self._unapplied = _Commit(self.position.at, engine.buffers, engine.random, self.tracked.copies(model.module))
            engine.buffers = self._spare_buffers if self._spare_buffers is not None else BufferSnapshot(model.module)
        self.position.at = (progress.epoch, progress.batch + 1)
        self.engine.keep(model.module if model is not None else None)

    def _applied(self) -> None:
        """The deferred step is applied to every parameter (``overlap_optimizer``): committed."""
        if self._unapplied is not None:
            self._spare_buffers, self._unapplied = self._unapplied.buffers, None

    def _go_back_to_the_applied_commit(self) -> None:
        """Before a recovery, with ``overlap_optimizer``: abandon the step a lost rank may have left
        half applied (the model's parameters and the optimizer's state go back to before it) and
        return to the commit before it, so that its batch is trained again."""
        if self._model is not None:
            self._model.abandon_deferred_step()
        unapplied, self._unapplied = self._unapplied, None
        if unapplied is None:
            return
        self._spare_buffers, self.engine.buffers = self.engine.buffers, unapplied.buffers
        self.position.at, self.engine.random = unapplied.resume, unapplied.rng
        self.tracked.restore(unapplied.tracked)
        self.progress.steps -= 1

    def step_deferred(self) -> bool:
        """Whether the last optimizer step is still to be applied (``overlap_optimizer``)."""
        return self._model is not None and self._model.step_deferred

    def apply_deferred_step(self) -> None:
        """Apply it now (its reductions may fail: call it where a lost rank is recovered)."""
        if self._model is not None:
            self._model.settle()

    def before_step(self) -> None:
        """At the start of a step (``ResumableLoop.step``): once after the start and after each
        recovery, refuse tracked state that would not be equal on every rank after a recovery
        (``TrackedState.check_complete``; the search for untracked objects once per process)."""
        if self._state_checked:
            return
        self._state_checked = True
        look, self._looked_for_untracked = not self._looked_for_untracked, True
        self.tracked.check_complete(self._optimizer, self._model.module if self._model is not None else None,
                                    look_for_untracked=look)

    # -- after a rank was lost ---------------------------------------------------------------------

    def recover(self, block: Any = None) -> None:
        """In a survivor: form the next generation with the replacement and bring every rank to
        the latest step any rank completed. ``block``: the block between steps the loss struck in
        (``ResumableLoop.between_steps``): the survivors run it again without the replacements, which
        join at the next step boundary (``rejoin``); in a world that shrank, nobody joins."""
        self._form_next_generation(_LOST, block)

    def rejoin(self, blocks_done: int) -> None:
        """At a step boundary after a block the survivors ran without the replacements (a no-op
        otherwise): form the whole generation with them and send them the training state as it is
        now; they start here, skipping the ``blocks_done`` blocks the survivors finished since the
        boundary this rank's loop last passed (where a replacement's loop starts)."""
        before, self._outside = self._outside, None
        group, model, optimizer = current_group(), self._model, self._optimizer
        if before is None or group is None or model is None or optimizer is None:
            return
        try:
            after = group.form_part(REJOIN_PART)
            state = self._send(gather_places(False, self.progress.steps), model.module, optimizer, now=True,
                               blocks_done=blocks_done)
        except PeerLostError:  # a member lost as the whole generation formed again
            self._outside = before  # (what this rank trained before the first loss, for the next formation)
            self._form_next_generation(_LOST)
            return
        if (after.shares, after.data_world_size) != (before.shares, before.data_world_size):
            self.position.reshard = True
        model.resynchronise(state["bucket_order"], state["bucket_order_may_change"])
        if self._replica_check is not None:
            self._replica_check.recovered(formed(after.generation))
        _log.warning(f"ddpkit: rank(s) {self.engine.replaced} joined generation {after.generation} of the group at the step "
                     "boundary after the block; recovered in place")

    def at_step_boundary(self) -> None:
        """Between two optimizer steps (the loop calls it after each committed batch, on every rank):
        compare the replicas when it is time (``ddpkit.training.replicas``); in a world that shrank, agree with
        the other ranks whether a node waits to join, and when one does, form the next generation
        with it at this same boundary on every rank."""
        if self._replica_check is not None:
            try:
                self._replica_check.run()
            except PeerLostError:  # lost in the check's all-gather: at a step boundary, nothing to train again
                self.recover()
                return
        group = current_group()
        if group is None or group.membership.weight is None or self._model is None:
            self._growth = None  # the world is whole: nothing can join
            return
        if self._growth is None:
            self._growth = GrowthWatch()
        try:
            grow = self._growth.decide(group)
        except PeerLostError:  # lost in the agreement's round: at a step boundary, nothing to train again
            self._growth = None
            self.recover()
            return
        if grow:
            self._growth = None
            self._form_next_generation("a node joins")

    def _form_next_generation(self, why: str, block: Any = None) -> None:
        model, optimizer = self._model, self._optimizer
        if model is None or optimizer is None:
            raise RuntimeError("in-place recovery: the model and optimizer were never set up (DDPStrategy.setup).")
        self._go_back_to_the_applied_commit()
        group = current_group()
        if group is None:  # (Group.reconfigure refuses a group formed without in-place recovery)
            raise RuntimeError("in-place recovery: this process's group was not formed by ddpkit's connection under "
                               "`ddpkit run --recovery in-place`, so it cannot be formed again.")
        generation, before = group.generation + 1, group.membership
        _log.warning(f"ddpkit: {why}; forming generation {generation} of the group")
        if self._outside is not None:  # lost again while replacements waited outside: compare with before then
            before, self._outside = self._outside, None

        def exchange(after: Membership) -> tuple[Membership, Places, dict[str, Any] | None]:
            places = gather_places(False, self.progress.steps, block)
            places.check_same_block()
            if block is not None and places.replaced:  # the block runs again without the replacements
                return self._leave_out(group, places, before), places, None
            return after, places, self._send(places, model.module, optimizer)

        _, (after, places, state) = self.engine.next_generation(group, exchange)
        if state is None:
            model.resynchronise(*model.bucket_order())
            self._fresh_window()
            _log.warning(f"ddpkit: {block} runs again from its start without rank(s) {places.replaced}, which join at "
                         "the next step boundary")
            return
        if (after.shares, after.data_world_size) != (before.shares, before.data_world_size):
            self.position.reshard = True
            _log.warning(f"ddpkit: the group has {after.world_size} ranks now; this rank (now rank {after.rank}) "
                         f"trains the shares {list(after.shares)} of each global batch of {after.data_world_size}")
        model.resynchronise(state["bucket_order"], state["bucket_order_may_change"])
        self._fresh_window()
        if self._replica_check is not None:
            self._replica_check.recovered(formed(after.generation))
        done = "grew in place" if after.world_size > before.world_size else "recovered in place"
        _log.warning(f"ddpkit: {done}: generation {after.generation}, continuing at epoch {self.position.at[0]} "
                     f"batch {self.position.at[1]} (optimizer step {self.progress.steps})")

    def _fresh_window(self) -> None:
        """After a recovery: the redo starts a fresh accumulation window from the resume point, and
        the tracked state is checked again before the next step."""
        if self._optimizer is not None:
            self._optimizer.zero_grad(set_to_none=True)
        self.tracked.start_fresh_window()
        self.position.rewind = True
        self._recoveries += 1
        self._state_checked = False

    def _leave_out(self, group: Group, places: Places, before: Membership) -> Membership:
        """The survivors of a loss in a block between steps form the block's part of the generation
        without the replacements (which wait outside until ``rejoin``), training their shares of the
        data meanwhile."""
        self._outside, self.engine.replaced = before, places.replaced
        return group.form_part(BLOCK_PART, without=places.replaced)

    def _send(self, places: Places, module: nn.Module, optimizer: torch.optim.Optimizer, now: bool = False,
              blocks_done: int = 0) -> dict[str, Any]:
        """The sender (the survivor with the most optimizer steps) gives every rank its state: as of
        its last optimizer step, or ``now`` (at a step boundary: the buffers and random state as they
        are, since the replacements start from here)."""
        exchange = send_state(places, lambda: self._state(module, optimizer, now, blocks_done))
        self.engine.replaced = exchange.replaced
        if not exchange.sent:
            self._load(exchange.state, module, optimizer)
        elif not now:
            self.engine.restore_snapshot(module)
        return exchange.state

    def _state(self, module: nn.Module, optimizer: torch.optim.Optimizer, now: bool = False,
               blocks_done: int = 0) -> dict[str, Any]:
        model_state = module.state_dict()
        if not now:
            buffer_names = [name for name, _ in module.named_buffers()]
            for name, kept in zip(buffer_names, self.engine.buffers.kept):
                if name in model_state:
                    model_state[name] = kept  # as of the last optimizer step: the failed forward may have moved them
        order, may_change = self._model.bucket_order() if self._model is not None else ([], True)
        return {"model": model_state, "optimizer": optimizer.state_dict(), "tracked": self.tracked.state_dicts(),
                "resume": self.position.at, "steps": self.progress.steps,
                "rng": torch.get_rng_state() if now else self.engine.random, "bucket_order": order,
                "bucket_order_may_change": may_change, "blocks_done": blocks_done}

    def _load(self, state: dict[str, Any], module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        self.tracked.receive(state["tracked"], optimizer)
        self.position.at = (int(state["resume"][0]), int(state["resume"][1]))
        self.progress.steps = int(state["steps"])
        self.engine.random = state["rng"]
        torch.set_rng_state(self.engine.random)
        self.blocks_to_skip = int(state.get("blocks_done", 0))
        self.engine.keep(module, random=False)  # nothing yet in a replacement: attach() takes them after this


class BatchReadAgain(Exception):
    """Raised by the model's forward in a step whose batch was read before a recovery between steps
    changed this rank's shares of the data (a shrink in a block at the top of the loop's body): the
    step trains nothing, and the loop hands the batch out again, read with the new shares."""


@dataclass
class _Commit:
    """What a commit keeps for a redo: where the loop goes on, the buffers and the RNG state then,
    and (for one not yet applied) copies of the tracked objects' states."""

    resume: tuple[int, int]
    buffers: BufferSnapshot
    rng: torch.Tensor
    tracked: dict[str, Any]


_LOST = "a rank was lost"

