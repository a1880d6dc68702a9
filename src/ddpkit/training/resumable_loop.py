"""The loop a training script runs through ``DDPStrategy``: ``epochs()``, ``batches()`` and
``step()``, which know where training is (``Progress``) and, under in-place recovery
(``ddpkit.training.recovery``), turn a lost rank inside a step into a recovery and hand out again the
batches since the last optimizer step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

from ddpkit.diagnostics.failures import PeerLostError, failure_behind, raised_by_torch_distributed, raising
from ddpkit.environments import ClusterEnvironment, Recovery
from ddpkit.environments.contract import launch_contract
from ddpkit.logs import get_logger
from ddpkit.training.commit import OptimizerCommits, Stage
from ddpkit.training.data import EpochDataLoader, ShareSampler, set_epoch
from ddpkit.training.recovery import BatchReadAgain, InPlaceRecovery, Progress
from ddpkit.training.state import TrackedState

__all__ = ["BlockPlace", "ResumableLoop", "release_frames"]

_log = get_logger("recovery")

T = TypeVar("T")


class ResumableLoop:
    """``DDPStrategy``'s ``epochs()`` / ``batches()`` / ``step()``: where training is (``progress``)
    and, under in-place recovery, the replay of the batches since the last optimizer step after a
    rank was replaced. Without recovery, ``range`` and the loader's own batches."""

    def __init__(self) -> None:
        self.progress = Progress()
        self.tracked = TrackedState()  # what the loop keeps beside model and optimizer (DDPStrategy.track)
        self.recovery: InPlaceRecovery | None = None  # set by ``start_recovery``
        self._in_step = False  # inside step(): a lost rank is its to recover from
        # The last step() ended in a recovery, and no step began since: the code after the step block
        # runs before the step is trained again, where a replacement (which starts at that step) is not.
        self.step_recovered = False
        self._block: BlockPlace | None = None  # inside between_steps(): a lost rank is its to recover from
        # Where the loop last began a place a replacement can start at (a batch handed out, an epoch
        # begun, the epochs ended): the blocks begun since, whether a step ran since, and whether the
        # epoch's batches are all read (a replacement then starts at the next epoch).
        self._blocks_here = 0
        self._stepped_here = False
        self._epoch_read = False
        self._batch_in_hand = False  # a batch handed out whose step has not run yet
        self._batch_stale = False  # ... read with shares this rank no longer trains

    def start_recovery(self, environment: ClusterEnvironment, wanted: Recovery | None,
                       optimizer: torch.optim.Optimizer | None, comm_state: object | None) -> InPlaceRecovery | None:
        """This process's side of in-place recovery (made once) when the job runs with it: ``wanted``
        (``DDPStrategy(recovery=...)``), by default what the launcher told ``environment``. None
        without it, or alone; ``ValueError`` for a combination it cannot serve, before connecting."""
        launched = launch_contract(environment).recovery
        if (wanted or launched.kind) is not Recovery.IN_PLACE:
            return None
        if environment.world_size() < 2:
            return None
        if not launched.survivors_go_on:
            raise ValueError("DDPStrategy(recovery='in-place') needs the launcher's part: start the job with "
                             "`ddpkit run --recovery in-place --max-restarts N ...` (it hosts the store and a spare process).")
        if optimizer is None:
            raise ValueError("in-place recovery needs the optimizer: call setup(model, optimizer), so that its state "
                             "reaches a replacement and its steps mark what was trained.")
        if comm_state is not None:
            raise ValueError("in-place recovery does not carry a comm hook's state (ddp_comm_state, e.g. PowerSGD's "
                             "error feedback) to a replacement; use a stateless hook or --recovery fail-fast.")
        if self.recovery is None:
            self.recovery = InPlaceRecovery(self.progress, self.tracked)
        return self.recovery

    def count_steps(self, optimizer: torch.optim.Optimizer) -> OptimizerCommits:
        """Follow ``optimizer``'s steps (``ddpkit.training.commit``), counting each in ``progress.steps``
        first; the recovery and the replica check listen on what this returns."""
        commits = OptimizerCommits(optimizer)
        commits.after_each_step(Stage.COUNT, self._count_step)
        return commits

    def _count_step(self) -> None:
        self.progress.steps += 1

    def epochs(self, stop: int, start: int = 0) -> Iterator[int]:
        recovery = self.recovery
        epoch = recovery.position.first_epoch(start) if recovery is not None else start
        while epoch < stop:
            self.progress.epoch, self.progress.batch = epoch, -1
            if recovery is not None:
                recovery.position.reached(epoch, 0)
            self._mark()
            yield epoch
            epoch += 1
        self._mark()

    def _mark(self, rejoin: bool = True) -> None:
        """The loop is where a replacement can start (``_blocks_here``): ranks that waited outside a
        block join here first (``InPlaceRecovery.rejoin``)."""
        if rejoin and self.recovery is not None:
            self.recovery.rejoin(0)
        self._blocks_here, self._stepped_here, self._epoch_read, self._batch_stale = 0, False, False, False

    def _after_a_recovery_between_steps(self) -> None:
        """A recovery outside a step that changed this rank's shares of the data while a batch read
        with the old ones is in hand (before its step): the step's forward refuses it, to read it again."""
        if self.recovery is not None and self._batch_in_hand and self.recovery.position.reshard:
            self._batch_stale = True

    def batches(self, loader: Iterable[Any], skip: int = 0) -> Iterator[Any]:
        epoch = self.progress.epoch
        recovery = self.recovery
        if recovery is not None:
            skip = recovery.position.first_batch(epoch, skip)
        if recovery is not None:
            recovery.rejoin(0)  # before the loader is read: with the shares of the whole generation
        try:
            yield from self._batches_of_epoch(loader, epoch, skip, recovery)
        finally:
            self._epoch_read = True
            if recovery is not None:
                # The loop left the epoch (every batch read, or a break): a rank lost from here
                # on (a save between epochs) is replaced at the next epoch's first batch.
                recovery.position.reached(epoch + 1, 0)

    def _batches_of_epoch(self, loader: Iterable[Any], epoch: int, skip: int,
                          recovery: InPlaceRecovery | None) -> Iterator[Any]:
        iterator, next_index = _read_from(loader, epoch, skip)
        uncommitted: list[tuple[int, Any]] = []  # batches since the last optimizer step (in-place recovery)
        again: list[tuple[int, Any]] = []
        while True:
            if recovery is not None:
                recovery.rejoin(0)  # ranks that waited outside a block join before the next batch is read
            replay = recovery.position.replay_from(epoch) if recovery is not None else None
            if replay is not None and recovery is not None and recovery.position.take_reshard():
                if not (isinstance(loader, EpochDataLoader) and isinstance(loader.sampler, ShareSampler)):
                    raise RuntimeError(
                        "in-place recovery: the world shrank and this rank now trains lost ranks' shares of the data "
                        f"too, but the loader given to DDPStrategy.batches() ({type(loader).__name__}) was not sharded "
                        "by DDPStrategy.setup_dataloader, so it cannot read them. Pass the loader through "
                        "setup_dataloader, or start the job without --nnodes MIN:MAX.")
                iterator, next_index = _read_from(loader, epoch, replay)
                uncommitted, again, skip = [], [], replay
            elif replay is not None:
                again = [(index, batch) for index, batch in uncommitted if index >= replay]
                uncommitted = list(again)
                skip = max(skip, replay)
            if again:
                index, batch = again.pop(0)
            else:
                try:
                    batch = next(iterator)
                except StopIteration:
                    if recovery is not None and self._recovered_in_the_deferred_step(recovery):
                        continue  # its batch is trained again
                    return
                index, next_index = next_index, next_index + 1
                if index < skip:
                    continue
                if recovery is not None:
                    uncommitted.append((index, batch))
            self.progress.batch = index
            self._mark(rejoin=False)
            self._batch_in_hand = True
            yield batch
            if recovery is not None and uncommitted:
                done, stepped = recovery.position.committed(epoch, recovery.applied_at), recovery.position.committed(epoch)
                uncommitted = [(i, b) for i, b in uncommitted if i >= done]
                # An optimizer step was called on every batch trained so far (not those a recovery
                # hands out again after this one): a step boundary. With overlap_optimizer the last
                # step is applied by the next forward; until then its batch is kept, to be trained
                # again if a recovery abandons the step.
                if all(i < stepped for i, _ in uncommitted if i <= index):
                    recovery.at_step_boundary()

    def _recovered_in_the_deferred_step(self, recovery: InPlaceRecovery) -> bool:
        """At the end of an epoch, with ``overlap_optimizer``: the epoch's last optimizer step applied
        now, as a step (a rank lost in its reductions is recovered, and its batch trained again:
        True), so that the next epoch starts from a committed step."""
        if not recovery.step_deferred():
            return False
        with self.step():
            recovery.apply_deferred_step()
        return self.step_recovered

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if self.recovery is not None:
            self.recovery.rejoin(self._blocks_here)
            self.recovery.blocks_to_skip = 0  # a replacement's blocks to skip come before its first step
            self.recovery.batch_to_read_again = self._batch_stale  # its forward refuses it (BatchReadAgain)
            self.recovery.before_step()
        self._in_step, self._stepped_here = True, True
        self.step_recovered = False
        try:
            yield
        except BatchReadAgain:
            self.step_recovered = True  # (its rewind is the recovery's): read again with this rank's new shares
        except PeerLostError as lost:
            if self.recovery is None:
                raise
            release_frames(lost)
            self.recovery.recover()
            self.step_recovered = True
        except RuntimeError as error:
            # A collective of the user's own (torch.distributed, without ddpkit) that failed because a
            # peer went away: what ddpkit's seam makes of its own collectives' errors.
            failure = failure_behind(error) if raised_by_torch_distributed(error) else None
            if failure is None:
                raise
            if self.recovery is None or not isinstance(failure, PeerLostError):
                raise raising(failure) from error
            _log.warning(f"ddpkit: a collective of the step's own code failed: {failure}")
            release_frames(error)
            self.recovery.recover()
            self.step_recovered = True
        finally:
            self._in_step, self._batch_in_hand, self._batch_stale = False, False, False
            if self.recovery is not None:
                self.recovery.batch_to_read_again = False

    def between_steps(self, function: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T | None:
        """``function(*args, **kwargs)``; under in-place recovery, a rank lost inside it is replaced and
        ``function`` runs again from its start on the new group, by the survivors alone (the world
        shrank, or the replacements wait outside until the next step boundary). In a replacement
        that starts where the survivors had finished this block, it is not run: None."""
        recovery = self.recovery
        if recovery is None:
            return function(*args, **kwargs)
        if self._in_step or self._block is not None:
            where = "inside `with strategy.step():`" if self._in_step else f"inside {self._block}"
            raise RuntimeError(f"strategy.between_steps({_name_of(function)}) was called {where}: a lost rank is "
                               "recovered by the step (or the outer block) there. Call it between steps only.")
        if not self._stepped_here and not self._epoch_read:
            recovery.rejoin(self._blocks_here)  # where a replacement's loop comes too: it joins first
        if recovery.blocks_to_skip > 0:
            recovery.blocks_to_skip -= 1
            self._blocks_here += 1
            _log.info(f"ddpkit: {_name_of(function)} was run by the other ranks before this rank joined them: skipped")
            return None
        self._block = BlockPlace(_name_of(function), self._blocks_here, self.progress.epoch, self.progress.steps)
        self._blocks_here += 1
        try:
            while True:
                try:
                    return function(*args, **kwargs)
                except RuntimeError as error:
                    lost = _lost_peer(error)
                    if lost is None:
                        raise
                    release_frames(error)
                    recovery.recover(self._block)
                    self._after_a_recovery_between_steps()
        finally:
            self._block = None

    def recover_between_steps(self, lost: PeerLostError) -> list[int]:
        """A rank was lost outside ``step()`` (in a checkpoint save): recover as ``step()`` would and
        return the ranks that were replaced; re-raise ``lost`` when there is no recovery, or when
        the save was inside ``step()`` (which recovers itself)."""
        if self.recovery is None or self._in_step or self._block is not None:
            raise lost
        self.recovery.recover()
        self._after_a_recovery_between_steps()
        return self.recovery.replaced



@dataclasses.dataclass(frozen=True)
class BlockPlace:
    """Where a block between steps runs: its name, how many blocks began before it since the loop's
    last place a replacement can start at, the epoch and the optimizer steps taken. Every survivor
    of a loss inside it says where it was; all must say the same (``InPlaceRecovery``)."""

    name: str
    index: int
    epoch: int
    steps: int

    def __str__(self) -> str:
        return f"the block between steps {self.name!r} (after optimizer step {self.steps}, in epoch {self.epoch})"


def _name_of(function: Callable[..., Any]) -> str:
    return getattr(function, "__qualname__", None) or getattr(function, "__name__", None) or repr(function)


def _lost_peer(error: RuntimeError) -> PeerLostError | None:
    """The loss of a peer behind ``error``: ddpkit's collectives raise ``PeerLostError``; a
    ``torch.distributed`` call of the user's own fails with Gloo's error, read the same way as in
    ``step()``. A failure a peer published is raised, named."""
    if isinstance(error, PeerLostError):
        return error
    failure = failure_behind(error) if raised_by_torch_distributed(error) else None
    if failure is None:
        return None
    if not isinstance(failure, PeerLostError):
        raise raising(failure) from error
    _log.warning(f"ddpkit: a collective of the block's own code failed: {failure}")
    return failure


def release_frames(error: BaseException) -> None:
    """Clear the local variables of the finished frames in ``error``'s tracebacks (and its causes'):
    the failed collective's frames hold the group that is about to be abandoned, which must be
    freed for its connections to close (``Group.abort``), while the exception is still alive."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__  # type: ignore[assignment]


def _read_from(loader: Iterable[Any], epoch: int, batch: int) -> tuple[Iterator[Any], int]:
    """An iterator over ``loader``'s batches of ``epoch``, and the index of the first it gives:
    ``batch`` when the loader's sampler can start there (``ddpkit.training.data.shard``'s), else 0 (the
    caller skips the batches before). The epoch is set for every pass, the first of the epoch or
    a re-read after a shrink: an ``EpochDataLoader`` counts its passes, and a second pass in the
    same epoch would otherwise shuffle as the next epoch."""
    set_epoch(loader, epoch)
    if batch > 0 and isinstance(loader, EpochDataLoader) and loader.start_at(epoch, batch):
        return iter(loader), batch
    return iter(loader), 0
