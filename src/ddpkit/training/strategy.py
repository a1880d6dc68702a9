"""``DDPStrategy``: the Lightning DDP plugin's API, plus Fabric's conveniences, by composition
(the class's ``Example::`` shows a loop). Under ``ddpkit run --recovery in-place`` a lost rank is
replaced while the others go on, where the loop uses the strategy's ``epochs``, ``batches`` and
``step()`` (which need nothing else in any other mode); a plain loop with ``preempted()`` and
``save_checkpoint`` stops every rank at the same step under SIGTERM.

The strategy holds a cluster environment, a device and the wrapped model, and delegates the
work to ``ddpkit.distributed``, ``ddpkit.DistributedDataParallel`` and the hooks, the training
loop's methods to its ``ResumableLoop`` (and through it to the recovery engine) and the
checkpoint files to ``ddpkit.training.checkpoints``: one class with the seeds' API, each method short.
Processes come from a launcher (``ddpkit run``), a scheduler, or the script itself: run directly
(``python train.py``) with several ``parallel_devices``, the script's process becomes local rank 0
and starts local ranks 1..N-1 by running the same command again.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader

from ddpkit.comm.collective_call import collective_call
from ddpkit.comm.collectives import barrier, broadcast_object, sync_ddp_if_available
from ddpkit.diagnostics.failures import PeerLostError, guard, record_failure
from ddpkit.diagnostics.records import trace_record
from ddpkit.environments import (
    ClusterEnvironment,
    LocalEnvironment,
    Recovery,
    detect_environment,
)
from ddpkit.environments.contract import launch_contract
from ddpkit.environments.preemption import PREEMPTED_EXIT_CODE
from ddpkit.hooks.registration import register_ddp_comm_hook
from ddpkit.launching.in_script import LocalRanks, processes_to_start, start_local_ranks
from ddpkit.logs import get_logger
from ddpkit.membership.connection import (
    destroy_dist_connection,
    distributed_available,
    init_dist_connection,
)
from ddpkit.membership.group import current_group
from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.parallel.step_timings import StepTimings
from ddpkit.parallel.wrapping import join, no_sync, wrap
from ddpkit.training.agreement import PreemptionAgreement
from ddpkit.training.checkpoints import DATA_WORLD_KEY, read_checkpoint, take_data_world, write_atomically
from ddpkit.training.commit import Stage
from ddpkit.training.data import shard
from ddpkit.training.replicas import ReplicaCheck, check_every
from ddpkit.training.resumable_loop import ResumableLoop
from ddpkit.training.state import Stateful, TrackedState

__all__ = ["DDPStrategy"]

_log = get_logger("recovery")

T = TypeVar("T")

# After teardown's barrier the other local ranks only have to disconnect and exit.
_CHILD_EXIT_SECONDS = 30.0


class DDPStrategy:
    """Multi-process data parallelism, one device per process (Lightning's ``DDPPlugin`` arguments).

    ``parallel_devices``: this node's devices by local rank (default: a CUDA device per local rank,
    else the CPU). ``process_group_backend``: "nccl" on CUDA devices by default, else the
    environment's or "gloo". ``ddp_kwargs`` go to the DDP module (``find_unused_parameters=False``
    by default; ``process_group=<group>`` makes that group the data-parallel one: gradients,
    ``barrier``, ``broadcast`` and the sampler's shards); ``use_torch_ddp=True`` wraps with torch's.
    ``recovery``: ``Recovery`` or its value, by default what ``ddpkit run --recovery`` said.
    ``overlap_optimizer=True``: the optimizer given to ``setup`` steps bucket by bucket during the
    next forward (``DistributedDataParallel(overlap_optimizer=...)``, docs/ddp.md).

    Example::

        >>> import torch, ddpkit
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> strategy = ddpkit.DDPStrategy()  # under ddpkit run, torchrun or srun; here one process
        >>> model = torch.nn.Linear(4, 1)
        >>> model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> loader = strategy.setup_dataloader(DataLoader(TensorDataset(torch.ones(8, 4), torch.zeros(8, 1)), batch_size=4))
        >>> for epoch in strategy.epochs(2):  # epochs, batches and step: where a recovery resumes
        ...     for x, y in strategy.batches(loader):
        ...         with strategy.step():
        ...             optimizer.zero_grad()
        ...             strategy.backward(torch.nn.functional.mse_loss(model(x), y))
        ...             optimizer.step()
        >>> strategy.world_size, strategy.global_rank
        (1, 0)
        >>> strategy.teardown()
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
        overlap_optimizer: bool = False,
        **ddp_kwargs: Any,
    ) -> None:
        if not isinstance(overlap_optimizer, bool):
            raise TypeError(f"DDPStrategy(overlap_optimizer=...) takes True or False, got "
                            f"{type(overlap_optimizer).__name__}: pass True, and the optimizer to setup(model, optimizer).")
        if overlap_optimizer and use_torch_ddp:
            raise ValueError("DDPStrategy(overlap_optimizer=True) needs ddpkit's DistributedDataParallel: drop "
                             "use_torch_ddp=True, or overlap_optimizer.")
        self.cluster_environment = cluster_environment if cluster_environment is not None else detect_environment()
        self.parallel_devices = list(parallel_devices) if parallel_devices is not None else None
        self.num_nodes = num_nodes
        self.sync_batchnorm = sync_batchnorm
        self.ddp_comm_state = ddp_comm_state
        self.ddp_comm_hook = ddp_comm_hook
        self.ddp_comm_wrapper = ddp_comm_wrapper
        self.use_torch_ddp = use_torch_ddp
        self.overlap_optimizer = overlap_optimizer
        self.process_group_backend = process_group_backend
        self.ddp_kwargs = {"find_unused_parameters": False, **ddp_kwargs}
        self.model: nn.Module | None = None
        self._local_ranks: LocalRanks | None = None  # children started by this process (in-script launching)
        self._preemption: PreemptionAgreement | None = None  # from the first preempted()
        self._recovery_wanted = None if recovery is None else Recovery.parse(
            recovery, "recovery", "or leave it out to follow ddpkit run --recovery")
        self._loop = ResumableLoop()
        self.progress = self._loop.progress  # where the loop is: epochs() and batches() keep it

    # -- where this process is ---------------------------------------------------------------

    @property
    def global_rank(self) -> int:
        """This process's rank in the group: the environment's, or the group's since the world shrank
        (``ddpkit.membership.group``; the launcher's ``RANK`` stays as it started the process)."""
        group = current_group()
        return group.rank if group is not None else self.cluster_environment.global_rank()

    @property
    def local_rank(self) -> int:
        return self.cluster_environment.local_rank()

    @property
    def world_size(self) -> int:
        """How many processes train: the environment's, or the group's since the world shrank."""
        group = current_group()
        return group.world_size if group is not None else self.cluster_environment.world_size()

    @property
    def data_world_size(self) -> int:
        """How many shares each global batch is cut in: the world the job started with. It is
        ``world_size`` unless the world shrank (``ddpkit run --nnodes MIN:MAX --recovery in-place``),
        where a survivor trains lost ranks' shares too and the global batch stays the same."""
        group = current_group()
        return group.membership.data_world_size if group is not None else self.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def restart_count(self) -> int:
        """Starts of the workers before this one (``ddpkit run --max-restarts``, torchrun): resume when above 0."""
        return launch_contract(self.cluster_environment).recovery.restart_count

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
        """Start the other local ranks if nothing else did (``launching.in_script``: run directly with
        several ``parallel_devices`` or nodes, this process is local rank 0), choose the GPU, connect."""
        processes_per_node = 0 if self._local_ranks is not None else processes_to_start(
            self.cluster_environment, len(self.parallel_devices or ()), self.num_nodes)
        if processes_per_node:
            self._local_ranks = start_local_ranks(processes_per_node, self.num_nodes)
            self.cluster_environment = LocalEnvironment()  # re-read: this process is now local rank 0
        backend = self._backend()
        if self.root_device.type == "cuda":
            if backend == "nccl" and not self.parallel_devices:
                _refuse_a_shared_gpu(self.local_rank, self.root_device)
            torch.cuda.set_device(self.root_device)
        init_dist_connection(self.cluster_environment, backend)

    def _backend(self) -> str | None:
        """``process_group_backend``, else the launcher's choice (``ddpkit run --backend gloo`` lets
        ranks share a GPU), else NCCL for a CUDA root device; None leaves it to the connection."""
        chosen = launch_contract(self.cluster_environment).backend
        return self.process_group_backend or chosen or ("nccl" if self.root_device.type == "cuda" else None)

    def configure_ddp(self, model: nn.Module, overlap_optimizer: torch.optim.Optimizer | None = None) -> nn.Module:
        """Wrap ``model`` (on its device) for data parallelism; register the comm hook if one was given.
        ``overlap_optimizer``: ``DistributedDataParallel``'s (``setup`` passes it with ``overlap_optimizer=True``)."""
        kwargs = self.ddp_kwargs if overlap_optimizer is None else {**self.ddp_kwargs, "overlap_optimizer": overlap_optimizer}
        self.model = wrap(model, self.root_device, kwargs, self.sync_batchnorm, self.use_torch_ddp)
        register_ddp_comm_hook(self.model, ddp_comm_state=self.ddp_comm_state, ddp_comm_hook=self.ddp_comm_hook,
                               ddp_comm_wrapper=self.ddp_comm_wrapper)
        return self.model

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
              scheduler: Stateful | Sequence[Stateful] | None = None, scaler: Stateful | None = None) -> Any:
        """``model`` on this process's device, wrapped; (model, optimizer) when given one (made before
        or after: the wrapped module keeps the same parameters). ``scheduler`` (a learning-rate
        schedule of ``optimizer``, or several) and ``scaler`` (``torch.amp.GradScaler``) are tracked
        as ``track("scheduler", ...)`` (``"scheduler0"``, ``"scheduler1"``... for several) and
        ``track("scaler", ...)`` would: under in-place recovery their state moves with the model's."""
        if self.overlap_optimizer and optimizer is None:
            raise ValueError("DDPStrategy(overlap_optimizer=True) steps the optimizer during the next forward, so it "
                             "needs it: call setup(model, optimizer).")
        recovery = self._loop.start_recovery(self.cluster_environment, self._recovery_wanted, optimizer,
                                             self.ddp_comm_state)  # refuses a bad combination before connecting
        schedules = [] if scheduler is None else [scheduler] if isinstance(scheduler, Stateful) else list(scheduler)
        for index, schedule in enumerate(schedules):
            self.track("scheduler" if len(schedules) == 1 else f"scheduler{index}", schedule)
        if scaler is not None:
            self.track("scaler", scaler)
        if not distributed_available():
            self.setup_environment()
        joined = None
        with guard():  # e.g. a model that does not fit on one rank's device: named on the others
            module = self.model_to_device(model)
            replacing = launch_contract(self.cluster_environment).recovery.replaces_a_lost_rank
            if recovery is not None and optimizer is not None and replacing:
                joined = recovery.join(module, optimizer)  # a replacement: the survivors' state, before wrapping
            wrapped = self.configure_ddp(module, optimizer if self.overlap_optimizer else None)
        if optimizer is not None:
            commits = self._loop.count_steps(optimizer)
            if isinstance(wrapped, DistributedDataParallel):
                wrapped.time_optimizer(optimizer)
            check = ReplicaCheck(check_every(), self._replicated(wrapped, optimizer), lambda: self.progress.steps,
                                 buffers=bool(getattr(wrapped, "broadcast_buffers", False)) and not self.use_torch_ddp,
                                 settle=wrapped.settle if isinstance(wrapped, DistributedDataParallel) else None)
            if recovery is not None:
                recovery.attach(wrapped, commits, check, joined)  # it runs the check at each step boundary
            elif check_every():
                commits.after_each_step(Stage.CHECK, check.run)
        return wrapped if optimizer is None else (wrapped, optimizer)

    def _replicated(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer
                    ) -> Callable[[], tuple[nn.Module, torch.optim.Optimizer, TrackedState]]:
        """What the replica check compares (``ddpkit.training.replicas``): the module, the optimizer and what is tracked."""
        module = getattr(wrapped, "module", wrapped)
        return lambda: (module, optimizer, self._loop.tracked)

    def setup_dataloader(self, loader: DataLoader[Any]) -> DataLoader[Any]:
        """``loader`` sharded over the data-parallel group, a new shuffle each pass (``ddpkit.training.data.shard``)."""
        follows = current_group() if self.data_parallel_group is None else None
        if follows is None:
            kwargs = self.distributed_sampler_kwargs
            return shard(loader, kwargs["num_replicas"], kwargs["rank"])
        membership = follows.membership  # in a world that shrank, a replacement trains several shares
        return shard(loader, membership.data_world_size, membership.shares[0], group=follows, shares=membership.shares)

    # -- during training -------------------------------------------------------------------------

    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank of the data-parallel group; ``name`` labels it in hang reports and
        debug-mode mismatches."""
        with collective_call(f"barrier {name!r}", self.data_parallel_group) if name else contextlib.nullcontext():
            barrier(self.data_parallel_group)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast_object(obj, src=src, group=self.data_parallel_group)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce a tensor over the processes (mean by default); anything else is returned unchanged."""
        if not isinstance(tensor, Tensor):
            return tensor
        return sync_ddp_if_available(tensor, group=group, reduce_op=reduce_op)

    def block_backward_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Accumulate gradients locally inside the block (the wrapped model's ``no_sync``)."""
        return no_sync(self.model)

    def join(self, shadow_step: Callable[[], object] | None = None) -> contextlib.AbstractContextManager[Any]:
        """Around the loop, ranks with different numbers of batches finish cleanly: the DDP module's
        ``join`` (torch's ``Join``, without ``shadow_step``, with ``use_torch_ddp=True``)."""
        return join(self.model, shadow_step)

    def reconciliate_processes(self, trace: str) -> None:
        """Report this process's failure, given as its formatted traceback: the other ranks raise
        ``PeerFailedError`` naming it, ``ddpkit run`` names it, local ranks started in-script end."""
        record_failure(trace_record(self.global_rank, trace))
        if self._local_ranks is not None:  # this process started the other local ranks: end them
            self._local_ranks.terminate()

    # -- the training loop: over ``ResumableLoop`` (where a recovery resumes) -------------------------

    def epochs(self, stop: int, start: int = 0) -> Iterator[int]:
        """``range(start, stop)`` in ``progress.epoch``; a replacement starts at the survivors' epoch."""
        return self._loop.epochs(stop, start)

    def batches(self, loader: Iterable[Any], skip: int = 0) -> Iterator[Any]:
        """``loader``'s batches of ``progress.epoch`` from ``skip`` on (``progress.batch``: the one in
        hand); after an in-place recovery those since the last optimizer step come again."""
        return self._loop.batches(loader, skip)

    def step(self) -> contextlib.AbstractContextManager[None]:
        """One training step; under in-place recovery a rank lost in it is replaced and the block
        ends quietly (``ddpkit.training.resumable_loop.ResumableLoop``)."""
        return self._loop.step()

    def between_steps(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """Run ``function(*args, **kwargs)`` between two steps (an evaluation, a metric's reduction, a
        collective of your own) and return what it returns. Under ``ddpkit run --recovery in-place``
        a rank lost inside it is recovered instead of restarting every worker: ``function`` runs
        again from its start on the new group, by the surviving ranks, which read the lost ranks'
        shares of a loader made by ``setup_dataloader`` too; the replacement (or a spare node's
        ranks) joins at the next step boundary, and a world that shrank stays so. Anywhere between
        steps: after an epoch's batches, before or after the step in the loop's body. In a
        replacement that starts where the other ranks had already run it, it is not run: None."""
        return self._loop.between_steps(function, args, kwargs)

    def backward(self, loss: Tensor) -> None:
        with guard():  # a failure here is published to the other ranks (ddpkit.diagnostics.failures)
            loss.backward()

    def preempted(self) -> bool:
        """Whether the job is asked to stop: True on every rank at the same call once any rank got
        SIGTERM or DDPKIT_PREEMPTION_SIGNAL (caught from the first call on). Call it once per step;
        when True, save and ``exit_preempted()``. When it answers: ``ddpkit.training.agreement``."""
        if self._preemption is None:
            self._preemption = PreemptionAgreement()
        return self._preemption.decide()

    def exit_preempted(self) -> NoReturn:
        """``teardown()``, then exit 75 (``PREEMPTED_EXIT_CODE``): ``ddpkit run`` never restarts it; run again to resume."""
        self.teardown()
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def track(self, name: str, obj: T) -> T:
        """Keep ``obj`` (anything with ``state_dict()`` and ``load_state_dict()``: EMA weights, a
        counter, a stateful data loader, a schedule made after ``setup``) under ``name`` as part of
        the training state, and return it. Under ``ddpkit run --recovery in-place`` its state moves
        to a replacement and is loaded on every rank that did not send it, as the model's; the
        replica check compares it. Track the same names on every rank, before the training loop.
        In a replacement, a state the survivors sent for ``name`` is loaded into ``obj`` here."""
        self._loop.tracked.track(name, obj)
        return obj

    def timings(self, last: int | None = None) -> StepTimings:
        """Where this rank's last steps went, phase by phase: the DDP module's ``timings`` (between,
        forward, backward, communication), with the optimizer step and the rest of ``between`` (the
        data loader, the loop's code) apart. A slow rank has the longest forward or backward (or
        data), and the others wait for it in communication: compare them across ranks."""
        if not isinstance(self.model, DistributedDataParallel):
            raise RuntimeError(f"strategy.timings() comes from ddpkit's DistributedDataParallel; the model is "
                               f"{type(self.model).__name__}. Call setup(model, optimizer) first, without use_torch_ddp=True.")
        return self.model.timings(last)

    @property
    def recovered_in_place(self) -> bool:
        """Whether this process replaced a lost rank, or survived the loss of one (in-place recovery)."""
        return self._loop.recovery is not None and self._loop.recovery.recovered

    # -- Lightning's plugin hooks, which plugin code calls around its training step ------------------

    def model_to_device(self, model: nn.Module | None = None) -> nn.Module:
        """``model`` (by default the strategy's) on this process's device."""
        target = model if model is not None else self.model
        if target is None:
            raise ValueError("model_to_device needs a model: pass one, or call setup(model, optimizer) first.")
        return target.to(self.root_device)

    def pre_dispatch(self) -> None:
        """Before training starts: make sure every process is connected and ready."""
        self.barrier("pre_dispatch")

    def post_dispatch(self) -> None:
        """After training ends: wait for every process, so none tears down while others still talk."""
        self.barrier("post_dispatch")

    def on_before_forward(self, model: nn.Module, *args: Any) -> tuple[Any, ...]:
        """Move the batch to this process's device."""
        return tuple(a.to(self.root_device) if isinstance(a, Tensor) else a for a in args)

    def pre_backward(self, closure_loss: Tensor, *lightning_arguments: Any) -> None:
        """Lightning's hook before ``backward``: nothing to do. Lightning prepared torch DDP there for a
        loss that bypassed DDP's forward; here torch's DDP prepares in its forward and ddpkit's at
        the backward's first gradient. Lightning 1.3's further arguments are accepted."""

    def get_model_from_plugin(self, model: nn.Module) -> nn.Module:
        """The user's module inside a DDP wrapper (or the model itself)."""
        if isinstance(model, (DistributedDataParallel, nn.parallel.DistributedDataParallel)):
            return model.module
        return model

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.is_global_zero:
            print(*args, **kwargs)

    # -- checkpoints and output ------------------------------------------------------------------

    def save_checkpoint(self, path: str | os.PathLike[str], state: dict[str, Any]) -> None:
        """Rank 0 writes ``state`` atomically (``ddpkit.training.checkpoints``); all ranks wait. A rank lost in
        a save between steps is replaced in place, and when it was rank 0 the lowest survivor
        writes the file (the new rank 0, when the world shrank); a save inside ``step()`` is
        ``step()``'s to recover, and is not redone. Called after a step that was recovered (the code
        after ``with strategy.step():``, before that step is trained again), it is skipped: the
        state is the one of the step before, saved then if it was to be saved, and a replacement,
        which starts at the step trained again, does not call it."""
        if self._loop.step_recovered:
            _log.info(f"ddpkit: the save of {os.fspath(path)} after a step that is trained again is skipped")
            return
        path = os.fspath(path)
        was_zero = self.is_global_zero
        state = {**state, DATA_WORLD_KEY: self.data_world_size}  # what a resume checks (``load_checkpoint``)
        with guard():  # rank 0 failing to write (disk full, ...) is named on the ranks waiting below
            if was_zero:
                write_atomically(path, state)
        try:
            self.barrier("save_checkpoint")
        except PeerLostError as lost:
            replaced = self._loop.recover_between_steps(lost)
            # The writer was lost: rank 0 replaced, or (the world shrank) renumbered away.
            writer_lost = 0 in replaced or (self.is_global_zero and not was_zero)
            if writer_lost and self.global_rank == min(set(range(self.world_size)) - set(replaced)):
                _log.warning(f"ddpkit: rank 0 was lost during the save of {path}; rank {self.global_rank} writes it")
                write_atomically(path, state)

    def load_checkpoint(self, path: str | os.PathLike[str], *, world_may_differ: bool = False) -> dict[str, Any] | None:
        """The checkpoint at ``path``, or None: rank 0 decides whether it exists, for every rank. None
        in a replacement (in-place recovery): its state came from a survivor. ``ValueError`` on every
        rank when ``save_checkpoint`` wrote it in a job whose global batch had another number of
        shares (``data_world_size``) than this one's: the resumed run would train other batches (a
        ``--nnodes 1:2`` job run again on the one node that came up); ``world_may_differ=True``
        continues with this job's global batch all the same."""
        path = os.fspath(path)
        if self._loop.recovery is not None and self._loop.recovery.joined:
            return None  # a replacement received the survivors' state, newer than any checkpoint; they are training
        exists = self.broadcast(os.path.isfile(path) if self.is_global_zero else None)
        if not exists:
            return None
        with guard():  # a rank that cannot read it is named on the others
            state = read_checkpoint(path, self.root_device)
        return take_data_world(path, state, self.data_world_size, world_may_differ)

    def teardown(self) -> None:
        """Wait for every process and disconnect; wait for local ranks started in-script (raising if one
        failed); give the preemption signals their handlers back."""
        if self._preemption is not None:
            self._preemption.close()
            self._preemption = None
        destroy_dist_connection()
        local_ranks, self._local_ranks = self._local_ranks, None
        if local_ranks is not None:
            local_ranks.join(timeout=_CHILD_EXIT_SECONDS)


def _refuse_a_shared_gpu(local_rank: int, device: torch.device) -> None:
    """NCCL refuses two ranks on one GPU, at the first collective and in its own words ("invalid
    usage"): a local rank beyond this node's GPUs (``device`` is then another rank's) is refused
    before it connects, naming both and how to fix it."""
    gpus = torch.cuda.device_count()
    if local_rank >= gpus:
        raise ValueError(
            f"local rank {local_rank} has no GPU of its own: this node has {gpus} GPU(s), so it would share "
            f"cuda:{device.index} with local rank {device.index}, and NCCL needs one GPU per rank. Start at most "
            f"{gpus} process(es) per node (ddpkit run --nproc-per-node {gpus}), or let ranks share a GPU over Gloo "
            "(ddpkit run --backend gloo, or DDPStrategy(process_group_backend=\"gloo\")).")
