"""What listening for preemption costs a training step: ``DDPStrategy.preempted()`` once per step.

    python benchmarks/preemption.py [--steps N] [--models mlp lenet many]

Two Gloo ranks with one thread each (ddpkit.testing.WorkerPool), ddpkit's DDP, the models of
``ddp_step.py``. Timed in one run, the methods interleaved in a shuffled order each round, ten
steps back to back per sample (the agreement times the steps between its calls, as in a loop):

- ``ddpkit``: a step (zero_grad, forward, loss, backward, SGD step);
- ``+ agreement``: the same and ``StepAgreement.decide`` (what ``preempted()`` does each step):
  the round's all-reduce is read at the next step (the default for steps under
  ``WAIT_AT_ONCE_SECONDS``);
- ``+ agreement at once``: the all-reduce waited for in the step that starts it (the mode for
  longer steps; a per-step broadcast waited for at once, as Lightning's SIGTERM check).

Prints the medians (ms) and each variant's per-round ratio to ``ddpkit``. Figures, with the
command, in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from _timing import interleaved_samples, paired_ratio  # benchmarks/ is on the path when run as a script
from ddp_step import build
from torch import nn

from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.testing import WorkerPool
from ddpkit.training.agreement import StepAgreement


def measure(model_name: str, steps: int) -> dict[str, list[float]]:
    base, batch, loss_fn = build(model_name)
    x, y = batch(0)

    def trainer(agreement: StepAgreement | None) -> Callable[[], None]:
        clone, _, _ = build(model_name)
        clone.load_state_dict(base.state_dict())
        model: nn.Module = DistributedDataParallel(clone)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step() -> None:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
            if agreement is not None and agreement.decide(False):
                raise RuntimeError("no rank raised its flag, yet the agreement says stop")
        return step

    methods = {"ddpkit": trainer(None), "+ agreement": trainer(StepAgreement()),
               "+ agreement at once": trainer(StepAgreement(wait_at_once_seconds=0))}
    # Back-to-back calls, as in a training loop: the agreement times the steps between its calls.
    calls = 10
    return interleaved_samples(methods, max(1, steps // calls), calls_per_sample=calls)


def main() -> None:
    parser = argparse.ArgumentParser(description="cost of the per-step preemption agreement")
    parser.add_argument("--steps", type=int, default=None, help="steps per method (default: 200 MLP, 2000 others)")
    parser.add_argument("--models", nargs="+", default=["mlp", "lenet", "many"])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, 2 gloo ranks x 1 thread on cpu, medians per step (ms)")
    with WorkerPool(2, timeout=1200) as pool:
        for model_name in args.models:
            steps = args.steps or (200 if model_name == "mlp" else 2000)
            samples = pool.run(measure, model_name, steps)[0]
            line = "  ".join(f"{name} {statistics.median(values):7.2f}" for name, values in samples.items())
            ratios = "  ".join(f"{name}/ddpkit {paired_ratio(samples, name, 'ddpkit')[0]:.3f}"
                               for name in samples if name != "ddpkit")
            print(f"{model_name:6s} {line}  | per round {ratios}", flush=True)


if __name__ == "__main__":
    main()
