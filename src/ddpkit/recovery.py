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
  launcher says that a node was lost (its link down: nothing was closed; ``ddpkit.generations``). ``step()`` catches
  it, abandons the group and forms the next generation (``ddpkit.group.Group.reconfigure``): with the
  same ranks, replacements taking the lost ones' places, or, when the world shrank, without them.
  Then ``InPlaceRecovery.recover`` runs the exchange below and ``batches()`` hands out again the
  batches after the last optimizer step; a survivor that now trains lost ranks' shares of the data
  too reads them from its loader anew, from that batch on (``ddpkit.data``).
- **Between steps**, a rank lost during ``DDPStrategy.save_checkpoint`` is handled the same
  way by the survivors waiting in the save (see there); the replacement starts at the next
  batch, or at the next epoch once the loop has left ``batches()``. Any other collective
  between steps cannot be redone: the survivors fail.
- **The replacement** runs the script from the top. ``DDPStrategy.setup`` connects to the new
  generation, receives the state (``join``) before wrapping the model, and ``epochs()`` and
  ``batches()`` start where the survivors continue.
- **The exchange.** The ranks gather (is a replacement, optimizer steps taken); the survivor with
  the most steps (the lowest rank among equals) sends its state by broadcast: parameters,
  buffers as they were after its last optimizer step, optimizer state, the state of every object
  the loop tracks (``ddpkit.training_state``: schedules, the ``GradScaler``, EMA weights...), the
  position (epoch, next batch), the step count, its RNG state as of that step, and the bucket order.
  Every other rank loads it, so a survivor whose last all-reduce failed while another's completed
  also continues from the later step: no step is lost and none is applied twice. No file is read.
  The replicas are compared at the end of the next step trained (``ddpkit.replicas``).

The commit point is the optimizer step (``register_step_post_hook``): the position moves past a
batch when the optimizer has stepped on it, so with gradient accumulation the whole window is
trained again. What a lost rank computed for itself only (its RNG stream, per-rank metrics) is
gone: the replacement takes the sender's RNG state, and ``step()``'s callers see
``recovered_in_place`` to know it.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import time
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddpkit.agreement import StepAgreement
from ddpkit.collective_call import collective_call
from ddpkit.collectives import all_gather_object, broadcast_object
from ddpkit.data import EpochDataLoader, ShareSampler, set_epoch
from ddpkit.diagnostics.failures import PeerLostError, failure_behind, raised_by_torch_distributed, raising
from ddpkit.diagnostics.waits import run_collective
from ddpkit.environments import ClusterEnvironment, Recovery
from ddpkit.group import Group, current_group
from ddpkit.logs import get_logger
from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.primitives import communication_device
from ddpkit.replicas import ReplicaCheck
from ddpkit.training_state import TrackedState
from ddpkit.variables import DDPKIT_READY_FILE

