"""A training loop the way users write it, for the in-place recovery tests (tests/test_real_loops.py):
AdamW, a warm-up schedule stepped every step (given to ``setup``) and a sequential schedule stepped
every epoch (made after ``setup`` and tracked), AMP's ``GradScaler`` (on the device trained on), EMA weights
(``AveragedModel``), gradient clipping (unscaled first), batch norm (synchronised with
``sync_batchnorm``), the loss all-reduced for logging with ``torch.distributed`` inside the step
(after the clipping), and a checkpoint after every epoch.

Run by ``ddpkit run`` (one node, or the nodes of a c10d rendezvous). The environment chooses:

- ``FEATURES``: a comma list of ``schedule`` (per step), ``epoch-schedule``, ``scaler``, ``ema``,
  ``syncbn``, ``collective``, or ``all``; ``untracked-schedule`` builds the per-step schedule and
  does not hand it over; ``untracked-scaler`` the same for a GradScaler; ``counted-warmup`` sets the
  learning rate from a step counter of its own, not tracked (nothing in torch marks it);
  ``epoch-collective`` all-reduces the epoch's loss with ``torch.distributed`` after the epoch,
  outside any step, a second after the epoch (``KILL=epoch-collective:STEP`` strikes before that second);
  ``epoch-reduce`` the same through ``strategy.reduce`` (``KILL=epoch-reduce:STEP``); ``epoch-block``
  evaluates the model on a validation loader made by ``setup_dataloader`` after each epoch inside
  ``strategy.between_steps`` (the sums reduced with ``torch.distributed`` and ``strategy.reduce``),
  ``step-block`` the same after the step every 3 steps, ``top-block`` at the top of the loop's body
  every 3 steps (``KILL=evaluation:STEP`` strikes inside it, before its all-reduce).
- ``KILL``: ``PHASE:STEP``: the process started as rank ``KILL_RANK`` (1 by default) kills itself
  (SIGKILL) in optimizer step STEP + 1, where PHASE says (``forward``, ``backward``, ``collective``,
  ``optimizer-step``, ``scheduler-step``; ``checkpoint-save``: before its part of the save after the
  epoch of that step), in the first generation of the first attempt only. ``PAUSE`` instead stops it there (the test
  then kills its node) after writing the file ``paused``.
- The loop trains on the strategy's device: a GPU when there is one (``tests/test_gpu.py`` runs it
  there, under ``ddpkit run --backend gloo`` when the ranks share one GPU), else the CPU.
- ``OVERLAP=1``: ``DDPStrategy(overlap_optimizer=True)``, each step applied by the next forward;
  the EMA and the scaler, which read parameters and gradients, settle the model first.
  ``CLIP=0``: no gradient clipping (the default with ``OVERLAP=1``: a clip reads every gradient
  before the step, so it would settle each step). ``BUCKET_CAP_MB``: the DDP module's (a tiny
  one gives a bucket a parameter: with one bucket the mode does not defer the step).
- ``EPOCHS`` (3), ``STEPS`` per epoch (8), ``WORLD``: the world the job starts with (2), for the data.
- ``HOLD_AT``: after optimizer step S, every rank waits until the file ``go-on`` exists (a node can
  then join a world that shrank before the run ends); rank 0 writes ``step<S>`` after each step;
  ``STEP_SECONDS``: a pause after each step (0), so that a joining node's request is agreed on in time.

Every rank writes ``final<rank>.pt`` in the working folder: the model's, the optimizer's and every
tracked object's state, and the evaluations it ran (step, mean loss), for the test to compare with
the run without a fault.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset

import ddpkit

FEATURES = set(os.environ.get("FEATURES", "all").split(","))
if "all" in FEATURES:
    FEATURES |= {"schedule", "epoch-schedule", "scaler", "ema", "syncbn", "collective"}
PHASE, _, AT = os.environ.get("KILL", os.environ.get("PAUSE", "")).partition(":")
EPOCHS, STEPS, WORLD, BATCH = int(os.environ.get("EPOCHS", "3")), int(os.environ.get("STEPS", "8")), \
    int(os.environ.get("WORLD", "2")), 8
FIRST_GENERATION = int(os.environ.get("DDPKIT_GENERATION", "0")) == 0
FIRST_ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
STRUCK = os.environ["RANK"] == os.environ.get("KILL_RANK", "1") and FIRST_GENERATION and FIRST_ATTEMPT


def strike(phase: str) -> None:
    """Kill (or pause) this process here, once, when the test asked for it in ``phase`` of this step."""
    if not (STRUCK and phase == PHASE and strategy.progress.steps == int(AT)):
        return
    if "PAUSE" in os.environ:
        with open("paused", "w") as marker:
            marker.write(phase)
        time.sleep(600)  # until the test kills the node
    os.kill(os.getpid(), signal.SIGKILL)


OVERLAP = os.environ.get("OVERLAP") == "1"
CLIP = os.environ.get("CLIP", "0" if OVERLAP else "1") == "1"
cap = {"bucket_cap_mb": float(os.environ["BUCKET_CAP_MB"])} if "BUCKET_CAP_MB" in os.environ else {}
strategy = ddpkit.DDPStrategy(sync_batchnorm="syncbn" in FEATURES, overlap_optimizer=OVERLAP, **cap)
device = strategy.root_device
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))  # no bias before a norm
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
schedule = None
if FEATURES & {"schedule", "untracked-schedule"}:  # a warm-up, the form transformers' schedules take
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (2 * STEPS)))
scaler = None
if FEATURES & {"scaler", "untracked-scaler"}:  # AMP's scaler; its scale grows every 3 steps here
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 8, growth_interval=3)
handed = {"scheduler": schedule} if "schedule" in FEATURES else {}
handed |= {"scaler": scaler} if "scaler" in FEATURES else {}
model, optimizer = strategy.setup(model, optimizer, **handed)
epoch_schedule = None
if "epoch-schedule" in FEATURES:  # made after setup (on the wrapped optimizer), so tracked by name
    epoch_schedule = strategy.track("epoch schedule", torch.optim.lr_scheduler.SequentialLR(
        optimizer, [torch.optim.lr_scheduler.ConstantLR(optimizer, factor=0.5, total_iters=1),
                    torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.8)], milestones=[1]))
ema = strategy.track("ema", AveragedModel(model.module, multi_avg_fn=get_ema_multi_avg_fn(0.9))) \
    if "ema" in FEATURES else None

generator = torch.Generator().manual_seed(1)
samples = WORLD * BATCH * STEPS
data = TensorDataset(torch.randn(samples, 16, generator=generator), torch.randint(0, 4, (samples,), generator=generator))
loader = strategy.setup_dataloader(DataLoader(data, batch_size=BATCH, shuffle=True))
rows = WORLD * 24
held_out = TensorDataset(torch.randn(rows, 16, generator=generator), torch.randint(0, 4, (rows,), generator=generator))
held_out_loader = strategy.setup_dataloader(DataLoader(held_out, batch_size=8))
logged = []
counted = 0
evaluations: list[tuple[int, float, int]] = []
evaluated: set[int] = set()


def evaluate() -> float:
    """The mean loss on the held-out rows, every rank's share summed (between steps)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for x, y in held_out_loader:
            x, y = x.to(device), y.to(device)
            total += torch.stack([nn.functional.cross_entropy(model(x), y, reduction="sum").double(),
                                  torch.tensor(float(len(y)), dtype=torch.float64, device=device)])
    model.train()
    strike("evaluation")
    dist.all_reduce(total)  # the user's own collective, and ddpkit's
    count = strategy.reduce(torch.tensor([1.0], device=device), reduce_op="sum")
    mean = (total[0] / total[1]).item()
    evaluations.append((strategy.progress.steps, mean, int(count.item())))
    return mean


