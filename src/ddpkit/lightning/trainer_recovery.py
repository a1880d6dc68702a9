"""In-place recovery inside ``Trainer.fit``: under ``ddpkit run --recovery in-place`` a lost rank is
replaced by the launcher's warm spare while the other ranks keep their processes and their Trainer.

- **The commit point** is the optimizer step, as in ddpkit's own loop (``ddpkit.training.recovery``):
  each rank keeps its buffers as of its last step, the batches handed to ``training_step`` since
  then (the accumulation window, ``accumulate_grad_batches`` of them), and its random state as the
  window's first batch began (after the loader drew the epoch's order: the point the replacement
  reaches too).
- **The survivors** meet the loss inside the step: in ``training_step`` (a synchronised batch norm,
  a metric logged with ``sync_dist``, a collective of the user's own) or in ``backward`` (the
  gradients' all-reduce, a synchronised batch norm's). The strategy catches it there, and ``TrainerRecovery.recover``
  forms the group's next generation with the replacement, sends it Lightning's whole checkpoint
  (``dump_checkpoint``: model, optimizer, schedules, loops, callbacks, precision plugin, the
  loader's position) as of the last optimizer step, rebuilds the DDP module's synchronisation, and
  trains the window's earlier batches again; then the step goes on with the batch in hand.
- **The replacement** runs the script from the top. Its ``trainer.fit`` loads the received state as
  from a checkpoint (``ReplacementLauncher`` gives it ``ckpt_path=REPLACEMENT_CHECKPOINT``), and the
  fit loop starts at the window's first batch, reading its loader from there (``ResumableBatches``).
  Until its first ``training_step`` its Lightning collectives stay local: the survivors, inside
  their step, run none of the set-up's barriers and broadcasts. The collectives of the two sides
  pair one for one: the state's exchange, the DDP module's construction (``resynchronise`` on the
  survivors), and for every batch of the window Lightning's per-batch broadcast, the forward's and
  the backward's.

- **Validation** inside the fit: a rank lost in it makes the survivors form the next generation
  without the replacement (which waits outside until the next training step, where the whole
  generation forms again and it receives the checkpoint) and run the validation loop again from
  its start, its logged values dropped and its loader set up again for their world: the epoch's
  validation metrics are those of the run without the fault (``validation``).

What a lost rank computed for itself only is gone: the replacement takes the sender's random state
(the lost rank's own when Lightning seeded every rank alike, its default), and metrics logged in the
batches trained again count twice in the survivors' epoch means.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.states import TrainerFn

from ddpkit.diagnostics.failures import PeerLostError, failure_behind, raised_by_torch_distributed, raising
from ddpkit.lightning.loops import forget_loader, move_back, redo_batch, run_through, start_again
from ddpkit.logs import get_logger
from ddpkit.membership.group import Group, Membership, current_group
from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.parallel.wrapping import no_sync
from ddpkit.ready_file import tell_the_launcher
from ddpkit.store.keys import BLOCK_PART, REJOIN_PART
from ddpkit.training.commit import OptimizerCommits, Stage
from ddpkit.training.recovery_engine import RecoveryEngine, formed
from ddpkit.training.replicas import ReplicaCheck, check_every
from ddpkit.training.resumable_loop import release_frames
from ddpkit.training.state import TrackedState
from ddpkit.training.state_transfer import Places, exchange_state, gather_places, send_state

__all__ = ["REPLACEMENT_CHECKPOINT", "ReplacementLauncher", "TrainerRecovery", "lost_peer"]

_log = get_logger("recovery")

T = TypeVar("T")

#: The ``ckpt_path`` a replacement's ``trainer.fit`` loads: the state the survivors sent.
REPLACEMENT_CHECKPOINT = "ddpkit://in-place-recovery"
# Beside Lightning's keys in the checkpoint a survivor sends: what the replacement needs beyond it.
_EXTRA = "ddpkit_recovery"


def lost_peer(error: BaseException) -> PeerLostError | None:
    """The loss of a peer behind ``error``: ``error`` itself, or the loss a ``torch.distributed`` call
    of the user's own failed on; None for anything else. A failure a peer published instead is
    raised, named (``PeerFailedError``)."""
    own = error.__cause__ if isinstance(error, PeerLostError) else error  # (``guard`` raises the loss from it)
    if isinstance(own, RuntimeError) and raised_by_torch_distributed(own):
        failure = error if isinstance(error, PeerLostError) else failure_behind(own)
        if failure is not None and not isinstance(failure, PeerLostError):
            raise raising(failure) from error
        if failure is not None:
            _log.warning(f"ddpkit: a collective of the step's own code failed: {failure}")
        return failure
    return error if isinstance(error, PeerLostError) else None


class ReplacementLauncher(_Launcher):
    """A replacement's launcher (processes are ``ddpkit run``'s): its first ``trainer.fit`` resumes
    from the state the survivors send (``ckpt_path=REPLACEMENT_CHECKPOINT``), whatever path the
    script gives; everything else runs as the launcher it stands in for (``original``) would."""

    def __init__(self, original: _Launcher | None) -> None:
        self.original = original
        self._used = False

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        signature = inspect.signature(function)
        if (not self._used and trainer is not None and trainer.state.fn == TrainerFn.FITTING
                and "ckpt_path" in signature.parameters):
            self._used = True
            bound = signature.bind(*args, **kwargs)
            bound.arguments["ckpt_path"] = REPLACEMENT_CHECKPOINT
            args, kwargs = bound.args, bound.kwargs
        if self.original is not None:
            return self.original.launch(function, *args, trainer=trainer, **kwargs)
        return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        if self.original is not None:
            self.original.kill(signum)


class TrainerRecovery:
    """One rank's side of in-place recovery inside ``Trainer.fit`` (see the module's docstring)."""

    def __init__(self) -> None:
        #: A replacement before its first ``training_step``: Lightning's collectives stay local.
        self.joining = False
        #: Inside ``recover`` (the window trained again): a rank lost there starts the recovery over.
        self.recovering = False
        #: A rank was lost between steps (``lost_between_steps``): the next training step recovers first.
        self.lost = False
        self._received: dict[str, Any] | None = None
        self._trainer: pl.Trainer | None = None
        self._model: DistributedDataParallel | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        # The snapshot (buffers as of the last optimizer step, the random state taken as each window's
        # first batch begins: ``batch_started``), a replacement's arrival and the next generation.
        self.engine = RecoveryEngine(_collect_rng_states, _set_rng_states)
        # (batch, batch_idx) handed to training_step since the last optimizer step, the one in hand last.
        self._window: list[tuple[Any, int]] = []
        self._replica_check: ReplicaCheck | None = None
        self._in_commit = False  # inside the optimizer step's hook: the step counts as taken
        self._in_step = False  # inside training_step or backward: a lost rank is the step's to recover from
        self._in_validation = False  # inside the fit's validation loop: a lost rank is the loop's to recover from
        # After a loss in validation: the replacements that wait outside until the next training step.
        self._outside: list[int] = []

    # -- a replacement ----------------------------------------------------------------------------

    def receive(self) -> None:
        """In a replacement, once connected: the survivors' checkpoint, held for ``checkpoint()``."""
        self._received = self.engine.receive().state
        self.joining = True
        _log.warning("ddpkit: replacing a lost rank in place: received the survivors' training state; the fit "
                     "loop starts at their last optimizer step")

    def checkpoint(self) -> dict[str, Any]:
        """What ``strategy.load_checkpoint(REPLACEMENT_CHECKPOINT)`` returns: the received checkpoint."""
        if self._received is None:
            raise RuntimeError(f"{REPLACEMENT_CHECKPOINT} is the state a replacement receives from the survivors under "
                               "ddpkit run --recovery in-place; this process received none. Pass a checkpoint file.")
        return self._received

    # -- every rank -------------------------------------------------------------------------------

    def attach(self, trainer: pl.Trainer, model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> None:
        """Follow ``optimizer``'s steps (each one commits the window) and keep what a recovery starts
        from; then tell the launcher, through the ready file, that this rank can take part in one."""
        self._trainer, self._model, self._optimizer = trainer, model, optimizer
        if self._received is not None:
            extra = self._received[_EXTRA]
            model.adopt_bucket_order(extra["bucket_order"], extra["bucket_order_may_change"])
        tracked = TrackedState()  # Lightning's schedules and loops travel in its checkpoint, not compared
        self._replica_check = ReplicaCheck(check_every(), lambda: (model.module, optimizer, tracked),
                                           lambda: trainer.global_step + self._in_commit, buffers=model.broadcast_buffers)
        commits = OptimizerCommits(optimizer)  # Lightning counts the steps itself (``trainer.global_step``)
        self.engine.follow(model.module, commits, self._window_committed)
        commits.after_each_step(Stage.CHECK, self._check_replicas)
        run_through(trainer.fit_loop.epoch_loop.val_loop, self.validation)  # a rank lost in it: run again
        tell_the_launcher()

    def batch_started(self, batch: Any, batch_idx: int) -> None:
        """The fit loop hands ``batch`` to ``training_step`` next (``strategy.on_train_batch_start``)."""
        if self._received is not None:  # a replacement's first batch: the sender's random state at this point
            _set_rng_states(self._received[_EXTRA]["rng"])
            self._received = None  # (its state loaded: the memory goes)
            if self._replica_check is not None:
                self._replica_check.recovered(_formed())
        if not self._window:  # the window's first batch: the random state its training starts from
            self.engine.keep_random()
        self._window.append((batch, batch_idx))

    def lost_between_steps(self, lost: PeerLostError) -> bool:
        """A rank was lost outside a training step (the step's optimizer step is done): the survivors
        go on alone until the next training step, which recovers first, and the replacement starts
        at that batch; meanwhile Lightning's collectives stay local (a save, validation's metrics).
        True: it is taken care of (``PreemptionStop``'s ``on_peer_lost``)."""
        release_frames(lost)  # the failed collective's frames hold the group about to be abandoned
        if not self.lost:
            _log.warning(f"ddpkit: {lost}; recovering at the next training step")
        self.lost = True
        return True

    # -- the strategy's steps and collectives under in-place recovery -------------------------------

    def training_step(self, step: Callable[[], T]) -> T:
        """``step()`` (Lightning's ``training_step``), after a recovery from a rank lost since the last
        step, and again after each recovery from a rank lost in it."""
        self.joining = False  # a replacement's collectives go to the group from its first step on
        if self._outside:
            self._rejoin()
        if self.lost:
            self._recover_until_done(train_in_hand=False)
        with self._stepping():
            while True:
                try:
                    return step()
                except (PeerLostError, RuntimeError) as error:
                    self._take_loss(error)
                self._recover_until_done(train_in_hand=False)

    def backward(self, backward: Callable[[], torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
        """``backward()`` (Lightning's); after a rank lost in it, the recovery and the batch in hand
        trained again (its new loss's backward done there)."""
        try:
            with self._stepping():
                return backward()
        except (PeerLostError, RuntimeError) as error:
            self._take_loss(error)
        self._recover_until_done(train_in_hand=True)
        return loss

    def validation_step(self, step: Callable[[], T], own: Callable[[], T]) -> T:
        """``step()`` (Lightning's ``validation_step``), or ``own()`` (the module's, without the DDP
        module's collectives) once a rank was lost between steps."""
        if self._in_validation:
            return step()  # a rank lost here: the validation loop runs again (``validation``)
        if not self.lost:
            try:
                return step()
            except PeerLostError as lost:  # (the DDP module's buffer broadcast, a collective of the user's own)
                self.lost_between_steps(lost)
        return own()

    def collective(self, call: Callable[[], T], local: Callable[[], T]) -> T:
        """One of Lightning's collectives (``call``), or ``local()`` while this rank cannot take part
        with the others: a replacement before its first step, a survivor that lost a rank between
        steps. In a step a lost rank is the step's to recover from."""
        if self._in_step or self._in_validation:
            return call()
        if self.joining or self.lost:
            return local()
        try:
            return call()
        except PeerLostError as lost:
            self.lost_between_steps(lost)
            return local()

    @contextlib.contextmanager
    def _stepping(self) -> Iterator[None]:
        outer, self._in_step = self._in_step, True
        try:
            yield
        finally:
            self._in_step = outer

    def _take_loss(self, error: BaseException) -> None:
        """Return when ``error`` is the loss of a peer that this step recovers from (else raise it): not
        inside ``recover``, where a rank lost again starts the recovery over."""
        if self.recovering or lost_peer(error) is None:
            raise error
        release_frames(error)

    def _recover_until_done(self, train_in_hand: bool) -> None:
        """``recover``, again after each rank lost while the window is trained again; then the batch
        in hand trained again when ``train_in_hand`` (else the caller trains it)."""
        while True:
            try:
                self.recover()
                if train_in_hand:
                    self.train_in_hand()
                return
            except (PeerLostError, RuntimeError) as error:
                self._take_loss(error)

    def _window_committed(self) -> None:
        self._window.clear()
        self.engine.keep(self._model.module if self._model is not None else None, random=False)

    def _check_replicas(self) -> None:
        if self._replica_check is not None and not self.lost:  # after a recovery, every DDPKIT_CHECK_REPLICAS steps
            self._in_commit = True
            try:
                self._replica_check.run()
            except PeerLostError as lost:  # (the step is done: the next one recovers)
                self.lost_between_steps(lost)
            finally:
                self._in_commit = False

    def validation(self, run: Callable[[], T], loop: Any) -> T:
        """The fit's validation loop (``run``; ``loop``, Lightning's ``_EvaluationLoop``). A rank lost
        inside it: the survivors form the next generation, leave the replacements outside (they join at
        the next training step, ``_rejoin``) and run the loop again from its start, its logged values
        dropped and its loader set up again for their world (they read the replacements' rows too)."""
        if self.lost or self.joining:
            return run()  # (on its own, as before: the next training step recovers)
        self._in_validation = True
        progress = loop.batch_progress.total.state_dict()
        ran_again = False
        try:
            while True:
                try:
                    result = run()
                    break
                except (PeerLostError, RuntimeError) as error:
                    self._take_loss(error)
                self._leave_out_for_validation()
                start_again(loop, self._trainer, progress)
                ran_again = True
        finally:
            self._in_validation = False
        if ran_again:
            # Its loader dealt the rows for the survivors' part: set up for the whole world now, while
            # the survivors alone take part in the barrier of its setup (the replacements have theirs).
            forget_loader(loop)
            loop.setup_data()
        return result

    def sampler_world(self) -> tuple[int, int] | None:
        """The world and rank of the loaders Lightning sets up now: the survivors' part while they run
        validation again without the replacements (its sampler then deals them the replacements' rows
        too); None otherwise (Lightning's own: a training loader set up meanwhile, after a loss in the
        sanity check, is dealt for the whole world the replacements rejoin at its first step)."""
        group = current_group()
        if self._in_validation and self._outside and group is not None:
            return group.world_size, group.rank
        return None

    def _leave_out_for_validation(self) -> None:
        trainer, model, group = self._trainer, self._model, current_group()
        if trainer is None or model is None or group is None:
            raise RuntimeError("in-place recovery inside Trainer.fit: the strategy was not set up under ddpkit run "
                               "--recovery in-place (no model or group to recover).")
        before = group.membership
        _log.warning(f"ddpkit: a rank was lost in validation; forming generation {before.generation + 1} of the group")

        def leave_out(_: Membership) -> Places:
            places = gather_places(False, trainer.global_step, "Lightning's validation loop")
            places.check_same_block()
            group.form_part(BLOCK_PART, without=places.replaced)
            return places

        _, places = self.engine.next_generation(group, leave_out, _refuse_a_shrink(before))
        self._outside = places.replaced
        model.resynchronise(*model.bucket_order())
        _log.warning(f"ddpkit: Lightning's validation loop runs again from its start without rank(s) {places.replaced}, "
                     "which join at the next training step")

    def _rejoin(self) -> None:
        """At the first training step after a validation the survivors ran without the replacements:
        form the whole generation with them and send them Lightning's checkpoint as of this step."""
        trainer, model, group = self._trainer, self._model, current_group()
        assert trainer is not None and model is not None and group is not None  # (``_leave_out_for_validation``)
        self._outside = []
        try:
            after = group.form_part(REJOIN_PART)
            exchange = send_state(gather_places(False, trainer.global_step),
                                  lambda: self._checkpoint_to_send(trainer, model))
        except PeerLostError:  # a member lost as the whole generation formed again: the standard recovery
            self.lost = True
            return
        extra = exchange.state[_EXTRA]
        model.resynchronise(extra["bucket_order"], extra["bucket_order_may_change"])
        self.per_batch_broadcast(trainer)  # the replacement's first batch begins with it
        if self._replica_check is not None:
            self._replica_check.recovered(_formed())
        _log.warning(f"ddpkit: rank(s) {exchange.replaced} joined generation {after.generation} of the group at the "
                     "training step after validation; recovered in place")

    # -- a survivor -------------------------------------------------------------------------------

    def recover(self) -> None:
        """In a survivor, inside the step of the batch in hand: form the next generation with the
        replacement, bring every rank to the last optimizer step, and train the window's earlier
        batches again; the caller then trains the batch in hand again."""
        trainer, model, optimizer = self._trainer, self._model, self._optimizer
        group = current_group()
        if trainer is None or model is None or optimizer is None or group is None:
            raise RuntimeError("in-place recovery inside Trainer.fit: the strategy was not set up under ddpkit run "
                               "--recovery in-place (no model, optimizer or group to recover).")
        self.recovering = True
        try:
            self._recover(trainer, model, optimizer, group)
        finally:
            self.recovering = False

    def _recover(self, trainer: pl.Trainer, model: DistributedDataParallel, optimizer: torch.optim.Optimizer,
                 group: Group) -> None:
        before = group.membership
        _log.warning(f"ddpkit: a rank was lost; forming generation {before.generation + 1} of the group")
        # As of the last optimizer step: what the sender sends, and what every rank redoes from.
        self.engine.restore_snapshot(model.module)
        after, exchange = self.engine.next_generation(
            group, lambda _: exchange_state(False, trainer.global_step, lambda: self._checkpoint_to_send(trainer, model)),
            _refuse_a_shrink(before))
        behind = [rank for rank, steps in enumerate(exchange.steps) if 0 <= steps != trainer.global_step]
        if behind:
            raise RuntimeError(
                f"in-place recovery inside Trainer.fit: the surviving ranks stopped at different optimizer steps "
                f"({dict(enumerate(exchange.steps))}; -1: a replacement), and the Trainer of a rank cannot skip to "
                "another's step. Restart from the last checkpoint (ddpkit run --max-restarts N).")
        extra = exchange.state[_EXTRA]
        model.resynchronise(extra["bucket_order"], extra["bucket_order_may_change"])
        optimizer.zero_grad(set_to_none=True)
        window = list(self._window)  # kept until the step: a second loss before it trains them again too
        for batch, batch_idx in window[:-1]:
            self.per_batch_broadcast(trainer)
            with no_sync(model):
                redo_batch(trainer, optimizer, batch, batch_idx)
        self.per_batch_broadcast(trainer)
        if self._replica_check is not None:
            self._replica_check.recovered(_formed())
        self.lost = False
        _log.warning(f"ddpkit: recovered in place: generation {after.generation}, training again from optimizer step "
                     f"{trainer.global_step} (epoch {trainer.current_epoch}, {len(window) - 1} batch(es) of the "
                     "window before the one in hand)")

    def train_in_hand(self) -> None:
        """Train the batch in hand again (after ``recover``: its ``training_step`` and backward, whose
        first try failed), synchronised or not as the backward that failed was."""
        assert self._trainer is not None and self._optimizer is not None  # attach()
        batch, batch_idx = self._window[-1]
        redo_batch(self._trainer, self._optimizer, batch, batch_idx)

    def _checkpoint_to_send(self, trainer: pl.Trainer, model: DistributedDataParallel) -> dict[str, Any]:
        """Lightning's checkpoint as of the last optimizer step: the loops' counters and the loader's
        position moved back over the batches of the window trained since (the one in hand included)."""
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        move_back(checkpoint, len(self._window) - 1)
        order, may_change = model.bucket_order()
        checkpoint[_EXTRA] = {"rng": self.engine.random, "bucket_order": order, "bucket_order_may_change": may_change}
        return checkpoint

    @staticmethod
    def per_batch_broadcast(trainer: pl.Trainer) -> None:
        """Lightning's broadcast at the start of every batch (whether a rank got SIGTERM), which the
        replacement runs before each batch it trains: the survivors run it before each batch they
        train again, so that the two sides' collectives pair up."""
        broadcast = getattr(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor", None)
        if broadcast is not None and torch.distributed.is_initialized() and trainer.world_size > 1:
            broadcast()


def _refuse_a_shrink(before: Membership) -> Callable[[Membership], None]:
    """A guard for the next generation: the strategy refuses a world that may shrink before training
    (``DDPStrategy._refuse_what_recovery_cannot_carry``), so a smaller one here is a bug, named."""
    def refuse(after: Membership) -> None:
        if after.world_size != before.world_size:
            raise RuntimeError(
                f"in-place recovery inside Trainer.fit: the group has {after.world_size} ranks now, not "
                f"{before.world_size}, and Lightning's sampler cannot hand a lost rank's shares to the others. Run "
                "with a spare node, or without --nnodes MIN:MAX.")
    return refuse


def _formed() -> str:
    """How the replica check names the last recovery, in the same words on every rank."""
    group = current_group()
    return formed(group.generation if group is not None else 0)
