"""What the replica check costs (``ddpkit.training.replicas``: after each in-place recovery, and every
``DDPKIT_CHECK_REPLICAS`` optimizer steps).

    python benchmarks/replica_check.py [--steps N] [--models mlp lenet many many1000]

Two Gloo ranks with one thread each (ddpkit.testing.WorkerPool), ddpkit's DDP, the models of
``ddp_step.py``, AdamW (two moments per parameter: the optimizer state the check reads too) and a
tracked learning-rate schedule. Timed in one run, the methods interleaved in a shuffled order
each round:

- ``step``: a training step (zero_grad, forward, loss, backward, AdamW step, schedule step);
- ``step + check``: the same step followed by the check (fingerprints of parameters, buffers,
  optimizer state and the schedule, and the all-gather that compares them): the cost of one
  check, which ``DDPKIT_CHECK_REPLICAS=N`` pays once every N steps.

Prints the medians (ms), the check's cost per round (``step + check`` less ``step``), and what it
adds per step at N = 1, 10 and 100. Figures, with the command, in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from _timing import interleaved_samples  # benchmarks/ is on the path when run as a script
from ddp_step import build
from torch import nn

from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.testing import WorkerPool
from ddpkit.training.replicas import compare_replicas, fingerprints
from ddpkit.training.state import TrackedState


def measure(model_name: str, steps: int) -> dict[str, list[float]]:
    base, batch, loss_fn = build(model_name)
    x, y = batch(0)

    def trainer(check: bool) -> Callable[[], None]:
        clone, _, _ = build(model_name)
        clone.load_state_dict(base.state_dict())
        model: nn.Module = DistributedDataParallel(clone)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tracked = TrackedState()
        tracked.track("scheduler", schedule := torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))

        def step() -> None:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
            schedule.step()
            if check:
                compare_replicas(fingerprints(clone, optimizer, tracked), "in the benchmark")
        return step

    return interleaved_samples({"step": trainer(False), "step + check": trainer(True)}, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description="cost of the replica check")
    parser.add_argument("--steps", type=int, default=None, help="rounds (default: 100 MLP, 500 others)")
    parser.add_argument("--models", nargs="+", default=["mlp", "lenet", "many", "many1000"])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, 2 gloo ranks x 1 thread on cpu, AdamW, medians per step (ms)")
    with WorkerPool(2, timeout=1800) as pool:
        for model_name in args.models:
            steps = args.steps or (100 if model_name == "mlp" else 500)
            samples = pool.run(measure, model_name, steps)[0]
            step = statistics.median(samples["step"])
            cost = statistics.median(a - b for a, b in zip(samples["step + check"], samples["step"]))
            per_step = "  ".join(f"N={every}: {100 * cost / every / step:.2f}%" for every in (1, 10, 100))
            print(f"{model_name:8s} step {step:7.2f}  step + check {statistics.median(samples['step + check']):7.2f}"
                  f"  | one check {cost:6.2f} ms; per step {per_step}", flush=True)


if __name__ == "__main__":
    main()
