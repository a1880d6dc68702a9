"""The timing loop every benchmark here uses, run inside each rank of a WorkerPool."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import torch.distributed as dist

WARMUP_ROUNDS = 3


def interleaved_medians(
    methods: dict[str, Callable[[], object]],
    rounds: int,
    calls_per_sample: int = 1,
    before: Callable[[str], None] | None = None,
    after: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """Median milliseconds per call of each method, all measured in one run.

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
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}
