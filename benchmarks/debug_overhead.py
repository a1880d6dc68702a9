"""What debug mode (DDPKIT_DEBUG=1, the collective mismatch guard) costs, per collective and per DDP step.

    python benchmarks/debug_overhead.py [--rounds 200]

Two Gloo ranks with one thread each; every method is timed with debug mode off and on, in one
run with the methods interleaved (benchmarks/_timing.py), and also with hang diagnosis on
(``watch_for_hangs(60)``, debug mode off). Debug mode adds one all-gather of
24 integers (sequence number, operation, dtype, shape) before each collective, and turns off
DDP's overlap (buckets are reduced after the fingerprint check at the end of backward).

The measured figures, with the command, are in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from _timing import (
    interleaved_medians,  # benchmarks/ is on the path when run as a script
)
from torch import nn

import ddpkit
from ddpkit.diagnostics.debug import set_debug
from ddpkit.diagnostics.hangs import watch_for_hangs
from ddpkit.testing import WorkerPool


def with_debug(enabled: bool, action: Callable[[], object], hang_seconds: float | None = None) -> Callable[[], None]:
    def run() -> None:
        set_debug(enabled)
        watch_for_hangs(hang_seconds)
        try:
            action()
        finally:
            set_debug(None)
            watch_for_hangs(None)
    return run


def ddp_step(width: int, depth: int) -> Callable[[], None]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = ddpkit.DistributedDataParallel(nn.Sequential(*layers))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, width)

    def step() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    return step


def measure(rounds: int) -> dict[str, float]:
    small = torch.ones(1)
    actions: dict[str, Callable[[], object]] = {
        "sync_ddp(1 float)": lambda: ddpkit.sync_ddp(small),
        "barrier": ddpkit.barrier,
        "gather_all_tensors(1 float)": lambda: ddpkit.gather_all_tensors(small),
        "DDP step, MLP 4x256": ddp_step(256, 4),
        "DDP step, MLP 8x1024": ddp_step(1024, 8),
    }
    methods = {}
    for name, action in actions.items():
        methods[f"{name}|off"] = with_debug(False, action)
        methods[f"{name}|on"] = with_debug(True, action)
        methods[f"{name}|hang watch"] = with_debug(False, action, hang_seconds=60)
    return interleaved_medians(methods, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description="debug-mode overhead")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, 2 gloo ranks x 1 thread, medians (ms)")
    with WorkerPool(2, timeout=1200) as pool:
        medians = pool.run(measure, args.rounds)[0]
    for name in dict.fromkeys(key.split("|")[0] for key in medians):
        off, on, watched = medians[f"{name}|off"], medians[f"{name}|on"], medians[f"{name}|hang watch"]
        print(f"{name:28s} off {off:8.3f}  on {on:8.3f}  on - off {on - off:7.3f}  on/off {on / off:5.2f}"
              f"  | hang watch {watched:8.3f} (+{watched - off:.3f})")


if __name__ == "__main__":
    main()
