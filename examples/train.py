"""Train a small classifier on synthetic data, data-parallel with ddpkit.

    ddpkit run --nproc-per-node 2 examples/train.py [--epochs 5] [--checkpoint ckpt.pt] [--resume]
    ddpkit run --nproc-per-node 2 --max-restarts 1 examples/train.py --checkpoint ckpts/ --crash-at-step 40

The dataset comes from a fixed seed (nothing is downloaded). Rank 0 shows a progress bar (tqdm
when installed) and loss and accuracy per epoch; a checkpoint is saved after every epoch when
``--checkpoint`` is given (a file, or a folder that gets ``checkpoint.pt``), and ``--resume``
continues from it; so does a start after a restart of the launcher (``--max-restarts``), by
itself. ``--crash-at-step N`` makes rank 1 fail at global step N of the first start, to see a
restart resume. With ``--checkpoint``, a preemption (SIGTERM to ``ddpkit run``, or its
``--preemption-signal``) saves in the middle of the epoch and exits with 75, and the same
command run again continues from that batch. The last line reports throughput, whether every
rank holds the same parameters, and (``--check-reference``, on by default) how far the
parameters are from one process trained on the same global batches from scratch, at the end of
every epoch, also after a resume or an in-place recovery (the global batches of the world the
job started with, which a shrink keeps), and the accuracy on 1024 points it never trained on.
Ranks that sum the global batch in another order than one process round differently, and this
training amplifies a last-bit difference (to 1e-1 in 30 epochs), so the check is derived, not
fixed: one process trains the same batches twice, summing each global batch as the starting
ranks do and in one piece (as one rank holding every share does after a shrink); that gap is
what rounding alone explains at each epoch, and the run fails the check only when it is
further from the first than ``ROUNDING_FACTOR`` times the gap (or ``EXACT_FLOOR``) at some epoch. ``--comm-hook powersgd`` (or
``fp16``, ``bf16``) compresses the gradients' all-reduce (``ddpkit.hooks``): the parameters then
differ from one process's, and the held-out accuracy is what to compare. ``--plot loss.png``
draws the loss and accuracy per epoch into an image (with matplotlib: ``pip install
'ddpkit[plot]'``). What real loops add, each kept exact under in-place recovery: ``--warmup-steps
N`` (a learning-rate schedule handed to ``strategy.setup``), ``--sync-batchnorm`` (a batch norm
over the whole global batch), ``--all-reduce-loss`` (a ``torch.distributed`` collective of the
script's own inside the step). Started with plain ``python``, it runs as a single process.

Compared with a single-process loop, the ddpkit lines are the ones marked ``# ddpkit``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit
from ddpkit import hooks

FEATURES, CLASSES = 32, 4
# The check against one process (``verdict``): how many times what rounding alone explains at an
# epoch the run may be away from the reference there, and the least it is allowed.
ROUNDING_FACTOR, EXACT_FLOOR = 10.0, 1e-6


def synthetic_dataset(samples: int, seed: int = 0) -> TensorDataset:
    """Points labelled by a fixed random 'teacher' network: learnable, deterministic."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    return TensorDataset(inputs, (torch.tanh(inputs) @ teacher).argmax(dim=1))


def held_out_dataset(samples: int, trained_samples: int) -> TensorDataset:
    """Points the model never trained on, labelled by the teacher of ``synthetic_dataset(trained_samples)``."""
    generator = torch.Generator().manual_seed(0)
    torch.randn(trained_samples, FEATURES, generator=generator)  # the training inputs, drawn before the teacher
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    inputs = torch.randn(samples, FEATURES, generator=generator)
    return TensorDataset(inputs, (torch.tanh(inputs) @ teacher).argmax(dim=1))