BLOCKS = FEATURES & {"epoch-block", "step-block", "top-block"}
for epoch in strategy.epochs(EPOCHS):
    for x, y in strategy.batches(loader):
        x, y = x.to(device), y.to(device)
        if "top-block" in BLOCKS and strategy.progress.steps % 3 == 0 and strategy.progress.steps not in evaluated | {0}:
            evaluated.add(strategy.progress.steps)  # once per step (a batch handed out again comes back here)
            strategy.between_steps(evaluate)
        with strategy.step():
            strike("forward")
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if STRUCK and PHASE == "backward" and strategy.progress.steps == int(AT):
                model.module[0].weight.register_hook(lambda grad: strike("backward"))  # the last gradient
            strategy.backward(scaler.scale(loss) if scaler is not None else loss)
            if scaler is not None:
                if OVERLAP:
                    model.settle()
                scaler.unscale_(optimizer)  # to clip the true gradients, as AMP's docs show
            if CLIP:
                if OVERLAP:
                    model.settle()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if "collective" in FEATURES:  # the loss averaged for logging, with torch.distributed itself
                strike("collective")
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                logged.append(mean.item() / dist.get_world_size())
            strike("optimizer-step")
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            strike("scheduler-step")
            if schedule is not None:
                schedule.step()
            if "counted-warmup" in FEATURES:  # a schedule by hand, from a counter ddpkit is not told of
                counted += 1
                for group in optimizer.param_groups:
                    group["lr"] = 1e-2 * min(1.0, (counted + 1) / (2 * STEPS))
            if ema is not None:
                if OVERLAP:
                    model.settle()
                ema.update_parameters(model.module)
        if "step-block" in BLOCKS and strategy.progress.steps % 3 == 0 and strategy.progress.steps not in evaluated:
            evaluated.add(strategy.progress.steps)  # once per step (a step recovered comes back here untrained)
            strategy.between_steps(evaluate)
        if strategy.global_rank == 0:
            open(f"step{strategy.progress.steps}", "w").close()
        while str(strategy.progress.steps) == os.environ.get("HOLD_AT") and not os.path.exists("go-on"):
            time.sleep(0.05)
        time.sleep(float(os.environ.get("STEP_SECONDS", "0")))
    if epoch_schedule is not None:
        epoch_schedule.step()
    if "epoch-block" in BLOCKS:
        strategy.between_steps(evaluate)
    if "epoch-collective" in FEATURES:  # outside any step: in-place recovery cannot redo it
        strike("epoch-collective")
        time.sleep(1.0)  # a rank killed before it is seen by the launcher first, and its replacement begins
        dist.all_reduce(torch.tensor([sum(logged)]))
    if "epoch-reduce" in FEATURES:  # the same with ddpkit's collective: an epoch's metrics summed
        strike("epoch-reduce")
        time.sleep(1.0)
        strategy.reduce(torch.tensor([sum(logged)]), reduce_op="sum")
    strike("checkpoint-save")
    strategy.save_checkpoint("checkpoint.pt", {"model": model.state_dict(), "epoch": epoch + 1})

tracked = {name: obj.state_dict() for name, obj in [("schedule", schedule), ("scaler", scaler), ("ema", ema),
                                                    ("epoch schedule", epoch_schedule)] if obj is not None}
torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "tracked": tracked,
            "steps": strategy.progress.steps, "world_size": strategy.world_size, "evaluations": evaluations},
           f"final{os.environ['RANK']}.pt")
print(f"rank {os.environ['RANK']}: rank {strategy.global_rank} of {strategy.world_size} done after "
      f"{strategy.progress.steps} steps, recovered {strategy.recovered_in_place}", flush=True)
strategy.teardown()
