"""Cost of "never stuck" on the DDP step: ddpkit as shipped (bucket waits in 0.1 s slices, the
peer watch thread reading the store four times a second) against ddpkit with plain waits and no
watch.

    python benchmarks/peer_watch.py [--rounds 15] [--steps 20] [--models lenet mlp]

Two pools of two Gloo ranks (one thread each) run side by side: "on" as shipped, "off" started
with ``DDPKIT_PEER_FAILURE_EXIT_SECONDS=0`` (on Gloo the watch then does not start) and a DDP
module whose bucket waits are plain ``wait()``. Each round, in alternating order, each pool
trains ``--steps`` steps (zero_grad, forward, loss, backward, SGD step) and reports its median
step; the per-round ratio on/off cancels slow spells of the machine. Prints the median and
quartiles of that ratio per model. Models as in ``ddp_step.py``: ``mlp`` 8 x Linear(1024, 1024),
batch 64; ``lenet``, batch 32.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from ddp_step import build  # benchmarks/ is on the path when run as a script

from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.testing import WorkerPool


class PlainWaits(DistributedDataParallel):
    """ddpkit's DDP module with the bucket waits it had before sliced waits (for comparison only)."""

    def _wait(self, bucket: Any, pending: Any) -> Any:
        return pending.wait()


_trainers: dict[str, Any] = {}


def train_block(model_name: str, steps: int, plain: bool) -> float:
    """Median milliseconds of ``steps`` training steps of this rank."""
    if model_name not in _trainers:
        model, batch, loss_function = build(model_name)
        wrapped = (PlainWaits if plain else DistributedDataParallel)(model)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01)
        _trainers[model_name] = (wrapped, batch, loss_function, optimizer)
    wrapped, batch, loss_function, optimizer = _trainers[model_name]
    times = []
    for step in range(steps):
        x, y = batch(step)
        start = time.perf_counter()
        optimizer.zero_grad()
        loss_function(wrapped(x), y).backward()
        optimizer.step()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def nothing() -> None:
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", nargs="+", default=["lenet", "mlp"])
    args = parser.parse_args()
    with WorkerPool(2, timeout=3600, pg_timeout=600) as shipped, WorkerPool(2, timeout=3600, pg_timeout=600) as off:
        shipped.run(nothing)
        os.environ["DDPKIT_PEER_FAILURE_EXIT_SECONDS"] = "0"
        try:
            off.run(nothing)  # its workers start with the setting
        finally:
            del os.environ["DDPKIT_PEER_FAILURE_EXIT_SECONDS"]
        for model_name in args.models:
            for pool, plain in ((shipped, False), (off, True)):  # warm-up
                pool.run(train_block, model_name, args.steps, plain)
            ratios, on_times, off_times = [], [], []
            for round_index in range(args.rounds):
                order = [(shipped, False), (off, True)]
                if round_index % 2:
                    order.reverse()
                measured = {plain: max(pool.run(train_block, model_name, args.steps, plain)) for pool, plain in order}
                on_times.append(measured[False])
                off_times.append(measured[True])
                ratios.append(measured[False] / measured[True])
            lower, median, upper = statistics.quantiles(ratios, n=4)
            print(f"{model_name}: step median on {statistics.median(on_times):.2f} ms, off "
                  f"{statistics.median(off_times):.2f} ms; per-round ratio on/off median {median:.3f} "
                  f"(quartiles {lower:.3f}-{upper:.3f}, {args.rounds} rounds of {args.steps} steps)", flush=True)


if __name__ == "__main__":
    main()