def comm_hook(name: str | None) -> tuple[object | None, Any]:
    """``--comm-hook``: the state and the hook that compress the gradients' all-reduce (``ddpkit.hooks``)."""
    if name == "powersgd":
        # Rank 1 after 10 steps of plain all-reduce (torch's advice: PowerSGD starts from a model that has begun to learn).
        return hooks.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=10), hooks.powerSGD_hook
    if name in ("fp16", "bf16"):
        return None, {"fp16": hooks.fp16_compress_hook, "bf16": hooks.bf16_compress_hook}[name]
    return None, None


def make_model(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(1234)
    if batchnorm:  # --sync-batchnorm: normalised over the whole global batch (no bias before a norm)
        return nn.Sequential(nn.Linear(FEATURES, 64, bias=False), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64),
                             nn.ReLU(), nn.Linear(64, CLASSES))
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES))


def warmup(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LRScheduler | None:
    """``--warmup-steps``: the learning rate rises linearly over the first ``steps`` optimizer steps."""
    if steps <= 0:
        return None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / steps))


def progress(batches: Iterable[Any], total: int, show: bool, label: str) -> Iterator[Any]:
    """tqdm on rank 0 when it is installed, a one-line counter otherwise, nothing on other ranks."""
    if not show:
        yield from batches
        return
    try:
        from tqdm import tqdm
    except ImportError:
        for index, batch in enumerate(batches, start=1):
            print(f"\r{label} {index}/{total}", end="", file=sys.stderr, flush=True)
            yield batch
        print(file=sys.stderr)
        return
    yield from tqdm(batches, total=total, desc=label, leave=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint", default=None, help="save here (a file or a folder) after every epoch")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint (after a restart: always)")
    parser.add_argument("--crash-at-step", type=int, default=None,
                        help="rank 1 fails at this global step of the first start (to try --max-restarts)")
    parser.add_argument("--kill-at-step", type=int, default=None,
                        help="rank 1 kills itself (SIGKILL) at this global step, once (to try --recovery in-place)")
    parser.add_argument("--kill-rank", type=lambda text: {int(rank) for rank in text.split(",")}, default={1},
                        help="the rank --kill-at-step kills, or several (1,2): killed together")
    parser.add_argument("--kill-during", default="backward",
                        choices=["forward", "backward", "all-reduce-loss", "optimizer-step", "epoch-totals",
                                 "checkpoint-save"],
                        help="where in the step --kill-at-step strikes (epoch-totals: in the reduction of the epoch's "
                             "totals after it, between steps; checkpoint-save: the save after its epoch)")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="rank 0 draws the loss and accuracy per epoch into this image (needs matplotlib)")
    parser.add_argument("--no-check-reference", dest="check_reference", action="store_false")
    parser.add_argument("--comm-hook", choices=["fp16", "bf16", "powersgd"], default=None,
                        help="compress the gradients' all-reduce (ddpkit.hooks); the parameters then differ from one "
                             "process's, so --check-reference is off: compare the held-out accuracy instead")
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="a learning-rate warm-up over this many steps (a LambdaLR stepped every step)")
    parser.add_argument("--sync-batchnorm", action="store_true",
                        help="a batch norm in the model, synchronised over the ranks (DDPStrategy(sync_batchnorm=True)); "
                             "--check-reference is off (its statistics round unlike one process's)")
    parser.add_argument("--all-reduce-loss", action="store_true",
                        help="average each step's loss over the ranks with torch.distributed.all_reduce, inside the "
                             "step (a collective of the script's own), for the epoch line")
    parser.add_argument("--processes", type=int, default=1,
                        help="run directly (python train.py) on this many processes; not needed under ddpkit run")
    args = parser.parse_args()
    if args.resume and not args.checkpoint:
        parser.error("--resume needs --checkpoint PATH")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(f"--plot {args.plot} needs matplotlib, which is not installed: pip install 'ddpkit[plot]' "
                         "(or pip install matplotlib), or leave --plot out")

    torch.set_num_threads(1)
    # Several parallel_devices and no launcher: the script starts its other processes itself.
    devices = [torch.device("cpu")] * args.processes if args.processes > 1 else None
    hook_state, hook = comm_hook(args.comm_hook)
    # Compressed gradients change the result beyond rounding, and a batch norm's statistics would
    # need a reference that normalises as the ranks do: compare the held-out accuracy, or a run
    # without faults, instead.
    args.check_reference = args.check_reference and hook is None and not args.sync_batchnorm
    strategy = ddpkit.DDPStrategy(parallel_devices=devices, ddp_comm_state=hook_state,  # ddpkit
                                  ddp_comm_hook=hook, sync_batchnorm=args.sync_batchnorm)
    dataset = synthetic_dataset(args.samples)
    model = make_model(args.sync_batchnorm)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    schedule = warmup(optimizer, args.warmup_steps)
    # The schedule is handed over so that a lost rank's replacement continues it (in-place recovery).
    model, optimizer = strategy.setup(model, optimizer, scheduler=schedule)    # ddpkit
    loader = strategy.setup_dataloader(                                         # ddpkit
        DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True))
    # The parameters after every epoch, for the check: a lost rank's replacement receives them too.
    trajectory = strategy.track("trajectory", Trajectory())                   # ddpkit

    checkpoint = args.checkpoint
    if checkpoint and (os.path.isdir(checkpoint) or checkpoint.endswith(os.sep)):
        checkpoint = os.path.join(checkpoint, "checkpoint.pt")
    first_epoch, first_batch, totals = 0, 0, torch.zeros(3)  # totals: loss sum, correct, samples
    history: list[tuple[int, float, float]] = []  # (epoch, loss, accuracy) of every epoch, for --plot
    resumed: dict[str, Any] | None = None  # where this run continued from, for the summary line
    trained: list[tuple[int, float]] = []  # (epoch, loss) of the epochs this run finished
    # After a restart (ddpkit run --max-restarts, torchrun) or a preemption the job continues by itself.
    resume = args.resume or strategy.restart_count > 0                          # ddpkit
    # Read whatever world wrote it (a finished run's checkpoint is only resumed with --resume) ...
    state = strategy.load_checkpoint(checkpoint, world_may_differ=True) if checkpoint else None  # ddpkit
    if state is not None and (resume or state["preempted"]):
        # ... but continue only a run of this world's global batch: refused, naming why, otherwise.
        state = strategy.load_checkpoint(checkpoint)                            # ddpkit
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if schedule is not None:
            schedule.load_state_dict(state["scheduler"])
        first_epoch, first_batch = state["epoch"], state["batch"]
        history = list(state.get("history", []))
        trajectory.load_state_dict(state.get("trajectory", {"epochs": []}))
        if first_batch and strategy.is_global_zero:  # the epoch's totals so far, summed over the ranks
            totals = state["totals"]
        loader.epoch = first_epoch  # the sampler's shuffle continues where it stopped
        where = f"after epoch {first_epoch}" if first_batch == 0 else f"in epoch {first_epoch + 1} after batch {first_batch}"
        strategy.print(f"resumed from {checkpoint} {where}")
        resumed = {"checkpoint": checkpoint, "epoch": first_epoch, "batch": first_batch}

    start, seen, last_loss = time.perf_counter(), 0, float("nan")
    # strategy.epochs/batches/step: where a lost rank's replacement (ddpkit run --recovery in-place)
    # joins, and what is trained again after it joined; in any other mode they are range() and the loader.
    for epoch in strategy.epochs(args.epochs, start=first_epoch):                # ddpkit
        skip = first_batch if epoch == first_epoch else 0
        if not skip:
            totals = torch.zeros(3)
        # The sampler gives the epoch's order again and starts after the batches trained before the
        # preemption (the loader setup_dataloader made skips them without reading them).
        for x, y in progress(strategy.batches(loader, skip), len(loader) - skip,  # ddpkit
                             strategy.is_global_zero, f"epoch {epoch + 1}"):
            with strategy.step():                                               # ddpkit
                batch = strategy.progress.batch + 1  # batches of this epoch done after this one
                step = epoch * len(loader) + batch
                if step == args.crash_at_step and strategy.global_rank == 1 and strategy.restart_count == 0:
                    raise RuntimeError(f"--crash-at-step {step}: rank 1 fails on purpose")
                fault = Fault(args, strategy, step)
                optimizer.zero_grad()
                fault.at("forward")
                logits = model(x)
                loss = F.cross_entropy(logits, y)
                fault.arm_backward(model)
                strategy.backward(loss)                                         # ddpkit
                if args.all_reduce_loss and torch.distributed.is_initialized():
                    fault.at("all-reduce-loss")
                    step_loss = loss.detach().clone()
                    torch.distributed.all_reduce(step_loss)  # a rank lost here is recovered too
                    last_loss = step_loss.item() / torch.distributed.get_world_size()
                fault.at("optimizer-step")
                optimizer.step()
                if schedule is not None:
                    schedule.step()
                totals += torch.stack([loss.detach() * len(y), (logits.argmax(1) == y).sum(), torch.tensor(len(y))])
                seen += len(y)
                # Every rank learns of a preemption at the same step (without a checkpoint, SIGTERM just ends the job).
                if checkpoint and strategy.preempted():                         # ddpkit
                    strategy.save_checkpoint(checkpoint, {"model": model.state_dict(),
                                                          "optimizer": optimizer.state_dict(),
                                                          "scheduler": schedule and schedule.state_dict(), "epoch": epoch,
                                                          "batch": batch, "preempted": True, "history": history,
                                                          "trajectory": trajectory.state_dict(),
                                                          "totals": strategy.reduce(totals, reduce_op="sum")})
                    strategy.print(f"preempted: saved epoch {epoch + 1} batch {batch} to {checkpoint}; run the same "
                                   "command again to continue", flush=True)
                    strategy.exit_preempted()                                   # ddpkit
        # Between steps: under in-place recovery a rank lost in it is recovered (the reduction runs
        # again without it, and its replacement joins at the next step), not the job restarted.
        end_of_epoch = Fault(args, strategy, (epoch + 1) * len(loader))
        totals = strategy.between_steps(epoch_totals, strategy, totals, end_of_epoch)  # ddpkit
        history.append((epoch + 1, (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()))
        trained.append(history[-1][:2])
        trajectory.add(model)
        last = f"  last step's loss {last_loss:.4f}" if args.all_reduce_loss else ""
        strategy.print(f"epoch {epoch + 1}/{args.epochs}  loss {history[-1][1]:.4f}  "
                       f"accuracy {history[-1][2]:.3f}{last}", flush=True)
        if checkpoint:
            end_of_epoch.at("checkpoint-save")
            strategy.save_checkpoint(checkpoint, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                                  "scheduler": schedule and schedule.state_dict(),
                                                  "epoch": epoch + 1, "batch": 0, "totals": totals,
                                                  "preempted": False, "history": history,
                                                  "trajectory": trajectory.state_dict()})
    elapsed = time.perf_counter() - start
    throughput = strategy.reduce(torch.tensor(float(seen)), reduce_op="sum").item() / max(elapsed, 1e-9)

    held_out = held_out_dataset(1024, args.samples)
    with torch.no_grad():  # the module itself: every rank holds the same parameters, no collective needed
        predicted = getattr(model, "module", model)(held_out.tensors[0]).argmax(1)
    held_out_accuracy = (predicted == held_out.tensors[1]).float().mean().item()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    identical = all(torch.equal(flat, other) for other in ddpkit.gather_all_tensors(flat))
    checked: Verdict | None = None
    if args.check_reference and strategy.is_global_zero:
        # The global batches of the world the job started with: after a lost node shrank the world,
        # the survivors train its shares too (strategy.data_world_size), so the batches stay those.
        checked = verdict(trajectory.epochs, args, strategy.data_world_size)
    difference = None if checked is None else checked.final
    if strategy.is_global_zero:
        note = "" if checked is None else f", {checked}"
        started = "" if strategy.data_world_size == strategy.world_size else \
            f" (the job started with {strategy.data_world_size}; the survivors trained the lost ranks' shares)"
        print(f"done: {throughput:.0f} samples/s over {strategy.world_size} processes{started}, "
              f"parameters identical on all ranks: {identical}{note}, held-out accuracy {held_out_accuracy:.3f}",
              flush=True)
        # One line for programs (the tests, benchmarks/recovery.py) to read, whatever the wording above.
        print("summary " + json.dumps({
            "world_size": strategy.world_size, "started_world_size": strategy.data_world_size,
            "identical": identical, "max_difference": difference,
            "within_rounding": None if checked is None else checked.within,
            "trained": trained, "resumed": resumed, "recovered_in_place": strategy.recovered_in_place,
            "samples_per_second": throughput, "held_out_accuracy": held_out_accuracy}), flush=True)
    strategy.teardown()                                                         # ddpkit
    if args.plot and strategy.is_global_zero:
        plot_history(history, args.plot)
        print(f"loss and accuracy per epoch drawn in {args.plot}", flush=True)
    if not identical:
        raise SystemExit("the ranks' parameters differ: they should be identical after every step")
    if checked is not None and not checked.within:
        raise SystemExit(f"the parameters differ from one process trained on the same batches more than rounding "
                         f"explains: {checked}")


