"""``ddpkit.lightning.DDPStrategy``: Lightning's ``DDPStrategy`` for ``Trainer(strategy=...)``, training
with ddpkit's parts.

    trainer = Trainer(strategy=ddpkit.lightning.DDPStrategy(), accelerator="cpu", devices=2)

It takes Lightning's ``DDPStrategy`` arguments and the seeds' ``DDPPlugin`` ones (``num_nodes``,
``sync_batchnorm``, ``ddp_comm_state``, ``ddp_comm_hook``, ``ddp_comm_wrapper``, DDP's own keyword
arguments), and changes what it does underneath, not what Lightning sees:

- the connection is ddpkit's (``init_dist_connection``: the launcher's store, the job secret, the
  peer and hang watches), with the place of ddpkit's cluster environments (``DdpkitEnvironment``);
- the model is wrapped in ddpkit's ``DistributedDataParallel`` (torch's with ``use_torch_ddp=True``),
  a comm hook registered on any device and backend, batch norm synchronised by ddpkit's;
- the barrier, broadcast, reduce and all-gather that Lightning calls (``self.log(sync_dist=True)``,
  ``ModelCheckpoint``, the fit loop) are ddpkit's collectives: a rank that fails, in
  ``training_step`` or anywhere else, is named on every other rank within seconds instead of
  leaving them waiting in a collective for the group's timeout;
- SIGTERM to ``ddpkit run`` stops every rank after the same optimizer step, saves a checkpoint and
  exits 75 (``ddpkit.lightning.preemption``), and ``ckpt_path="last"`` resumes at that batch;
- ``overlap_optimizer=True``: the optimizer the LightningModule configures steps bucket by bucket
  during the next forward (``DistributedDataParallel(overlap_optimizer=...)``, docs/ddp.md), bit for
  bit as without it. With ``Trainer(gradient_clip_val=...)`` the clip needs every gradient, so
  those steps wait for them (exact, not overlapped), and so they do when a hook of the module or a
  callback may read them (``lightning.overlap``). Under manual optimization the step asked for
  in ``training_step`` is applied by the next one's forward.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout  # Lightning's default timeout

from ddpkit.comm.collectives import all_gather_ddp_if_available, barrier, broadcast_object, sync_ddp_if_available
from ddpkit.diagnostics.failures import record_failure
from ddpkit.diagnostics.records import trace_record
from ddpkit.environments import RecoveryPolicy, detect_environment, launch_contract
from ddpkit.hooks.registration import register_ddp_comm_hook
from ddpkit.launching.worker_environment import job_secret_for_workers
from ddpkit.lightning.environment import DdpkitEnvironment
from ddpkit.lightning.layer_sync import DdpkitSyncBatchNorm
from ddpkit.lightning.overlap import ApplyTheLastStep, AwaitGradients, gradient_readers, the_one_optimizer
from ddpkit.lightning.preemption import PreemptionStop, ResumableBatches
from ddpkit.lightning.trainer_recovery import REPLACEMENT_CHECKPOINT, ReplacementLauncher, TrainerRecovery
from ddpkit.membership.connection import distributed_available, init_dist_connection
from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.parallel.step_timings import StepTimings
from ddpkit.parallel.wrapping import no_sync

__all__ = ["DDPStrategy"]

T = TypeVar("T")


class DDPStrategy(LightningDDPStrategy):
    """Lightning's ``DDPStrategy`` with ddpkit underneath (see the module's docstring).

    ``use_torch_ddp=True`` wraps with torch's DDP instead (ddpkit's connection, collectives and
    failure naming stay). ``cluster_environment``: a Lightning environment, or by default ddpkit's
    detected one. ``num_nodes`` and ``sync_batchnorm``, the seeds' ``DDPPlugin`` arguments, are
    the Trainer's in Lightning 2: ``sync_batchnorm=True`` here is ``Trainer(sync_batchnorm=True)``, and
    a ``num_nodes`` that is not the Trainer's is refused naming both."""

    def __init__(self, *args: Any, use_torch_ddp: bool = False, num_nodes: int | None = None,
                 sync_batchnorm: bool = False, overlap_optimizer: bool = False, **kwargs: Any) -> None:
        if not isinstance(overlap_optimizer, bool):
            raise TypeError(f"DDPStrategy(overlap_optimizer=...) takes True or False, got "
                            f"{type(overlap_optimizer).__name__}: pass True; the optimizer is the one your "
                            "LightningModule's configure_optimizers returns.")
        if overlap_optimizer and use_torch_ddp:
            raise ValueError("DDPStrategy(overlap_optimizer=True) needs ddpkit's DistributedDataParallel: drop "
                             "use_torch_ddp=True, or overlap_optimizer.")
        # cluster_environment: by keyword, or Lightning's third positional argument
        if kwargs.get("cluster_environment") is None and (len(args) < 3 or args[2] is None):
            kwargs["cluster_environment"] = DdpkitEnvironment()
        super().__init__(*args, **kwargs)
        self.use_torch_ddp = use_torch_ddp
        self.overlap_optimizer = overlap_optimizer
        self._sync_batchnorm_wanted = sync_batchnorm
        self._num_nodes_wanted = num_nodes
        if num_nodes is not None:
            self.num_nodes = num_nodes
        # Under ddpkit run --recovery in-place (made when connecting): a lost rank replaced in the step.
        self._recovery: TrainerRecovery | None = None

    # -- connecting ------------------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        """Lightning starts the local ranks when nothing else did (``python train.py``, ``devices=N``):
        they inherit a new job secret, as the ranks ``ddpkit run`` starts on one node do."""
        super()._configure_launcher()
        assert self.cluster_environment is not None  # set in __init__, or by the Trainer
        if not self.cluster_environment.creates_processes_externally and self.num_processes * self.num_nodes > 1:
            os.environ.update(job_secret_for_workers(self.num_nodes > 1, os.environ))
        # A replacement: its fit resumes from the survivors' state.
        if launch_contract(detect_environment()).recovery.replaces_a_lost_rank:
            self._launcher = ReplacementLauncher(self._launcher)

    def setup_distributed(self) -> None:
        """Connect through ddpkit at the place Lightning computed (``set_world_ranks``)."""
        if self._num_nodes_wanted is not None and self._num_nodes_wanted != self.num_nodes:
            raise ValueError(
                f"DDPStrategy(num_nodes={self._num_nodes_wanted}) but Trainer(num_nodes={self.num_nodes}): Lightning 2 "
                f"takes the number of nodes from the Trainer. Pass Trainer(num_nodes={self._num_nodes_wanted}) (and "
                "leave it out of the strategy).")
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        if distributed_available():
            return
        environment = detect_environment()  # read now: Lightning's own launcher sets MASTER_PORT and LOCAL_RANK
        recovery = launch_contract(environment).recovery
        if recovery.survivors_go_on and self.world_size > 1:
            self._refuse_what_recovery_cannot_carry(recovery)
            self._recovery = TrainerRecovery()
        rank = world = None
        if (environment.global_rank(), environment.world_size()) != (self.global_rank, self.world_size):
            rank, world = self.global_rank, self.world_size  # Lightning started the ranks and placed them
        # Lightning's default (torch's 30 minutes) is left to ddpkit's; a timeout the user gave is kept.
        timeout = {} if self._timeout in (None, default_pg_timeout) else {"timeout": self._timeout}
        init_dist_connection(environment, self._process_group_backend, global_rank=rank, world_size=world, **timeout)
        if self._recovery is not None and recovery.replaces_a_lost_rank:
            self._recovery.receive()

    def _refuse_what_recovery_cannot_carry(self, recovery: RecoveryPolicy) -> None:
        """What in-place recovery inside ``Trainer.fit`` does not serve, refused before connecting: a
        world that may shrink (Lightning's sampler deals each rank its share of a world of fixed
        size), and what a recovery cannot carry to a replacement."""
        if recovery.may_shrink(self.num_nodes):
            raise ValueError(
                f"ddpkit run --nnodes {recovery.min_nodes}:MAX --recovery in-place started a world of {self.num_nodes} "
                f"nodes, which shrinks to {self.num_nodes - 1} when a node is lost and no spare node takes its place; "
                "inside Trainer.fit Lightning's sampler cannot hand a lost rank's shares of the data to the others. "
                f"Start the job with --nnodes {self.num_nodes}:{self.num_nodes + 1} and a spare node (the world keeps "
                f"{self.num_nodes} nodes), or train with DDPStrategy's own loop (strategy.epochs/batches), which "
                "shrinks exactly.")
        module = self.lightning_module
        why = ("use_torch_ddp=True: recovery rebuilds ddpkit's DistributedDataParallel" if self.use_torch_ddp else
               "overlap_optimizer=True: the Trainer's recovery cannot undo a step half applied in the forward"
               if self.overlap_optimizer else
               "a comm hook's state (ddp_comm_state, e.g. PowerSGD's error feedback) does not reach a replacement"
               if self._ddp_comm_state is not None else
               "manual optimization (automatic_optimization = False): the strategy cannot train a step again"
               if module is not None and not module.automatic_optimization else None)
        if why is not None:
            raise ValueError(f"ddpkit run --recovery in-place cannot recover a rank inside Trainer.fit with {why}. "
                             "Run with --recovery fail-fast (the default) and --max-restarts N, and resume with "
                             "trainer.fit(..., ckpt_path=\"last\") and ModelCheckpoint(save_last=True).")

    # -- the model -------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer) -> None:
        if self._sync_batchnorm_wanted or isinstance(self._layer_sync, TorchSyncBatchNorm):
            self._layer_sync = DdpkitSyncBatchNorm(self.root_device)
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connector
        if trainer.state.fn == TrainerFn.FITTING and not any(isinstance(c, PreemptionStop) for c in callbacks):
            on_peer_lost = None if self._recovery is None else self._recovery.lost_between_steps
            callbacks.append(PreemptionStop(on_peer_lost=on_peer_lost))
        super().setup(trainer)
        if isinstance(self.model, DistributedDataParallel):
            if self.overlap_optimizer and trainer.state.fn == TrainerFn.FITTING:
                self.model.overlap_with(the_one_optimizer(self.optimizers))  # Lightning made it after wrapping
                readers = gradient_readers(trainer, self.lightning_module, callbacks)
                callbacks.insert(0, ApplyTheLastStep(self.model))
                if readers:
                    callbacks.insert(0, AwaitGradients(self.model, readers))
            for optimizer in self.optimizers:
                self.model.time_optimizer(optimizer)
            if self._recovery is not None and trainer.state.fn == TrainerFn.FITTING:
                self._recovery.attach(trainer, self.model, self.optimizers[0])

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Lightning's sampler arguments; while the survivors of a loss in validation run it again
        without the replacements, their part's (``TrainerRecovery.sampler_world``)."""
        world = self._recovery.sampler_world() if self._recovery is not None else None
        if world is None:
            return super().distributed_sampler_kwargs
        return {"num_replicas": world[0], "rank": world[1]}

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A file, as Lightning's; in a replacement, ``REPLACEMENT_CHECKPOINT``: the state the survivors sent."""
        if checkpoint_path == REPLACEMENT_CHECKPOINT and self._recovery is not None:
            return self._recovery.checkpoint()
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    # -- the step, trained again after a lost rank was replaced ------------------------------------

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._recovery is not None:
            self._recovery.batch_started(batch, batch_idx)
        super().on_train_batch_start(batch, batch_idx)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's; under in-place recovery a rank lost in it is replaced, and it runs again."""
        step = super().training_step
        if self._recovery is None:
            return step(*args, **kwargs)
        return self._recovery.training_step(lambda: step(*args, **kwargs))

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's; under in-place recovery a rank lost in the fit's validation loop makes it run
        again (``TrainerRecovery.validation``); after a rank was lost between steps elsewhere, this
        rank's own (the module's ``validation_step``, without the DDP module's buffer broadcast), its
        metrics local."""
        step = super().validation_step
        if self._recovery is None:
            return step(*args, **kwargs)
        assert self.lightning_module is not None  # connected before any step
        module = self.lightning_module

        def own() -> Any:
            with self.precision_plugin.val_step_context():
                return module.validation_step(*args, **kwargs)

        return self._recovery.validation_step(lambda: step(*args, **kwargs), own)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's; under in-place recovery a rank lost in it (the gradients' all-reduce, a
        synchronised batch norm's backward) is replaced, and the batch in hand trained again."""
        backward = super().backward
        if self._recovery is None:
            return backward(closure_loss, optimizer, *args, **kwargs)
        return self._recovery.backward(lambda: backward(closure_loss, optimizer, *args, **kwargs), closure_loss)

    def timings(self, last: int | None = None) -> StepTimings:
        """Where this rank's last steps went, phase by phase (``DistributedDataParallel.timings``, the
        optimizer step apart): compare them across ranks to find a slow one."""
        if not isinstance(self.model, DistributedDataParallel):
            raise RuntimeError("strategy.timings() comes from ddpkit's DistributedDataParallel, which wraps the model "
                               f"while the Trainer fits; the model is {type(self.model).__name__} now (not fitting, or "
                               "use_torch_ddp=True).")
        return self.model.timings(last)

    def process_dataloader(self, dataloader: object) -> object:
        """The training loader as ``ResumableBatches``: a run resumed from a checkpoint taken mid-epoch
        (a preemption's, or ``ModelCheckpoint``'s) skips the batches the epoch already trained."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or isinstance(dataloader, ResumableBatches):
            return dataloader
        return ResumableBatches(dataloader, lambda: _trained_in_epoch(trainer))

    def _setup_model(self, model: nn.Module) -> Any:
        if self.use_torch_ddp:
            return super()._setup_model(model)
        return DistributedDataParallel(model, **self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        """The comm hook on any device and backend (Lightning registers one on CUDA only, and drops it
        silently elsewhere)."""
        assert self.model is not None  # configure_ddp wrapped it just before
        register_ddp_comm_hook(self.model, ddp_comm_state=self._ddp_comm_state, ddp_comm_hook=self._ddp_comm_hook,
                               ddp_comm_wrapper=self._ddp_comm_wrapper)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradients accumulate locally inside (``accumulate_grad_batches``): either DDP's ``no_sync``."""
        with no_sync(self.model):
            yield

    def pre_backward(self, closure_loss: Tensor) -> None:
        if self.use_torch_ddp:
            super().pre_backward(closure_loss)  # ddpkit's DDP needs no preparation for manual backward
        elif self.overlap_optimizer and isinstance(self.model, DistributedDataParallel):
            # Under manual optimization the backward and step run inside the wrapper's forward, so the
            # last step is applied by this forward's modules, not at its end: what they did not
            # reach (a parameter unused in this step) is applied before this backward holds gradients.
            self.model.settle()

    def post_backward(self, closure_loss: Tensor) -> None:
        if self.use_torch_ddp:
            super().post_backward(closure_loss)

    def teardown(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module  # Lightning unwraps torch's DDP only
        super().teardown()

    # -- the collectives Lightning calls ---------------------------------------------------------

    # Under in-place recovery they run locally while a rank cannot take part: in a replacement until
    # its first training step (the survivors, inside their step, run none of its set-up's), and in a
    # survivor that lost a rank between steps (in a preemption round, a checkpoint's save,
    # validation) until its next training step, which recovers first (``ddpkit.lightning.trainer_recovery``).

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._collective(barrier, lambda: None)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._collective(lambda: broadcast_object(obj, src=src), lambda: obj)

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, Tensor):
            return tensor
        return self._collective(lambda: sync_ddp_if_available(tensor, group, reduce_op=reduce_op), lambda: tensor)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return self._collective(lambda: all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads),
                                lambda: torch.stack([tensor] * self.world_size))

    def _collective(self, call: Callable[[], T], local: Callable[[], T]) -> T:
        return call() if self._recovery is None else self._recovery.collective(call, local)

    def reconciliate_processes(self, trace: str) -> None:
        """The seeds' ``DDPPlugin.reconciliate_processes``: report this process's failure, given as its
        formatted traceback; the other ranks raise ``PeerFailedError`` naming it."""
        record_failure(trace_record(self.global_rank, trace))


def _trained_in_epoch(trainer: pl.Trainer) -> tuple[int, int]:
    """(epoch, batches of it whose optimizer step is done), as the fit loop counts them."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current  # a _ProcessedTracker at run time
    return trainer.current_epoch, progress.processed  # type: ignore[attr-defined]
