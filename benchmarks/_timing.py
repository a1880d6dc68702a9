"""The timing loop every benchmark here uses, run inside each rank of a WorkerPool."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

WARMUP_ROUNDS = 3


def sgd_step(model: nn.Module, loss_fn: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor,
             lr: float = 1e-4) -> Callable[[], None]:
    """One training step of ``model`` on the batch ``x``, ``y`` with plain SGD: the step every
    method of a benchmark times."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    def step() -> None:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    return step


def interleaved_medians(
    methods: dict[str, Callable[[], object]],
    rounds: int,
    calls_per_sample: int = 1,
    before: Callable[[str], None] | None = None,
    after: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """Median milliseconds per call of each method, all measured in one run (see ``interleaved_samples``)."""
    samples = interleaved_samples(methods, rounds, calls_per_sample, before, after)
    return {name: statistics.median(values) for name, values in samples.items()}


def paired_ratio(samples: dict[str, list[float]], numerator: str, denominator: str) -> tuple[float, float, float]:
    """Median and quartiles of ``numerator / denominator`` taken round by round.

    Both methods ran in the same round, seconds apart, so a slow spell of the machine hits both;
    the per-round ratio cancels it, where a ratio of two medians keeps it. Quartiles show how
    far one round's ratio strays.
    """
    ratios = sorted(a / b for a, b in zip(samples[numerator], samples[denominator]))
    lower, median, upper = statistics.quantiles(ratios, n=4)
    return median, lower, upper


def interleaved_samples(
    methods: dict[str, Callable[[], object]],
    rounds: int,
    calls_per_sample: int = 1,
    before: Callable[[str], None] | None = None,
    after: Callable[[str], None] | None = None,
) -> dict[str, list[float]]:
    """Milliseconds per call of each method in each counted round, all measured in one run.

    Each round runs every method once, in an order shuffled anew (noise on a shared machine then
    hits all methods alike) with the same seed on every rank (their collectives must match). A
    sample follows a barrier and averages ``calls_per_sample`` back-to-back calls, which dilutes
    the barrier's exit skew. ``before``/``after`` run outside the timed region. The first
    ``WARMUP_ROUNDS`` rounds are not counted.
    """
    times: dict[str, list[float]] = {name: [] for name in methods}
    order = list(methods)
    shuffler = random.Random(0)
    for round_index in range(rounds + WARMUP_ROUNDS):
        shuffler.shuffle(order)
        for name in order:
            if before is not None:
                before(name)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls_per_sample):
                methods[name]()
            elapsed = (time.perf_counter() - start) / calls_per_sample
            if after is not None:
                after(name)
            if round_index >= WARMUP_ROUNDS:
                times[name].append(elapsed)
    return {name: [value * 1e3 for value in values] for name, values in times.items()}