def epoch_totals(strategy: ddpkit.DDPStrategy, mine: torch.Tensor, fault: Fault) -> torch.Tensor:
    """The epoch's loss, correct predictions and samples summed over the ranks: a block between
    steps, which ``strategy.between_steps`` runs again after a rank lost in it."""
    fault.at("epoch-totals")
    return strategy.reduce(mine, reduce_op="sum")


class Fault:
    """``--kill-at-step N --kill-during PHASE [--kill-rank R[,R...]]``: rank R (1) kills itself (SIGKILL, as
    the out-of-memory killer would) in that phase of global step N, once per run (not after a
    restart, nor in its replacement), to try ``ddpkit run --recovery in-place`` or ``--max-restarts``."""

    def __init__(self, args: argparse.Namespace, strategy: ddpkit.DDPStrategy, step: int) -> None:
        self.armed = (step == args.kill_at_step and strategy.global_rank in args.kill_rank and strategy.restart_count == 0
                      and not strategy.recovered_in_place)
        self.phase = args.kill_during

    def at(self, phase: str) -> None:
        if self.armed and phase == self.phase:
            os.kill(os.getpid(), signal.SIGKILL)

    def arm_backward(self, model: nn.Module) -> None:
        """During backward: from the first gradient on, when the buckets' all-reduces are under way."""
        if self.armed and self.phase == "backward":
            last = list(model.parameters())[0]
            last.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))


