"""Step time with torch.compile (inductor) against eager, for ddpkit's DDP and torch's.

    python benchmarks/compile_step.py [--steps N] [--backend inductor]

Two Gloo ranks with one thread each (ddpkit.testing.WorkerPool). A step is zero_grad, forward,
MSE loss, backward (with gradient synchronisation) and an SGD step on an MLP of the user's own
class (4 x Linear(512, 512) + GELU, batch 64). Timed in one run, methods interleaved in a
shuffled order each round:

- ``torch eager`` / ``ddpkit eager``: no compilation;
- ``ddpkit inside``: ``DistributedDataParallel(torch.compile(module))``;
- ``ddpkit outside``: ``torch.compile(DistributedDataParallel(module))``;
- ``torch outside``: ``torch.compile`` of torch's DDP (Dynamo's DDPOptimizer splits the graph
  at bucket boundaries);
- ``ddpkit c-autograd`` / ``torch c-autograd``: forward, loss and backward in one compiled
  function with compiled autograd on (``torch._dynamo.config.compiled_autograd``): the backward
  is traced into a graph too, and each DDP's per-gradient functional all-reduces with it, fused
  into buckets by inductor (torch's DDP needs ``optimize_ddp="python_reducer"`` for it).

Compilation happens in the warm-up rounds, which are not counted. Prints medians (ms) and the
per-round ratios of each method to ``torch eager`` (median and quartiles).

Graph breaks: none. With ddpkit's DDP compiled outside, its forward is skipped by Dynamo (as
torch's is) and the wrapped module is compiled as one graph; inside, the module is one graph
too (``tests/test_ddp_combinations.py`` asserts one compiled frame for both). A compiled
backward is one autograd node, so every gradient of the compiled region arrives at its end:
ddpkit cannot overlap communication with that backward, where torch's DDPOptimizer cuts the
graph per bucket to keep some overlap. Under compiled autograd the all-reduces are nodes of the
backward graph, and inductor schedules them beside its compute.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from _timing import (  # benchmarks/ is on the path when run as a script
    interleaved_samples,
    paired_ratio,
)
from torch import nn

from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.testing import WorkerPool


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = nn.functional.gelu(layer(x))
        return x


def measure(steps: int, backend: str) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    x, y = torch.randn(64, 512), torch.randn(64, 512)

    def trainer(model: nn.Module, module: nn.Module) -> Callable[[], None]:
        optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)

        def step() -> None:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        return step

    def compiled_autograd_trainer(model: nn.Module, module: nn.Module) -> Callable[[], None]:
        optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
        with torch._dynamo.config.patch(compiled_autograd=True):  # read when the function is wrapped, too

            @torch.compile(backend=backend)
            def forward_backward() -> None:
                nn.functional.mse_loss(model(x), y).backward()

        def step() -> None:
            optimizer.zero_grad()
            with torch._dynamo.config.patch(compiled_autograd=True):
                forward_backward()
            optimizer.step()
        return step

    def wrapped(kind: str) -> Callable[[], None]:
        module = MLP()
        if kind == "ddpkit c-autograd":
            return compiled_autograd_trainer(DistributedDataParallel(module), module)
        if kind == "torch c-autograd":
            with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
                return compiled_autograd_trainer(nn.parallel.DistributedDataParallel(module), module)
        if kind == "torch eager":
            return trainer(nn.parallel.DistributedDataParallel(module), module)
        if kind == "ddpkit eager":
            return trainer(DistributedDataParallel(module), module)
        if kind == "ddpkit inside":
            return trainer(DistributedDataParallel(torch.compile(module, backend=backend)), module)
        if kind == "ddpkit outside":
            return trainer(torch.compile(DistributedDataParallel(module), backend=backend), module)
        return trainer(torch.compile(nn.parallel.DistributedDataParallel(module), backend=backend), module)

    kinds = ["torch eager", "ddpkit eager", "ddpkit inside", "ddpkit outside", "torch outside", "ddpkit c-autograd",
             "torch c-autograd"]
    return interleaved_samples({kind: wrapped(kind) for kind in kinds}, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description="torch.compile step-time benchmark")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, 2 gloo ranks x 1 thread, backend {args.backend}, medians per step (ms)")
    with WorkerPool(2, timeout=3600) as pool:
        samples = pool.run(measure, args.steps, args.backend)[0]
    for name, values in samples.items():
        median, lower, upper = paired_ratio(samples, name, "torch eager")
        print(f"{name:17s} {statistics.median(values):7.2f} ms   /torch eager per round {median:.2f} "
              f"(quartiles {lower:.2f}-{upper:.2f})", flush=True)


if __name__ == "__main__":
    main()
