"""A Lightning script as users write it, for tests/test_lightning.py: a LightningModule with batch
norm, AdamW and a per-step learning-rate schedule, ``accumulate_grad_batches``, gradient clipping,
``self.log(..., sync_dist=True)`` in training and validation, ``ModelCheckpoint(save_last=True)``,
Lightning's own DistributedSampler, two epochs.

    python lightning_job.py OUT STRATEGY     # under `ddpkit run --nproc-per-node 2` (or alone: reference)

STRATEGY: ``ddpkit`` (``ddpkit.lightning.DDPStrategy()``), ``overlap`` (the same with
``overlap_optimizer=True`` and a bucket a tensor), ``plugin`` (the seeds' ``DDPPlugin`` with
its Lightning 1.4 arguments), ``ddp`` (Lightning's), or ``reference``: one process training on
the concatenated batches (twice the rows per batch), which every other one must equal.
``FAIL_AT=RANK:BATCH`` makes that rank raise in ``training_step`` at that batch of the first epoch.
``PREEMPT_AT=BATCH``: rank 0 sends SIGTERM to ``ddpkit run`` at that batch of the first epoch (and
every batch then takes 0.2 s more, so that the signal arrives long before the run ends);
``RESUME=1``: ``trainer.fit(..., ckpt_path="last")``. ``KILL_AT=RANK:BATCH:PHASE`` (under ``ddpkit run
--recovery in-place``): that rank SIGKILLs itself at that batch of the first epoch (or of ``EPOCH``
with ``RANK:BATCH:PHASE:EPOCH``), in its forward
(``forward``) or at the start of its backward (``backward``), once in the job (a file in OUT says
it happened: the replacement, which runs the script again, does not), after it (``batch_end``: in
``on_train_batch_end``, between steps), or in its ``validation`` step.
``PAUSE_AT=RANK:BATCH``: that rank writes OUT/paused at that batch of the first epoch, in its forward,
and waits there until the test kills its node (once in the job: a process that takes its place goes on).
Each node runs ``LOCAL_WORLD_SIZE`` ranks (``num_nodes``: the world over that).
``CLIP=0``: no gradient clipping (0.5 by default). ``VALIDATE=0``: no validation; ``SANITY=0``: no sanity
check before the fit (so that ``KILL_AT=R:B:validation`` strikes in the first epoch's validation). Each
process saves the validation losses it logged (epoch, val_loss) to OUT/validation<RANK>.pt. ``CHECKPOINTS=0``: no
``ModelCheckpoint``.
``CHECKPOINT_EVERY=N``: also a checkpoint every N optimizer
steps, in OUT/every (right after the step, in ``on_train_batch_end``).
``MANUAL=1``: Lightning's manual optimization (``manual_backward``, then the optimizer's and the
schedule's steps in ``training_step``), without accumulation or clipping, which Lightning refuses with it.
``UNUSED=1``: a layer that no forward uses. ``GRAD_NORM=module``: the module logs the gradients' norms
in ``on_before_optimizer_step`` (``grad_norm``, as Lightning's docs show); ``GRAD_NORM=callback``: a
callback reads them in ``on_after_backward``.
``DROPOUT=1``: a dropout layer (every rank draws its masks from the same seed, Lightning's default).
``OWN_COLLECTIVE=1``: every ``training_step`` all-reduces a tensor of its own with ``torch.distributed``
before the forward; ``OWN_COLLECTIVE_AT_EPOCH_END=1``: one in ``on_train_epoch_end``. Rank 0 saves the final parameters and
buffers to OUT/final.pt. (No bias before the batch norm: its gradient is rounding noise, which
AdamW would turn into steps of full size.)"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

ROWS, BATCH_PER_RANK, FEATURES = 64, 4, 8


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        dropout = [nn.Dropout(0.25)] if os.environ.get("DROPOUT") else []
        self.net = nn.Sequential(nn.Linear(FEATURES, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), *dropout,
                                 nn.Linear(16, 1))
        self.fail_at = tuple(int(part) for part in os.environ["FAIL_AT"].split(":")) if os.environ.get("FAIL_AT") else None
        rank, batch, self.kill_phase, *epoch = os.environ.get("KILL_AT", "-1:-1:forward").split(":")
        self.kill_at, self.kill_epoch = (int(rank), int(batch)), int(epoch[0]) if epoch else 0
        self.unused = nn.Linear(2, 1) if os.environ.get("UNUSED") == "1" else None  # in no forward
        self.deferred = 0  # optimizer steps still deferred at the end of their batch (overlap_optimizer)
        self.automatic_optimization = os.environ.get("MANUAL") != "1"

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.fail_at == (self.global_rank, batch_idx) and self.current_epoch == 0:
            raise ValueError(f"boom in training_step at batch {batch_idx}")
        if os.environ.get("PREEMPT_AT") and not os.environ.get("RESUME"):
            if (self.global_rank, self.current_epoch, batch_idx) == (0, 0, int(os.environ["PREEMPT_AT"])):
                os.kill(int(os.environ["DDPKIT_LAUNCHER_PID"]), signal.SIGTERM)
            time.sleep(0.2)
        x, y = batch
        kill = (self.kill_phase in ("forward", "backward") and self.kill_at == (self.global_rank, batch_idx)
                and self.current_epoch == self.kill_epoch and not os.path.exists(KILLED))
        if kill:
            open(KILLED, "w").close()
            if self.kill_phase == "forward":
                os.kill(os.getpid(), signal.SIGKILL)
        if os.environ.get("PAUSE_AT") and self.current_epoch == 0 and not os.path.exists(PAUSED):
            if (self.global_rank, batch_idx) == tuple(int(part) for part in os.environ["PAUSE_AT"].split(":")):
                open(PAUSED, "w").close()
                time.sleep(600)  # the other ranks wait in the synchronised batch norm's forward
        if os.environ.get("OWN_COLLECTIVE"):  # the user's own, through torch.distributed, before the forward's
            torch.distributed.all_reduce(torch.ones(1))
        loss = nn.functional.mse_loss(self.net(x), y)
        if kill:  # at the start of the backward: after this rank's forward collectives, before its backward's
            loss.register_hook(lambda gradient: os.kill(os.getpid(), signal.SIGKILL))
        self.log("train_loss", loss, sync_dist=True)
        if not self.automatic_optimization:  # the user's own step, as Lightning's manual optimization has it
            optimizer, schedule = self.optimizers(), self.lr_schedulers()
            self.manual_backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()  # type: ignore[union-attr]
        return loss

    def on_train_start(self) -> None:
        wrapped = self.trainer.strategy.model
        hook = getattr(getattr(wrapped, "_reducer", None), "comm_hook", None)  # ddpkit's DDP keeps it there
        self.wrapped_in = (f"{type(wrapped).__module__}.{type(wrapped).__name__} with comm hook "
                           f"{getattr(hook, '__name__', hook)}")

    def on_train_end(self) -> None:
        self.final_weight_sum = float(self.net[0].weight.sum())  # as a user's hook reads the trained weights
        timings = getattr(self.trainer.strategy, "timings", None)  # ddpkit's strategies have them
        self.timed = "" if timings is None else f", {timings().steps} steps timed"

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        from ddpkit.parallel.stand_ins import HeldParameter  # the class of a parameter whose step is deferred

        self.deferred += any(type(p) is HeldParameter for p in self.parameters())
        if (self.kill_phase == "batch_end" and self.kill_at == (self.global_rank, batch_idx)
                and self.current_epoch == self.kill_epoch and not os.path.exists(KILLED)):
            open(KILLED, "w").close()
            time.sleep(1)  # the other ranks finish the step and wait in what follows it
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_epoch_end(self) -> None:
        if os.environ.get("OWN_COLLECTIVE_AT_EPOCH_END"):  # the user's own, between steps
            torch.distributed.all_reduce(torch.ones(1))

    def on_validation_end(self) -> None:
        if not self.trainer.sanity_checking:  # the epoch's validation loss, as every rank logged it
            VALIDATION_LOSSES.append((self.current_epoch, float(self.trainer.callback_metrics["val_loss"])))

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        if (self.kill_phase == "validation" and self.kill_at == (self.global_rank, batch_idx)
                and self.current_epoch == self.kill_epoch and not os.path.exists(KILLED)):
            open(KILLED, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> dict[str, object]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class LoggingGradientNorms(Regression):
    """Logs the gradients' norms before each step, as Lightning's docs show (``GRAD_NORM=module``)."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        norms = grad_norm(self, norm_type=2)
        self.log_dict(norms)
        NORMS.append(float(norms["grad_2.0_norm_total"]))