__all__ = ["InPlaceRecovery", "Progress", "ResumableLoop"]

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
        self._resume = (0, 0)
        # Set by ``recover``: the loop hands out the batches from ``_resume`` again instead of reading on.
        self._rewind = False
        # Set by ``recover`` when this rank's shares of the data changed (the world shrank): the loop
        # reads the loader anew from ``_resume`` instead of handing out the batches it kept.
        self._reshard = False
        self._joined = False
        self._recoveries = 0
        self._replaced: list[int] = []
        self._model: DistributedDataParallel | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._buffers: list[torch.Tensor] = []
        self._rng = torch.get_rng_state()
        self._growth: _GrowthWatch | None = None  # in a world that shrank: whether a node waits to join
        # Whether the tracked state was checked since the start or the last recovery (``before_step``),
        # and whether this process looked for state left untracked (once: a pass over the heap).
        self._state_checked = False
        self._looked_for_untracked = False
        self._replica_check: ReplicaCheck | None = None

    @property
    def joined(self) -> bool:
        """Whether this process replaced a lost rank (``join`` ran): the loop starts at the survivors' place."""
        return self._joined

    @property
    def recovered(self) -> bool:
        """Whether this process replaced a lost rank or survived the loss of one."""
        return self._joined or self._recoveries > 0

    @property
    def replaced(self) -> list[int]:
        """The ranks of the current generation that replaced lost ones (set by each exchange)."""
        return list(self._replaced)

    # -- where the loop is (``ResumableLoop``) --------------------------------------------------------

    def first_epoch(self, start: int) -> int:
        """The epoch the loop starts at: the survivors' in a replacement, else ``start``."""
        return self._resume[0] if self._joined else start

    def first_batch(self, epoch: int, skip: int) -> int:
        """The batch ``epoch``'s loop starts at: the survivors' in a replacement's first epoch."""
        if self._joined and self._resume[0] == epoch:
            skip = max(skip, self._resume[1])
        self.reached(epoch, skip)
        return skip

    def reached(self, epoch: int, batch: int) -> None:
        """The loop is at ``batch`` of ``epoch`` (or past the epoch: the next one's batch 0) with
        nothing trained since the last optimizer step: a rank lost from here on is replaced there."""
        self._resume = max(self._resume, (epoch, batch))

    def replay_from(self, epoch: int) -> int | None:
        """After a recovery: the batch of ``epoch`` to hand out again from (once); None otherwise.
        ``RuntimeError`` when the ranks continue in another epoch (a collective between epochs)."""
        if not self._rewind:
            return None
        self._rewind = False
        resume_epoch, resume_batch = self._resume
        if resume_epoch != epoch:
            raise RuntimeError(
                f"in-place recovery: the ranks continue in epoch {resume_epoch}, but this rank iterates epoch "
                f"{epoch}. Keep collectives between epochs outside the steps, or restart from a checkpoint.")
        return resume_batch

    def take_reshard(self) -> bool:
        """Whether this rank's shares of the data changed in the last recovery (asked once, after
        ``replay_from``): the batches kept since the last optimizer step are not its batches now."""
        reshard, self._reshard = self._reshard, False
        return reshard

    def committed(self, epoch: int) -> int:
        """How many of ``epoch``'s batches an optimizer step has committed (0 in a later epoch's terms)."""
        return self._resume[1] if self._resume[0] == epoch else 0

    # -- set-up --------------------------------------------------------------------------------

    def join(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """In a replacement, before its module is wrapped: receive the state of the survivors and
        load it into ``module`` and ``optimizer``; return it (``attach`` takes the bucket order)."""
        state = self._exchange(module, optimizer, replacement=True)
        self._joined = True
        self._rewind = False  # the loop starts at the resume point (first_epoch, first_batch)
        return state

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, replica_check: ReplicaCheck,
               joined_state: dict[str, Any] | None = None) -> None:
        """Follow ``optimizer``'s steps (each one commits the batch in hand) and keep what a redo
        needs: the buffers and RNG state as of the last step. Then tell the launcher, through the
        ready file, that this rank can take part in a recovery (a replacement: that it holds the
        survivors' state); it replaces a lost rank in place only once every other rank has.
        ``replica_check`` runs at each step boundary and learns of each recovery (in a replacement:
        this one)."""
        if not isinstance(model, DistributedDataParallel):
            raise ValueError("in-place recovery needs ddpkit's DistributedDataParallel: drop use_torch_ddp=True, or "
                             "use ddpkit run --recovery fail-fast.")
        self._model, self._optimizer = model, optimizer
        self._buffers = [buffer.detach().clone() for buffer in model.module.buffers()]
        self._replica_check = replica_check
        if joined_state is not None:
            model.adopt_bucket_order(joined_state["bucket_order"], joined_state["bucket_order_may_change"])
            group = current_group()
            replica_check.recovered(_formed(group.generation if group is not None else 0))
        optimizer.register_step_post_hook(self._commit)
        ready_file = os.environ.get(DDPKIT_READY_FILE)
        if ready_file:
            with open(ready_file, "w", encoding="utf-8") as handle:
                handle.write("ready\n")

    def _commit(self, *_: Any) -> None:
        progress = self.progress
        self._resume = (progress.epoch, progress.batch + 1)
        if self._model is not None:
            self._keep_buffers(self._model.module)
        self._rng = torch.get_rng_state()

    def _keep_buffers(self, module: nn.Module) -> None:
        """Copy ``module``'s buffers as they are now into the snapshot a redo starts from."""
        for kept, buffer in zip(self._buffers, module.buffers()):
            kept.copy_(buffer)

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

    def recover(self) -> None:
        """In a survivor: form the next generation with the replacement and bring every rank to
        the latest step any rank completed."""
        self._form_next_generation(_LOST)

    def at_step_boundary(self) -> None:
        """Between two optimizer steps (the loop calls it after each committed batch, on every rank):
        compare the replicas when it is time (``ddpkit.replicas``); in a world that shrank, agree with
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
            self._growth = _GrowthWatch()
        try:
            grow = self._growth.decide(group)
        except PeerLostError:  # lost in the agreement's round: at a step boundary, nothing to train again
            self._growth = None
            self.recover()
            return
        if grow:
            self._growth = None
            self._form_next_generation("a node joins")

    def _form_next_generation(self, why: str) -> None:
        model, optimizer = self._model, self._optimizer
        if model is None or optimizer is None:
            raise RuntimeError("in-place recovery: the model and optimizer were never set up (DDPStrategy.setup).")
        group = current_group()
        if group is None:  # (Group.reconfigure refuses a group formed without in-place recovery)
            raise RuntimeError("in-place recovery: this process's group was not formed by ddpkit's connection under "
                               "`ddpkit run --recovery in-place`, so it cannot be formed again.")
        generation, before = group.generation + 1, group.membership
        _log.warning(f"ddpkit: {why}; forming generation {generation} of the group")
        while True:
            after = group.reconfigure()
            try:
                state = self._exchange(model.module, optimizer, replacement=False)
                break
            except PeerLostError:  # a member of the new generation lost before it held the state: the next one
                _log.warning(f"ddpkit: a rank of generation {after.generation} of the group was lost while the "
                             f"training state was sent; forming generation {after.generation + 1}")
        if (after.shares, after.data_world_size) != (before.shares, before.data_world_size):
            self._reshard = True
            _log.warning(f"ddpkit: the group has {after.world_size} ranks now; this rank (now rank {after.rank}) "
                         f"trains the shares {list(after.shares)} of each global batch of {after.data_world_size}")
        model.resynchronise(state["bucket_order"], state["bucket_order_may_change"])
        optimizer.zero_grad(set_to_none=True)  # the redo starts a fresh accumulation window
        self.tracked.start_fresh_window()
        self._rewind = True
        self._recoveries += 1
        self._state_checked = False
        if self._replica_check is not None:
            self._replica_check.recovered(_formed(after.generation))
        done = "grew in place" if after.world_size > before.world_size else "recovered in place"
        _log.warning(f"ddpkit: {done}: generation {after.generation}, continuing at epoch {self._resume[0]} "
                     f"batch {self._resume[1]} (optimizer step {self.progress.steps})")

    def _exchange(self, module: nn.Module, optimizer: torch.optim.Optimizer, replacement: bool) -> dict[str, Any]:
        """Pick the sender (the survivor with the most optimizer steps) and give every rank its state."""
        ranks = all_gather_object((replacement, self.progress.steps))
        candidates = [rank for rank, (is_replacement, _) in enumerate(ranks) if not is_replacement]
        self._replaced = [rank for rank, (is_replacement, _) in enumerate(ranks) if is_replacement]
        if not candidates:
            raise RuntimeError("in-place recovery: every rank of the new generation is a replacement; no rank holds "
                               "the training state. Restart from a checkpoint (ddpkit run --max-restarts).")
        sender = max(candidates, key=lambda rank: (ranks[rank][1], -rank))
        mine = torch.distributed.get_rank() == sender
        state: dict[str, Any] = _broadcast_with_tensors_apart(self._state(module, optimizer) if mine else None, sender)
        if mine:
            self._restore_snapshot(module)
        else:
            self._load(state, module, optimizer)
        return state

    def _state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        model_state = module.state_dict()
        buffer_names = [name for name, _ in module.named_buffers()]
        for name, kept in zip(buffer_names, self._buffers):
            if name in model_state:
                model_state[name] = kept  # as of the last optimizer step: the failed forward may have moved them
        order, may_change = self._model.bucket_order() if self._model is not None else ([], True)
        return {"model": model_state, "optimizer": optimizer.state_dict(), "tracked": self.tracked.state_dicts(),
                "resume": self._resume, "steps": self.progress.steps, "rng": self._rng, "bucket_order": order,
                "bucket_order_may_change": may_change}

    def _restore_snapshot(self, module: nn.Module) -> None:
        with torch.no_grad():
            for kept, buffer in zip(self._buffers, module.buffers()):
                buffer.copy_(kept)
        torch.set_rng_state(self._rng)

    def _load(self, state: dict[str, Any], module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        self.tracked.receive(state["tracked"], optimizer)
        self._resume = (int(state["resume"][0]), int(state["resume"][1]))
        self.progress.steps = int(state["steps"])
        self._rng = state["rng"]
        torch.set_rng_state(self._rng)
        self._keep_buffers(module)  # nothing yet in a replacement: attach() takes them after this


_LOST = "a rank was lost"


def _formed(generation: int) -> str:
    """How the replica check names a recovery, in the same words on every rank."""
    return f"the in-place recovery that formed generation {generation} of the group"


class _GrowthWatch:
    """In a world that shrank: whether a node waits to join, decided by every rank at the same step
    boundary (a ``StepAgreement``, whose rounds cost a tiny all-reduce now and then). Only the group's
    rank 0 reads the store, at most every ``_LOOK_SECONDS``."""

    _LOOK_SECONDS = 0.5

    def __init__(self) -> None:
        self._agreement = StepAgreement()
        self._requested = False
        self._next_look = 0.0

    def decide(self, group: Group) -> bool:
        if group.rank == 0 and not self._requested and time.monotonic() >= self._next_look:
            self._next_look = time.monotonic() + self._LOOK_SECONDS
            if (who := group.growth_requested()) is not None:
                self._requested = True
                _log.warning(f"ddpkit: {who}; the group grows at the next step boundary every rank agrees on")
        return self._agreement.decide(self._requested)


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

    def start_recovery(self, environment: ClusterEnvironment, wanted: Recovery | None,
                       optimizer: torch.optim.Optimizer | None, comm_state: object | None) -> InPlaceRecovery | None:
        """This process's side of in-place recovery (made once) when the job runs with it: ``wanted``
        (``DDPStrategy(recovery=...)``), by default what the launcher told ``environment``. None
        without it, or alone; ``ValueError`` for a combination it cannot serve, before connecting."""
        launched_in_place = getattr(environment, "recovery", None) is Recovery.IN_PLACE
        if (wanted or (Recovery.IN_PLACE if launched_in_place else None)) is not Recovery.IN_PLACE:
            return None
        if environment.world_size() < 2:
            return None
        if not launched_in_place:
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

    def count_steps(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer``'s steps in ``progress.steps`` (before any other step hook of ddpkit's)."""
        optimizer.register_step_post_hook(self._count_step)

    def _count_step(self, *_: Any) -> None:
        self.progress.steps += 1

    def epochs(self, stop: int, start: int = 0) -> Iterator[int]:
        recovery = self.recovery
        epoch = recovery.first_epoch(start) if recovery is not None else start
        while epoch < stop:
            self.progress.epoch, self.progress.batch = epoch, -1
            if recovery is not None:
                recovery.reached(epoch, 0)
            yield epoch
            epoch += 1

    def batches(self, loader: Iterable[Any], skip: int = 0) -> Iterator[Any]:
        epoch = self.progress.epoch
        set_epoch(loader, epoch)
        recovery = self.recovery
        if recovery is not None:
            skip = recovery.first_batch(epoch, skip)
        try:
            yield from self._batches_of_epoch(loader, epoch, skip, recovery)
        finally:
            if recovery is not None:
                # The loop left the epoch (every batch read, or a break): a rank lost from here
                # on (a save between epochs) is replaced at the next epoch's first batch.
                recovery.reached(epoch + 1, 0)

    def _batches_of_epoch(self, loader: Iterable[Any], epoch: int, skip: int,
                          recovery: InPlaceRecovery | None) -> Iterator[Any]:
        iterator, next_index = _read_from(loader, epoch, skip)
        uncommitted: list[tuple[int, Any]] = []  # batches since the last optimizer step (in-place recovery)
        again: list[tuple[int, Any]] = []
        while True:
            replay = recovery.replay_from(epoch) if recovery is not None else None
            if replay is not None and recovery is not None and recovery.take_reshard():
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
                    return
                index, next_index = next_index, next_index + 1
                if index < skip:
                    continue
                if recovery is not None:
                    uncommitted.append((index, batch))
            self.progress.batch = index
            yield batch
            if recovery is not None and uncommitted:
                done = recovery.committed(epoch)
                uncommitted = [(i, b) for i, b in uncommitted if i >= done]
                if not uncommitted:  # an optimizer step committed every batch so far: a step boundary
                    recovery.at_step_boundary()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if self.recovery is not None:
            self.recovery.before_step()
        self._in_step = True
        self.step_recovered = False
        try:
            yield
        except PeerLostError as lost:
            if self.recovery is None:
                raise
            _release_frames(lost)
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
            _release_frames(error)
            self.recovery.recover()
            self.step_recovered = True
        finally:
            self._in_step = False

    def recover_between_steps(self, lost: PeerLostError) -> list[int]:
        """A rank was lost outside ``step()`` (in a checkpoint save): recover as ``step()`` would and
        return the ranks that were replaced; re-raise ``lost`` when there is no recovery, or when
        the save was inside ``step()`` (which recovers itself)."""
        if self.recovery is None or self._in_step:
            raise lost
        self.recovery.recover()
        return self.recovery.replaced


