"""``DDPStrategy``: the Lightning DDP plugin's API, plus Fabric's conveniences, by composition.

    strategy = DDPStrategy()                       # under `ddpkit run`, torchrun, srun, mpirun ...
    strategy.setup_environment()                   # connect
    model, optimizer = strategy.setup(model, optimizer)
    loader = strategy.setup_dataloader(loader)     # DistributedSampler, set_epoch handled
    for epoch in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            strategy.backward(loss_fn(model(x), y))
            optimizer.step()
            if strategy.preempted():               # SIGTERM (or --preemption-signal) on any rank
                strategy.save_checkpoint("ckpt.pt", {...})
                strategy.exit_preempted()          # every rank exits with code 75
        strategy.save_checkpoint("ckpt.pt", {"model": model.state_dict(), "epoch": epoch})
    strategy.teardown()

With ``ddpkit run --recovery in-place`` a lost rank is replaced while the others go on; the loop
then uses the strategy's helpers, which need nothing else in any other mode:

    for epoch in strategy.epochs(epochs):
        for x, y in strategy.batches(loader):
            with strategy.step():                  # a lost rank: the step is trained again with its replacement
                ...

The strategy holds a cluster environment, a device and the wrapped model, and delegates the
work to ``ddpkit.distributed``, ``ddpkit.DistributedDataParallel`` and the hooks; it has no
class hierarchy of its own. Processes come from a launcher (``ddpkit run``), a scheduler, or the
script itself: run directly (``python train.py``) with several ``parallel_devices``, the script's
process becomes local rank 0 and starts local ranks 1..N-1 by running the same command again.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler

from ddpkit.agreement import StepAgreement
from ddpkit.collectives import barrier, broadcast_object, collective_call, sync_ddp_if_available
from ddpkit.connection import (
    destroy_dist_connection,
    distributed_available,
    init_dist_connection,
)
from ddpkit.diagnostics.failures import PeerLostError, guard, record_failure
from ddpkit.diagnostics.records import failure_record
from ddpkit.environments import ClusterEnvironment, LocalEnvironment, Recovery, detect_environment
from ddpkit.hooks.registration import register_ddp_comm_hook
from ddpkit.launching.in_script import LocalRanks, start_local_ranks
from ddpkit.launching.processes import describe_exit
from ddpkit.logs import get_logger
from ddpkit.parallel.batchnorm import SyncBatchNorm
from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.preemption import PREEMPTED_EXIT_CODE, PreemptionNotice, preemption_signals
from ddpkit.recovery import InPlaceRecovery, Progress
from ddpkit.variables import DDPKIT_READY_FILE, DDPKIT_RESTART_COUNT

__all__ = ["DDPStrategy"]

_log = get_logger("recovery")

# After teardown's barrier the other local ranks only have to disconnect and exit.
_CHILD_EXIT_SECONDS = 30.0


class DDPStrategy:
    """Multi-process data parallelism, one device per process (Lightning's ``DDPPlugin`` arguments).

    ``parallel_devices``: the devices of this node (index = local rank); default one CUDA device
    per local rank when CUDA is available, else the CPU. ``process_group_backend`` (Lightning's
    name): the torch.distributed backend; default "nccl" on CUDA devices, else the environment's
    choice or "gloo" ("gloo" on CUDA lets processes share a GPU). ``ddp_kwargs`` go to the DDP module
    (``find_unused_parameters`` defaults to False, as in Lightning); ``use_torch_ddp=True``
    wraps with torch's DistributedDataParallel instead of ddpkit's. With
    ``process_group=<group>`` among them the data-parallel group is that group: gradients are
    averaged over it, and ``barrier``, ``broadcast`` and the sampler's shards are its own.
    ``recovery``: "fail-fast" or "in-place" (``ddpkit.recovery``); by default what the launcher
    was told (``ddpkit run --recovery``), which in-place recovery needs: it hosts the store and
    the spare.

    Lightning's plugin hooks are here for plugin code that calls them (``pre_backward``,
    ``pre_dispatch``, ``post_dispatch``, ``reconciliate_processes``).
    """

    def __init__(
        self,
        parallel_devices: Sequence[torch.device] | None = None,
        num_nodes: int = 1,
        cluster_environment: ClusterEnvironment | None = None,
        sync_batchnorm: bool = False,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable[..., Any] | None = None,
        ddp_comm_wrapper: Callable[..., Any] | None = None,
        use_torch_ddp: bool = False,
        process_group_backend: str | None = None,
        recovery: str | Recovery | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        self.cluster_environment = cluster_environment if cluster_environment is not None else detect_environment()
        self.parallel_devices = list(parallel_devices) if parallel_devices is not None else None
        self.num_nodes = num_nodes
        self.sync_batchnorm = sync_batchnorm
        self.ddp_comm_state = ddp_comm_state
        self.ddp_comm_hook = ddp_comm_hook
        self.ddp_comm_wrapper = ddp_comm_wrapper
        self.use_torch_ddp = use_torch_ddp
        self.process_group_backend = process_group_backend
        self.ddp_kwargs = {"find_unused_parameters": False, **ddp_kwargs}
        self.model: nn.Module | None = None
        self._local_ranks: LocalRanks | None = None  # children started by this process (in-script launching)
        self._preemption: tuple[PreemptionNotice, StepAgreement] | None = None  # from the first preempted()
        self._recovery_wanted = None if recovery is None else Recovery.parse(
            recovery, "recovery", "or leave it out to follow ddpkit run --recovery")
        #: Where the loop is: ``epochs()`` and ``batches()`` keep it.
        self.progress = Progress()
        self._recovery: InPlaceRecovery | None = None
        self._in_step = False  # inside step(): a lost rank is its to recover from

    # -- where this process is ---------------------------------------------------------------

    @property
    def global_rank(self) -> int:
        return self.cluster_environment.global_rank()

    @property
    def local_rank(self) -> int:
        return self.cluster_environment.local_rank()

    @property
    def world_size(self) -> int:
        return self.cluster_environment.world_size()

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def restart_count(self) -> int:
        """How often the workers were started again before this start (0: the first start), from
        ``ddpkit run --max-restarts`` (``DDPKIT_RESTART_COUNT``) or torchrun
        (``TORCHELASTIC_RESTART_COUNT``). A script resumes from its checkpoint when it is above 0."""
        for variable in (DDPKIT_RESTART_COUNT, "TORCHELASTIC_RESTART_COUNT"):
            value = os.environ.get(variable, "").strip()
            if not value:
                continue
            try:
                count = int(value)
            except ValueError:
                count = -1
            if count < 0:
                raise ValueError(f"{variable}={value!r} is not a restart count (0 or more); the launcher sets it, "
                                 "so unset it if you set it yourself.")
            return count
        return 0

    @property
    def root_device(self) -> torch.device:
        if self.parallel_devices:
            return self.parallel_devices[self.local_rank]
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """How the data is sharded: one share per rank of the data-parallel group."""
        group = self.data_parallel_group
        if group is None:
            return {"num_replicas": self.world_size, "rank": self.global_rank}
        return {"num_replicas": dist.get_world_size(group), "rank": dist.get_rank(group)}

    @property
    def data_parallel_group(self) -> Any:
        """The process group gradients are averaged over: ``ddp_kwargs["process_group"]``, or
        None for the default (world) group."""
        return self.ddp_kwargs.get("process_group")

    # -- set-up --------------------------------------------------------------------------------

    def setup_environment(self) -> None:
        """Start the other local ranks if nothing else did, then connect this process to the others
        (choosing its GPU first, when it has one).

        Run directly (no launcher or scheduler) with more than one of ``parallel_devices``, or
        with ``num_nodes > 1``, this process becomes local rank 0 of its node and re-executes its
        own command for local ranks 1..N-1 (``MASTER_ADDR``, ``MASTER_PORT`` and ``NODE_RANK``
        from the environment; on one node a free port). If one of them fails, this process
        reports it and ends the job.
        """
        processes_per_node = self._processes_to_start_per_node()
        if processes_per_node:
            self._local_ranks = start_local_ranks(processes_per_node, self.num_nodes)
            self.cluster_environment = LocalEnvironment()  # re-read: this process is now local rank 0
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        backend = self.process_group_backend or ("nccl" if self.root_device.type == "cuda" else None)
        init_dist_connection(self.cluster_environment, backend)

    def _processes_to_start_per_node(self) -> int:
        """How many processes in-script launching must make on this node (this one included); 0: none."""
        if self._local_ranks is not None or self.cluster_environment.creates_processes_externally:
            return 0
        if not isinstance(self.cluster_environment, LocalEnvironment) or self.cluster_environment.world_size() > 1:
            return 0  # a user-made environment, or WORLD_SIZE set by hand: the processes exist already
        wanted = len(self.parallel_devices or ())
        if self.num_nodes > 1 and wanted == 0:
            raise ValueError(f"num_nodes={self.num_nodes} needs parallel_devices (the devices of each node), e.g. "
                             "parallel_devices=[torch.device('cpu')] * 2, or start the job with `ddpkit run`.")
        return wanted if wanted > 1 or self.num_nodes > 1 else 0

    def model_to_device(self, model: nn.Module | None = None) -> nn.Module:
        target = model if model is not None else self.model
        if target is None:
            raise ValueError("model_to_device needs a model: pass one, or call setup(model, optimizer) first.")
        return target.to(self.root_device)

    def configure_ddp(self, model: nn.Module) -> nn.Module:
        """Wrap ``model`` (on its device) for data parallelism; register the comm hook if one was given."""
        if self.sync_batchnorm:
            # torch's runs only on CUDA (with fused kernels there); ddpkit's works everywhere.
            synchronised = nn.SyncBatchNorm if self.root_device.type == "cuda" else SyncBatchNorm
            model = synchronised.convert_sync_batchnorm(model)
        if self.use_torch_ddp:
            device_ids = [self.root_device] if self.root_device.type == "cuda" else None
            wrapped: nn.Module = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **self.ddp_kwargs)
        else:
            wrapped = DistributedDataParallel(model, **self.ddp_kwargs)
        register_ddp_comm_hook(wrapped, ddp_comm_state=self.ddp_comm_state, ddp_comm_hook=self.ddp_comm_hook,
                               ddp_comm_wrapper=self.ddp_comm_wrapper)
        self.model = wrapped
        return wrapped

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Move ``model`` to this process's device and wrap it; return (model, optimizer) or the model.

        Create the optimizer before or after: the wrapped module keeps the same parameters.
        """
        recovery = self._start_recovery(optimizer)  # refuses a bad combination before connecting
        if not distributed_available():
            self.setup_environment()
        joined = None
        with guard():  # e.g. a model that does not fit on one rank's device: named on the others
            module = self.model_to_device(model)
            if recovery is not None and optimizer is not None and self._is_replacement():
                joined = recovery.join(module, optimizer)  # the survivors' state, before wrapping
            wrapped = self.configure_ddp(module)
        if recovery is not None and optimizer is not None:
            if not isinstance(wrapped, DistributedDataParallel):
                raise ValueError("in-place recovery needs ddpkit's DistributedDataParallel: drop use_torch_ddp=True, or "
                                 "use ddpkit run --recovery fail-fast.")
            recovery.attach(wrapped, optimizer, joined)
            self._tell_launcher_ready()  # a replacement: it holds the survivors' state; else it can recover
        return wrapped if optimizer is None else (wrapped, optimizer)

    def _start_recovery(self, optimizer: torch.optim.Optimizer | None) -> InPlaceRecovery | None:
        """In-place recovery's state for this process, when the job runs with it (else None)."""
        launched_in_place = getattr(self.cluster_environment, "recovery", None) is Recovery.IN_PLACE
        wanted = self._recovery_wanted or (Recovery.IN_PLACE if launched_in_place else Recovery.FAIL_FAST)
        if wanted is not Recovery.IN_PLACE or self.world_size < 2:
            return None
        if not launched_in_place:
            raise ValueError("DDPStrategy(recovery='in-place') needs the launcher's part: start the job with "
                             "`ddpkit run --recovery in-place --max-restarts N ...` (it hosts the store and a spare process).")
        if optimizer is None:
            raise ValueError("in-place recovery needs the optimizer: call setup(model, optimizer), so that its state "
                             "reaches a replacement and its steps mark what was trained.")
        if self.ddp_comm_state is not None:
            raise ValueError("in-place recovery does not carry a comm hook's state (ddp_comm_state, e.g. PowerSGD's "
                             "error feedback) to a replacement; use a stateless hook or --recovery fail-fast.")
        if self._recovery is None:
            self._recovery = InPlaceRecovery(self.progress)
        return self._recovery

    def _is_replacement(self) -> bool:
        return int(getattr(self.cluster_environment, "generation", 0)) > 0

    @staticmethod
    def _tell_launcher_ready() -> None:
        """The launcher replaces a lost rank in place only once every other rank said this."""
        path = os.environ.get(DDPKIT_READY_FILE)
        if path:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write("recovered\n")

    @property
    def recovered_in_place(self) -> bool:
        """Whether this process replaced a lost rank, or survived the loss of one (in-place recovery)."""
        return self._recovery is not None and (self._recovery.joined or self._recovery.recoveries > 0)

    def setup_dataloader(self, loader: DataLoader[Any]) -> DataLoader[Any]:
        """The same loader with a DistributedSampler, so that each rank reads its own share.

        ``set_epoch`` is called for you each time the returned loader is iterated (a new
        shuffle every epoch, the same on all ranks); set ``loader.epoch`` when resuming.
        """
        if isinstance(loader.sampler, DistributedSampler):
            return loader
        shuffle = not isinstance(loader.sampler, torch.utils.data.SequentialSampler)
        shard = self.distributed_sampler_kwargs
        sampler: DistributedSampler[Any] = DistributedSampler(
            loader.dataset, num_replicas=shard["num_replicas"], rank=shard["rank"], shuffle=shuffle)
        return _EpochDataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler,
                                num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                                pin_memory=loader.pin_memory, drop_last=loader.drop_last)

    # -- during training -------------------------------------------------------------------------

    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank of the data-parallel group. ``name`` labels the barrier in hang
        reports (``ddpkit.diagnostics.hangs``) and debug-mode mismatches: ranks at barriers of
        different names are at different places of the script."""
        if name is None:
            barrier(self.data_parallel_group)
            return
        with collective_call(f"barrier {name!r}", self.data_parallel_group):
            barrier(self.data_parallel_group)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast_object(obj, src=src, group=self.data_parallel_group)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce a tensor over the processes (mean by default); anything else is returned unchanged."""
        if not isinstance(tensor, Tensor):
            return tensor
        return sync_ddp_if_available(tensor, group=group, reduce_op=reduce_op)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block (the wrapped model's ``no_sync``)."""
        no_sync = getattr(self.model, "no_sync", None)
        with (no_sync() if callable(no_sync) else contextlib.nullcontext()):
            yield

    def join(self, shadow_step: Callable[[], object] | None = None) -> contextlib.AbstractContextManager[Any]:
        """``with strategy.join():`` around the training loop lets ranks with different numbers of
        batches finish cleanly: ddpkit's ``DistributedDataParallel.join`` (see it for
        ``shadow_step``), or torch's ``Join`` with ``use_torch_ddp=True`` (which has no
        ``shadow_step``); a plain block without a wrapped model."""
        if isinstance(self.model, DistributedDataParallel):
            return self.model.join(shadow_step)
        if isinstance(self.model, nn.parallel.DistributedDataParallel):
            if shadow_step is not None:
                raise ValueError("shadow_step needs ddpkit's DistributedDataParallel; torch's Join only shadows "
                                 "its DDP's own reductions. Drop use_torch_ddp=True, or call collectives after the block.")
            from torch.distributed.algorithms.join import Join

            return Join([self.model])
        return contextlib.nullcontext()

    def epochs(self, stop: int, start: int = 0) -> Iterator[int]:
        """``range(start, stop)``, kept in ``progress.epoch``; a replacement (in-place recovery)
        starts at the survivors' epoch instead."""
        recovery = self._recovery
        epoch = recovery.resume[0] if recovery is not None and recovery.joined else start
        while epoch < stop:
            self.progress.epoch, self.progress.batch = epoch, -1
            if recovery is not None:
                recovery.resume = max(recovery.resume, (epoch, 0))
            yield epoch
            epoch += 1

    def batches(self, loader: Iterable[Any], skip: int = 0) -> Iterator[Any]:
        """The batches of ``loader`` for the epoch in ``progress.epoch`` (its sampler's epoch set),
        from batch ``skip`` on; ``progress.batch`` is the index of the batch in hand.

        Under in-place recovery, after a lost rank was replaced, the batches since the last
        optimizer step come again (a replacement starts at the survivors' batch).
        """
        epoch = self.progress.epoch
        _set_epoch(loader, epoch)
        recovery = self._recovery
        if recovery is not None:
            if recovery.joined and recovery.resume[0] == epoch:
                skip = max(skip, recovery.resume[1])
            recovery.resume = max(recovery.resume, (epoch, skip))
        try:
            yield from self._batches_of_epoch(loader, epoch, skip, recovery)
        finally:
            if recovery is not None:
                # The loop left the epoch (every batch read, or a break): a rank lost from here
                # on (a save between epochs) is replaced at the next epoch's first batch.
                recovery.resume = max(recovery.resume, (epoch + 1, 0))

    def _batches_of_epoch(self, loader: Iterable[Any], epoch: int, skip: int,
                          recovery: InPlaceRecovery | None) -> Iterator[Any]:
        iterator = iter(loader)
        next_index = 0
        uncommitted: list[tuple[int, Any]] = []  # batches since the last optimizer step (in-place recovery)
        again: list[tuple[int, Any]] = []
        while True:
            if recovery is not None and recovery.rewind:
                recovery.rewind = False
                resume_epoch, resume_batch = recovery.resume
                if resume_epoch != epoch:
                    raise RuntimeError(
                        f"in-place recovery: the ranks continue in epoch {resume_epoch}, but this rank iterates epoch "
                        f"{epoch}. Keep collectives between epochs outside the steps, or restart from a checkpoint.")
                again = [(index, batch) for index, batch in uncommitted if index >= resume_batch]
                uncommitted = list(again)
                skip = max(skip, resume_batch)
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
                done = recovery.resume[1] if recovery.resume[0] == epoch else 0
                uncommitted = [(i, b) for i, b in uncommitted if i >= done]

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One training step (forward, backward, optimizer step) of a loop over ``batches()``.

        Under in-place recovery, when a rank is lost during the step (``PeerLostError``), this
        rank forms a new group with the lost rank's replacement and the block ends quietly:
        ``batches()`` then hands out the batches since the last optimizer step again. Otherwise
        a plain block.
        """
        self._in_step = True
        try:
            yield
        except PeerLostError:
            if self._recovery is None:
                raise
            self._recover_in_place(self._recovery)
        finally:
            self._in_step = False

    def _recover_in_place(self, recovery: InPlaceRecovery) -> None:
        recovery.recover()
        if self._preemption is not None:  # its pending all-reduce belonged to the abandoned group
            self._preemption = (self._preemption[0], StepAgreement())

    def backward(self, loss: Tensor) -> None:
        with guard():  # a failure here is published to the other ranks (ddpkit.diagnostics.failures)
            loss.backward()

    def pre_backward(self, closure_loss: Tensor, *lightning_arguments: Any) -> None:
        """Lightning's hook before ``backward(closure_loss)``; nothing to do here, so plugin code
        that calls it ports unchanged.

        Lightning's ``DDPPlugin`` called torch DDP's ``prepare_for_backward`` there, and only in
        manual optimization, where the loss does not come out of DDP's forward. Here the model
        is called directly: torch's DDP (``use_torch_ddp=True``) prepares its backward in its own
        forward, and ddpkit's when the backward's first gradient arrives, so there is nothing left
        to prepare. Lightning 1.3's further arguments (``should_accumulate``, ``optimizer``,
        ``opt_idx``) are accepted and unused.
        """

    def on_before_forward(self, model: nn.Module, *args: Any) -> tuple[Any, ...]:
        """Move the batch to this process's device."""
        return tuple(a.to(self.root_device) if isinstance(a, Tensor) else a for a in args)

    def get_model_from_plugin(self, model: nn.Module) -> nn.Module:
        """The user's module inside a DDP wrapper (or the model itself)."""
        if isinstance(model, (DistributedDataParallel, nn.parallel.DistributedDataParallel)):
            return model.module
        return model

    def pre_dispatch(self) -> None:
        """Before training starts: make sure every process is connected and ready."""
        self.barrier("pre_dispatch")

    def post_dispatch(self) -> None:
        """After training ends: wait for every process, so none tears down while others still talk."""
        self.barrier("post_dispatch")

    def reconciliate_processes(self, trace: str) -> None:
        """Report a failure of this process, given as its formatted traceback (Lightning calls this
        when a rank fails; call it in your ``except`` block if you handle the exception yourself).

        The other ranks raise ``PeerFailedError`` naming this rank and the trace's last line in
        their current or next ddpkit collective; ``ddpkit run`` names it as the root cause; local
        ranks this process started in-script are ended.
        """
        last_line = trace.strip().splitlines()[-1] if trace.strip() else "(no traceback given)"
        kind, separator, message = last_line.partition(": ")
        if not separator or " " in kind:  # not "SomeError: message"
            kind, message = "Error", last_line
        record_failure(failure_record(self.global_rank, kind, message, trace))
        if self._local_ranks is not None:  # this process started the other local ranks: end them
            self._local_ranks.terminate()

    def preempted(self) -> bool:
        """Whether the job is asked to stop (preemption): True on every rank at the same call.

        Call it once per step on every rank, after ``optimizer.step()``; when it says True, save a
        checkpoint and call ``exit_preempted()``. The first call starts catching SIGTERM and the
        signal named by ``DDPKIT_PREEMPTION_SIGNAL`` (``ddpkit run --preemption-signal USR1``
        sets it; under srun or mpirun set it yourself), so a script that never calls it keeps
        the default: SIGTERM ends it. Once any rank has received one, every rank returns True at
        the same call: at the end of the step the signal came in when steps take
        ``ddpkit.agreement.WAIT_AT_ONCE_SECONDS`` or more, else within about two rounds (a round:
        ``ddpkit.agreement.ROUND_INTERVAL_SECONDS`` of short steps). Agreeing costs an all-reduce
        of two numbers per round, which short steps read a round later instead of waiting for it
        (see ``ddpkit.agreement``). A second signal to a rank acts as if none had been caught, unless
        it follows the first within ``ddpkit.preemption.SAME_NOTICE_SECONDS`` (the same notice twice).
        """
        if self._preemption is None:
            notice = PreemptionNotice(preemption_signals())
            notice.install()
            self._preemption = (notice, StepAgreement())
        notice, agreement = self._preemption
        return agreement.decide(notice.received is not None)

    def exit_preempted(self) -> NoReturn:
        """Leave after a preemption: ``teardown()``, then exit with ``ddpkit.preemption.PREEMPTED_EXIT_CODE``
        (75, sysexits' "temporary failure"), which ``ddpkit run`` reports as "preempted" and
        never restarts; run the same command again to resume."""
        self.teardown()
        raise SystemExit(PREEMPTED_EXIT_CODE)

    # -- checkpoints and output ------------------------------------------------------------------

    def save_checkpoint(self, path: str | os.PathLike[str], state: dict[str, Any]) -> None:
        """Global rank 0 writes ``state`` atomically (temporary file, fsync, rename); all ranks wait.

        A save killed half-way leaves the previous checkpoint in place. Under in-place recovery, a
        rank lost during a save between steps is replaced like one lost in a step: the survivors
        form the next generation with its replacement, which starts at the survivors' next batch
        (the next epoch's first after an epoch's last); when the lost rank was rank 0, the lowest
        surviving rank writes the file in its place, so the save is not lost. A save inside
        ``step()`` leaves the loss to ``step()``, which recovers the same way but ends the block
        there: that save is not redone.
        """
        path = os.fspath(path)
        with guard():  # rank 0 failing to write (disk full, ...) is named on the ranks waiting below
            if self.is_global_zero:
                self._write_atomically(path, state)
        try:
            self.barrier("save_checkpoint")
        except PeerLostError:
            if self._recovery is None or self._in_step:
                raise
            self._recover_in_place(self._recovery)
            replaced = self._recovery.replaced
            if 0 in replaced and self.global_rank == min(set(range(self.world_size)) - set(replaced)):
                _log.warning(f"ddpkit: rank 0 was lost during the save of {path}; rank {self.global_rank} writes it")
                self._write_atomically(path, state)

    @staticmethod
    def _write_atomically(path: str, state: dict[str, Any]) -> None:
        """Temporary file in the same folder, fsync, rename: a reader sees the old file or the new one."""
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(prefix=".ddpkit-", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(descriptor, "wb") as handle:
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(temporary, 0o666 & ~_current_umask())  # mkstemp makes it 0600; a checkpoint is an ordinary file
            os.replace(temporary, path)
        except BaseException:
            if os.path.exists(temporary):
                os.unlink(temporary)
            raise

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any] | None:
        """The checkpoint at ``path``, or None when there is none.

        Global rank 0 decides whether it exists and tells the others, so no rank starts fresh
        while another resumes (a shared filesystem seen at different moments can disagree). In a
        process that replaced a lost rank (in-place recovery) it is None: the state came from a survivor.
        """
        path = os.fspath(path)
        if self._recovery is not None and self._recovery.joined:
            return None  # a replacement received the survivors' state, newer than any checkpoint; they are training
        exists = self.broadcast(os.path.isfile(path) if self.is_global_zero else None)
        if not exists:
            return None
        with guard():  # a rank that cannot read it is named on the others
            loaded: dict[str, Any] = torch.load(path, map_location=self.root_device, weights_only=False)
        return loaded

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.is_global_zero:
            print(*args, **kwargs)

    def teardown(self) -> None:
        """Wait for every process and disconnect (see ``destroy_dist_connection``); when this process
        started the other local ranks, wait for them to exit too and raise if one failed. The
        preemption signals get their handlers from before the first ``preempted()`` back."""
        if self._preemption is not None:
            self._preemption[0].uninstall()
            self._preemption = None
        destroy_dist_connection()
        if self._local_ranks is not None:
            failed = self._local_ranks.join(timeout=_CHILD_EXIT_SECONDS)
            self._local_ranks = None
            if failed:
                raise RuntimeError("local ranks that this process started did not end cleanly: " + ", ".join(
                    f"local rank {local_rank} {describe_exit(code)}" for local_rank, code in failed))


def _set_epoch(loader: Iterable[Any], epoch: int) -> None:
    """Give ``loader``'s sampler the epoch, so that its shuffle is the epoch's on every rank."""
    if isinstance(loader, _EpochDataLoader):
        loader.epoch = epoch
    elif isinstance(getattr(loader, "sampler", None), DistributedSampler):
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class _EpochDataLoader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader whose DistributedSampler gets ``set_epoch`` at each new iteration.

    ``epoch`` is the epoch the next iteration shuffles for; set it when resuming a run.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch = 0

    def __iter__(self) -> Any:
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return super().__iter__()

