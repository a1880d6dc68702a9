"""What in-place recovery keeps of the tracked objects while a step is deferred
(``TrackedState.copies``/``restore``, ``overlap_optimizer``): a copy of each, except an EMA of the
model (``AveragedModel``), whose weights are not copied every step: its update reads the guarded
parameters, so it cannot move before the step is applied, and ``restore`` checks that it did not."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ddpkit.training.state import TrackedState


def tracked_objects() -> tuple[nn.Module, AveragedModel, torch.optim.lr_scheduler.StepLR, TrackedState]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    schedule = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), step_size=1)
    tracked = TrackedState()
    tracked.track("ema", ema)
    tracked.track("schedule", schedule)
    return model, ema, schedule, tracked


def test_the_ema_of_the_model_is_not_copied_and_the_rest_is_put_back() -> None:
    model, ema, schedule, tracked = tracked_objects()
    ema.update_parameters(model)
    copies = tracked.copies(model)
    assert not any(isinstance(value, torch.Tensor) and value.numel() > 1 for value in vars(copies["ema"]).values())
    schedule.optimizer.step()  # no gradients: nothing moves, but the schedule is stepped in torch's order
    schedule.step()
    tracked.restore(copies)
    assert schedule.last_epoch == 0 and int(ema.n_averaged) == 1
    assert "module.0.weight" in tracked.copies()["ema"]  # without the model: a copy, as before


def test_an_ema_updated_before_the_step_was_applied_is_refused_at_the_recovery() -> None:
    model, ema, _, tracked = tracked_objects()
    copies = tracked.copies(model)
    ema.update_parameters(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))  # another model: nothing guards it
    with pytest.raises(RuntimeError, match="the AveragedModel tracked as 'ema' was updated after optimizer.step"):
        tracked.restore(copies)