def _release_frames(error: BaseException) -> None:
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
    ``batch`` when the loader's sampler can start there (``ddpkit.data.shard``'s), else 0 (the
    caller skips the batches before)."""
    if batch > 0 and isinstance(loader, EpochDataLoader) and loader.start_at(epoch, batch):
        return iter(loader), batch
    return iter(loader), 0


# -- the state transfer --------------------------------------------------------------------------

# Every tensor starts at a multiple of this many bytes in the flat buffer, so that a slice of it
# can be viewed as the tensor's dtype again.
_ALIGNMENT = 16


def _broadcast_with_tensors_apart(obj: Any, src: int) -> Any:
    """``broadcast_object`` for an object of large tensors (a model's and an optimizer's state):
    the rest is pickled and sent as usual, the tensors travel as the bytes of one flat buffer,
    so neither side pickles or unpickles their data (a large part of a recovery's time otherwise).
    The buffer lives where the group's collectives run (a GPU on NCCL, which moves only CUDA
    tensors). Each receiver gets tensors of its own, each on the device type the sender held it
    on (a GPU tensor on this rank's GPU, the RNG state on the CPU); ``src`` (a global rank) gets ``obj`` back."""
    mine = dist.get_rank() == src
    tensors: list[Tensor] = []
    outline = broadcast_object((_set_tensors_apart(obj, tensors),
                                [(t.shape, t.dtype, t.device.type != "cpu") for t in tensors]) if mine else None, src=src)
    skeleton, layout = outline
    device = communication_device(None)
    flat = _pack(tensors, device) if mine else torch.empty(_packed_size(layout), dtype=torch.uint8, device=device)
    with collective_call("in-place recovery: the training state", None, flat):  # a loss here: PeerLostError
        run_collective(dist.broadcast, flat, src=src)
    return obj if mine else _put_tensors_back(skeleton, _unpack(flat, layout))


def _set_tensors_apart(obj: Any, tensors: list[Tensor]) -> bytes:
    """``obj`` pickled with each tensor replaced by its index in ``tensors`` (appended there)."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)

    def persistent_id(value: Any) -> int | None:
        if isinstance(value, Tensor):
            tensors.append(value.detach())
            return len(tensors) - 1
        return None

    pickler.persistent_id = persistent_id  # type: ignore[method-assign]
    pickler.dump(obj)
    return buffer.getvalue()


def _put_tensors_back(skeleton: bytes, tensors: list[Tensor]) -> Any:
    """The object ``_set_tensors_apart`` pickled, with ``tensors`` in their places."""
    unpickler = pickle.Unpickler(io.BytesIO(skeleton))
    unpickler.persistent_load = lambda index: tensors[index]  # type: ignore[method-assign]
    return unpickler.load()


def _bytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return shape.numel() * dtype.itemsize


def _span(shape: torch.Size, dtype: torch.dtype) -> int:
    """The bytes a tensor takes in the flat buffer: its own, up to the next aligned offset."""
    return -(-_bytes(shape, dtype) // _ALIGNMENT) * _ALIGNMENT


# Each tensor of the state as the flat buffer lays it out: shape, dtype, and whether the sender
# held it on an accelerator (the receiver puts it on its own) rather than on the CPU.
_Layout = list[tuple[torch.Size, torch.dtype, bool]]


def _packed_size(layout: _Layout) -> int:
    return sum(_span(shape, dtype) for shape, dtype, _ in layout)


def _pack(tensors: list[Tensor], device: torch.device) -> Tensor:
    """The bytes of ``tensors``, one after the other (each at an aligned offset), on ``device``."""
    flat = torch.empty(_packed_size([(t.shape, t.dtype, False) for t in tensors]), dtype=torch.uint8, device=device)
    offset = 0
    for tensor in tensors:
        size = _bytes(tensor.shape, tensor.dtype)
        if size:
            flat[offset : offset + size].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        offset += _span(tensor.shape, tensor.dtype)
    return flat


def _unpack(flat: Tensor, layout: _Layout) -> list[Tensor]:
    """The tensors ``_pack`` laid out in ``flat``, each a tensor of its own (not a view of ``flat``),
    on this rank's GPU when the sender's was on one (and this rank has one), else on the CPU."""
    accelerator = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tensors = []
    offset = 0
    for shape, dtype, on_accelerator in layout:
        piece = flat[offset : offset + _bytes(shape, dtype)].view(dtype).reshape(shape)
        target = accelerator if on_accelerator else torch.device("cpu")
        tensors.append(piece.to(target, copy=True))
        offset += _span(shape, dtype)
    return tensors
