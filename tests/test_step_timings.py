"""Per-rank step phases (issue 49, item 1): a synchronised backward ends every rank's step at the same
moment, so step times name no one; the phases do. Two Gloo ranks, one made slow by real work (matrix
products on its one thread) in its forward, or in its data loading between steps."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from helpers import strategy
from torch import nn

from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.parallel.step_timings import StepClock
from ddpkit.testing import WorkerPool

# Alone: they compare ranks' step times, which a test beside them would skew.
pytestmark = pytest.mark.alone

STEPS, EXTRA_SECONDS = 12, 0.03


def work_for(seconds: float) -> None:
    """Real compute, not a sleep: matrix products until ``seconds`` passed."""
    a = torch.randn(128, 128)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        a = torch.tanh(a @ a)


class SlowOnOneRank(nn.Module):
    def __init__(self, slow: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
        self.slow = slow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow:
            work_for(EXTRA_SECONDS)
        return self.net(x)


def train_with_a_slow_forward(slow_rank: int, overlap: bool) -> dict[str, float | int | None]:
    module = SlowOnOneRank(dist.get_rank() == slow_rank)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    # Small buckets: the mode holds reductions only with more than one (and from the fourth backward).
    model = DistributedDataParallel(module, bucket_cap_mb=0.001, overlap_optimizer=optimizer if overlap else None)
    model.time_optimizer(optimizer)
    held = 0
    for step in range(STEPS):
        optimizer.zero_grad()
        model(torch.randn(16, 32, generator=torch.Generator().manual_seed(step))).sum().backward()
        held += bool(model._reducer.held)
        optimizer.step()
    if overlap and held < STEPS // 2:
        raise AssertionError(f"the mode held the reductions of {held} of {STEPS} backwards: the test measures nothing")
    with torch.no_grad():
        model(torch.randn(4, 32))  # an evaluation's forward between steps: no step's
    return model.timings().as_dict()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlap_optimizer"])
def test_a_rank_slow_in_its_forward_shows_there_and_the_other_waits_for_it_in_communication(
        pool2: WorkerPool, overlap: bool) -> None:
    """With overlap_optimizer the fast rank waits in its next forward, for reductions the slow rank
    launches late: that wait is communication too, or the fast rank's forward would look as slow."""
    fast, slow = pool2.run(train_with_a_slow_forward, 1, overlap, timeout=50)
    assert fast["steps"] == slow["steps"] == STEPS - 1  # the first step's start is not known
    assert slow["forward"] - fast["forward"] > 0.7 * EXTRA_SECONDS, (fast, slow)
    assert fast["communication"] - slow["communication"] > 0.7 * EXTRA_SECONDS, (fast, slow)
    assert abs(fast["step"] - slow["step"]) < 0.3 * slow["step"], (fast, slow)  # the wall clock names nobody
    assert all(timings["optimizer"] is not None and timings["optimizer"] > 0 for timings in (fast, slow))


def train_with_slow_data(slow_rank: int) -> dict[str, float | int | None]:
    s = strategy()
    module = SlowOnOneRank(False)
    model, optimizer = s.setup(module, torch.optim.SGD(module.parameters(), lr=0.01))  # it times the optimizer
    for step in range(STEPS):
        if s.global_rank == slow_rank:
            work_for(EXTRA_SECONDS)  # its data loader, decoding slowly
        optimizer.zero_grad()
        s.backward(model(torch.randn(16, 32, generator=torch.Generator().manual_seed(step))).sum())
        optimizer.step()
    return s.timings().as_dict()


@pytest.mark.timeout(60)
def test_the_strategy_splits_the_time_between_steps_into_the_optimizer_step_and_the_rest(pool2: WorkerPool) -> None:
    fast, slow = pool2.run(train_with_slow_data, 1, timeout=50)
    assert slow["data"] - fast["data"] > 0.7 * EXTRA_SECONDS, (fast, slow)
    assert fast["communication"] - slow["communication"] > 0.7 * EXTRA_SECONDS, (fast, slow)
    for timings in (fast, slow):
        assert timings["optimizer"] is not None and timings["optimizer"] > 0 and timings["data"] is not None


def test_no_step_is_timed_until_one_ran_from_a_synchronisation_to_the_next() -> None:
    clock = StepClock()
    assert clock.timings().steps == 0
    clock.synchronisation_started()
    clock.synchronisation_ended()  # a step whose start was not seen
    assert clock.timings().steps == 0
    clock.first_forward = time.perf_counter()
    clock.forward_seconds = 0.001
    clock.synchronisation_started()
    clock.synchronisation_ended()
    timings = clock.timings()
    assert timings.steps == 1 and timings.forward == 0.001 and timings.optimizer is None
