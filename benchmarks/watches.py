"""Cost of "never stuck" on the DDP step, as shipped against with a watch turned off.

    python benchmarks/watches.py --compare peer [--rounds 15] [--steps 20] [--models lenet mlp]
    python benchmarks/watches.py --compare hang [...]

``--compare peer``: ddpkit as shipped (bucket waits in 0.1 s slices, the peer watch thread reading
the store four times a second) against ddpkit with plain waits and no peer watch (started with
``DDPKIT_PEER_FAILURE_EXIT_SECONDS=0``: on Gloo the watch then does not start).
``--compare hang``: hang diagnosis on by default (each collective noted in memory, the watch
thread publishing progress and polling the store once a second) against
``DDPKIT_HANG_SECONDS=0``.

Two pools of two Gloo ranks (one thread each) run side by side. Each round, in alternating
order, each pool trains ``--steps`` steps (zero_grad, forward, loss, backward, SGD step) and
reports its median step; the per-round ratio on/off cancels slow spells of the machine. Prints
the median and quartiles of that ratio per model. Models as in ``ddp_step.py``: ``mlp`` 8 x
Linear(1024, 1024), batch 64; ``lenet``, batch 32.
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
    parser.add_argument("--compare", choices=["peer", "hang"], default="peer")
    args = parser.parse_args()
    variable = "DDPKIT_PEER_FAILURE_EXIT_SECONDS" if args.compare == "peer" else "DDPKIT_HANG_SECONDS"
    off_is_plain = args.compare == "peer"  # the peer comparison also waits plainly
    with WorkerPool(2, timeout=3600, pg_timeout=600) as shipped, WorkerPool(2, timeout=3600, pg_timeout=600) as off:
        shipped.run(nothing)
        os.environ[variable] = "0"
        try:
            off.run(nothing)  # its workers start with the setting
        finally:
            del os.environ[variable]
        for model_name in args.models:
            for pool, plain in ((shipped, False), (off, off_is_plain)):  # warm-up
                pool.run(train_block, model_name, args.steps, plain)
            ratios, on_times, off_times = [], [], []
            for round_index in range(args.rounds):
                order = [(shipped, False), (off, off_is_plain)]
                if round_index % 2:
                    order.reverse()
                measured = {pool is shipped: max(pool.run(train_block, model_name, args.steps, plain))
                            for pool, plain in order}
                on_times.append(measured[True])
                off_times.append(measured[False])
                ratios.append(measured[True] / measured[False])
            lower, median, upper = statistics.quantiles(ratios, n=4)
            print(f"{args.compare} watch, {model_name}: step median on {statistics.median(on_times):.2f} ms, off "
                  f"{statistics.median(off_times):.2f} ms; per-round ratio on/off median {median:.3f} "
                  f"(quartiles {lower:.3f}-{upper:.3f}, {args.rounds} rounds of {args.steps} steps)", flush=True)


if __name__ == "__main__":
    main()