def plot_history(history: list[tuple[int, float, float]], path: str) -> None:
    """The loss (left axis) and accuracy (right axis) of every epoch, as an image (``--plot``).
    After an in-place recovery of rank 0, the epochs before it are not in its history."""
    import matplotlib

    matplotlib.use("Agg")  # a file, no window: this also runs on machines without a display
    import matplotlib.pyplot as plt

    epochs = [epoch for epoch, _, _ in history]
    figure, loss_axis = plt.subplots(figsize=(6, 4))
    loss_axis.plot(epochs, [loss for _, loss, _ in history], marker="o", color="tab:blue")
    loss_axis.set_xlabel("epoch")
    loss_axis.set_ylabel("training loss", color="tab:blue")
    accuracy_axis = loss_axis.twinx()
    accuracy_axis.plot(epochs, [accuracy for _, _, accuracy in history], marker="s", color="tab:orange")
    accuracy_axis.set_ylabel("training accuracy", color="tab:orange")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


class Trajectory:
    """The flat parameters at the end of every epoch trained (tracked: it moves to a replacement, and
    the checkpoint keeps it), which ``verdict`` compares with one process's, epoch by epoch."""

    def __init__(self) -> None:
        self.epochs: list[torch.Tensor] = []

    def add(self, model: nn.Module) -> None:
        self.epochs.append(torch.cat([p.detach().flatten() for p in model.parameters()]).clone())

    def state_dict(self) -> dict[str, Any]:
        return {"epochs": list(self.epochs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epochs = [epoch.clone() for epoch in state["epochs"]]


class Verdict:
    """How far the run's parameters are from one process's (``final``: after the last epoch), and
    whether every epoch is within what rounding alone explains there (``within``)."""

    def __init__(self, differences: list[float], rounding: list[float]) -> None:
        allowed = [max(EXACT_FLOOR, ROUNDING_FACTOR * gap) for gap in rounding]
        ratios = [difference / limit for difference, limit in zip(differences, allowed, strict=True)]
        self.worst = max(range(len(ratios)), key=ratios.__getitem__)  # the epoch (index) nearest its limit
        self.final, self.within = differences[-1], all(ratio <= 1.0 for ratio in ratios)
        self.difference, self.rounding, self.allowed = differences[self.worst], rounding[self.worst], allowed[self.worst]

    def __str__(self) -> str:
        said = f"max |difference| to one process {self.final:.2e}"
        if self.within and self.final <= EXACT_FLOOR:
            return said
        return (f"{said} after the last epoch; nearest its limit after epoch {self.worst + 1}: {self.difference:.2e}, "
                f"where summing the global batch in one piece instead moves one process by {self.rounding:.2e} "
                f"(allowed: {self.allowed:.1e})")


def verdict(run: list[torch.Tensor], args: argparse.Namespace, world_size: int) -> Verdict:
    """``run``'s parameters after each epoch against one process trained on the same global batches
    (``reference_trajectories``): the difference to the one that sums as the ranks do, and the gap
    between the two ways of summing, which is what rounding alone explains at that epoch."""
    as_ranks, in_one_piece = reference_trajectories(args, world_size)
    # The last epochs: a checkpoint written before the run kept its trajectory holds none of the first.
    as_ranks, in_one_piece = as_ranks[len(as_ranks) - len(run):], in_one_piece[len(in_one_piece) - len(run):]
    differences = [(mine - theirs).abs().max().item() for mine, theirs in zip(run, as_ranks, strict=True)]
    rounding = [(a - b).abs().max().item() for a, b in zip(as_ranks, in_one_piece, strict=True)]
    return Verdict(differences, rounding)


def reference_trajectories(args: argparse.Namespace, world_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One process trained on the same global batches (every rank's batch k, together, at step k),
    twice, the parameters after each epoch: summing each global batch's loss as the mean of its
    rank-sized chunks' means (as ``world_size`` ranks do: with two, to the last bit), and as one
    mean over the whole batch (as one rank holding every share does after a shrink)."""
    dataset = synthetic_dataset(args.samples)
    models = [make_model(), make_model()]
    optimizers = [torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9) for model in models]
    schedules = [warmup(optimizer, args.warmup_steps) for optimizer in optimizers]
    trajectories: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for epoch in range(args.epochs):
        orders = []
        for rank in range(world_size):
            sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for step in range(len(orders[0]) // args.batch_size):
            indices = [i for order in orders for i in order[step * args.batch_size:(step + 1) * args.batch_size]]
            x, y = dataset[indices]
            for in_one_piece, (model, optimizer, schedule) in enumerate(zip(models, optimizers, schedules, strict=True)):
                optimizer.zero_grad()
                if in_one_piece:
                    F.cross_entropy(model(x), y).backward()
                else:
                    chunks = zip(x.split(args.batch_size), y.split(args.batch_size), strict=True)
                    (sum(F.cross_entropy(model(chunk_x), chunk_y) for chunk_x, chunk_y in chunks) / world_size).backward()
                optimizer.step()
                if schedule is not None:
                    schedule.step()
        for model, trajectory in zip(models, trajectories, strict=True):
            trajectory.append(torch.cat([p.detach().flatten() for p in model.parameters()]).clone())
    return trajectories


if __name__ == "__main__":
    main()