class GradientNormsCallback(pl.Callback):
    """The same from a callback's ``on_after_backward`` (``GRAD_NORM=callback``)."""

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        NORMS.append(float(grad_norm(pl_module, norm_type=2)["grad_2.0_norm_total"]))


NORMS: list[float] = []  # every gradient norm the hook read
VALIDATION_LOSSES: list[tuple[int, float]] = []  # (epoch, val_loss) after each validation of the fit


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, FEATURES, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(ROWS, 1, generator=generator))


class ConcatenatedShards(Sampler[int]):
    """The reference's order: each batch is the two ranks' batches one after the other, as Lightning's
    DistributedSampler deals them (it shuffles a distributed training set whatever the loader says,
    with the seed PL_GLOBAL_SEED, 0 here, and the epoch)."""

    def __init__(self, dataset: TensorDataset, world: int = 2) -> None:
        self.dataset, self.world, self.epoch = dataset, world, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator[int]:
        shards = []
        for rank in range(self.world):
            sampler = DistributedSampler(self.dataset, num_replicas=self.world, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(self.epoch)
            shards.append(list(sampler))
        for start in range(0, len(shards[0]), BATCH_PER_RANK):
            for shard in shards:
                yield from shard[start:start + BATCH_PER_RANK]


def strategy_for(name: str) -> object:
    if name == "ddpkit":
        import ddpkit.lightning

        return ddpkit.lightning.DDPStrategy()
    if name == "overlap":  # a bucket a tensor: the mode has buckets to overlap on this small model
        import ddpkit.lightning

        return ddpkit.lightning.DDPStrategy(overlap_optimizer=True, bucket_cap_mb=1e-5)
    if name == "plugin":  # the seeds' Lightning 1.4 DDPPlugin, with its arguments: only the import changed
        from ddpkit.hooks import allreduce_hook  # ddpkit's: bit-identical to no hook
        from ddpkit.lightning import DDPPlugin

        return DDPPlugin(parallel_devices=[torch.device("cpu")] * 2, num_nodes=1, cluster_environment=None,
                         sync_batchnorm=True, ddp_comm_state=None, ddp_comm_hook=allreduce_hook, ddp_comm_wrapper=None,
                         find_unused_parameters=False)
    return name  # "ddp", or "auto" for the reference


KILLED = PAUSED = ""  # the files that say a rank was killed, and a rank paused for its node's kill (main sets them)


def main(out: str, name: str) -> None:
    global KILLED, PAUSED
    KILLED, PAUSED = os.path.join(out, "killed"), os.path.join(out, "paused")
    reference = name == "reference"
    devices = 1 if reference else int(os.environ.get("LOCAL_WORLD_SIZE", "2"))
    num_nodes = 1 if reference else int(os.environ.get("WORLD_SIZE", devices)) // devices
    batch = BATCH_PER_RANK * (2 if reference else 1)
    manual = os.environ.get("MANUAL") == "1"
    trainer = pl.Trainer(
        strategy=strategy_for("auto" if reference else name), accelerator="cpu", devices=devices, num_nodes=num_nodes,
        max_epochs=2, limit_val_batches=0 if os.environ.get("VALIDATE") == "0" else None,
        num_sanity_val_steps=0 if os.environ.get("SANITY") == "0" else None,
        # Lightning refuses both with manual optimization
        accumulate_grad_batches=1 if manual else 2,
        gradient_clip_val=None if manual else float(os.environ.get("CLIP", "0.5")) or None,
        sync_batchnorm=not reference,
        enable_checkpointing=os.environ.get("CHECKPOINTS") != "0",
        callbacks=[] if os.environ.get("CHECKPOINTS") == "0" else [
            ModelCheckpoint(dirpath=os.path.join(out, "checkpoints"), save_last=True), *(
            [ModelCheckpoint(dirpath=os.path.join(out, "every"), every_n_train_steps=int(os.environ["CHECKPOINT_EVERY"]),
                             save_top_k=-1)] if os.environ.get("CHECKPOINT_EVERY") else [])],
        default_root_dir=out, logger=False, enable_progress_bar=False, enable_model_summary=False,
        deterministic=True)
    norms = os.environ.get("GRAD_NORM")
    if norms == "callback":
        trainer.callbacks.append(GradientNormsCallback())  # type: ignore[attr-defined]
    module = LoggingGradientNorms() if norms == "module" else Regression()
    training = DataLoader(data(), batch_size=batch, sampler=ConcatenatedShards(data()) if reference else None)
    trainer.fit(module, training, DataLoader(data(), batch_size=batch), ckpt_path="last" if os.environ.get("RESUME") else None)
    if trainer.is_global_zero:
        torch.save(module.state_dict(), os.path.join(out, "final.pt"))
    torch.save(VALIDATION_LOSSES, os.path.join(out, f"validation{os.environ.get('RANK', '0')}.pt"))
    print(f"rank {trainer.global_rank} of {trainer.world_size}: done with {type(trainer.strategy).__module__}."
          f"{type(trainer.strategy).__name__}, the model in {module.wrapped_in}{module.timed}, "
          f"{module.deferred} steps deferred, weights summing to {module.final_weight_sum!r} at on_train_end"
          f"{f', {len(NORMS)} gradient norms summing to {sum(NORMS)!r}' if norms else ''}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
