"""The replica check (``ddpkit.training.replicas``) and the tracked training state (``ddpkit.training.state``):
fingerprints that tell any one changed element, a comparison across real ranks that raises on every
rank naming what differs, ``DDPKIT_CHECK_REPLICAS`` in a plain loop, and ``DDPStrategy.track``'s
checks and its late loading in a replacement (a schedule made after the state arrived)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import strategy
from torch import nn

from ddpkit.testing import RankFailedError, WorkerPool
from ddpkit.training.replicas import ReplicaMismatchError, check_every, compare_replicas, fingerprints
from ddpkit.training.state import TrackedState, UntrackedStateError


def trained() -> tuple[nn.Module, torch.optim.Optimizer, TrackedState]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    tracked = TrackedState()
    tracked.track("scheduler", torch.optim.lr_scheduler.StepLR(optimizer, step_size=1))
    model(torch.randn(6, 4)).sum().backward()
    optimizer.step()
    return model, optimizer, tracked


def test_equal_states_have_equal_fingerprints_and_any_one_element_changed_shows() -> None:
    model, optimizer, tracked = trained()
    again = fingerprints(*trained())
    assert fingerprints(model, optimizer, tracked) == again
    whats = [what for what, _ in again]
    assert "parameter '0.weight'" in whats and "buffer '1.running_mean'" in whats
    assert "the optimizer's 'lr' of parameter group 0" in whats and "the optimizer's state of '2.bias'" in whats
    assert "the tracked 'scheduler' (StepLR)" in whats

    def changed(what: str) -> list[str]:
        return [name for (name, a), (_, b) in zip(again, fingerprints(model, optimizer, tracked)) if a != b]

    with torch.no_grad():
        weight = model[0].weight
        weight[1, 2] = torch.nextafter(weight[1, 2], torch.tensor(1.0))  # one bit of one element
    assert changed("weight") == ["parameter '0.weight'"]
    with torch.no_grad():
        weight[1, 2] = torch.nextafter(weight[1, 2], torch.tensor(-1.0))
    moment = optimizer.state[model[2].bias]["exp_avg_sq"]
    kept = moment[0].clone()
    moment[0] = torch.nextafter(kept, torch.tensor(1.0))
    assert changed("moment") == ["the optimizer's state of '2.bias'"]
    moment[0] = kept
    optimizer.param_groups[0]["lr"] = 0.1000001
    assert changed("lr") == ["the optimizer's 'lr' of parameter group 0"]
    optimizer.param_groups[0]["lr"] = 0.1
    dict(tracked.items())["scheduler"].step()
    assert changed("schedule") == ["the optimizer's 'lr' of parameter group 0", "the tracked 'scheduler' (StepLR)"]


def test_tensors_of_every_kind_have_fingerprints() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for index, tensor in enumerate([torch.ones(3, dtype=torch.bfloat16), torch.arange(5), torch.tensor([True]),
                                            torch.ones(2, dtype=torch.complex64), torch.ones(0), torch.ones(4, 4).t()]):
                self.register_buffer(f"b{index}", tensor)

    first, second = Holder(), Holder()
    assert fingerprints(first, None) == fingerprints(second, None)
    second.b1[4] = 6
    second.b2[0] = False
    second.b3[1] = 2 + 0j
    assert [a == b for (_, a), (_, b) in zip(fingerprints(first, None), fingerprints(second, None))] == [
        True, False, False, False, True, True]


def test_the_replica_check_setting_is_read_and_a_malformed_one_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DDPKIT_CHECK_REPLICAS", raising=False)
    assert check_every() == 0
    monkeypatch.setenv("DDPKIT_CHECK_REPLICAS", "25")
    assert check_every() == 25
    monkeypatch.setenv("DDPKIT_CHECK_REPLICAS", "often")
    with pytest.raises(ValueError, match=r"DDPKIT_CHECK_REPLICAS='often' is not a whole number of optimizer steps"):
        check_every()


def compare_after_one_rank_drifts(drifting: int) -> str:
    import torch.distributed as dist

    model, optimizer, tracked = trained()
    compare_replicas(fingerprints(model, optimizer, tracked), "before anything drifted")  # equal: passes
    if dist.get_rank() == drifting:
        model[1].running_var.add_(1e-6)
        optimizer.param_groups[0]["lr"] = 0.2
    try:
        compare_replicas(fingerprints(model, optimizer, tracked), "at the test's step")
    except ReplicaMismatchError as error:
        return str(error)
    return "no error"


def test_replicas_that_differ_raise_on_every_rank_naming_each_entry_and_the_ranks(pool3: WorkerPool) -> None:
    messages = pool3.run(compare_after_one_rank_drifts, 1, timeout=60)
    assert messages[0] == messages[1] == messages[2]
    assert messages[0].startswith(
        "the replicas differ at the test's step: buffer '1.running_var': ranks [0, 2] hold one value, ranks [1] "
        "another; the optimizer's 'lr' of parameter group 0: ranks [0, 2] hold one value, ranks [1] another."), messages[0]
    assert "strategy.track(name, obj)" in messages[0]


def plain_loop_where_rank_zero_alone_clips() -> int:
    """A loop outside the strategy's helpers, checked every 2 optimizer steps, where rank 0 alone
    clamps a weight after its steps (code that runs on some ranks only)."""
    os.environ["DDPKIT_CHECK_REPLICAS"] = "2"
    try:
        s = strategy()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
        model, optimizer = s.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
        for step in range(8):
            optimizer.zero_grad()
            s.backward(model(torch.full((2, 4), float(step)) + torch.arange(2.0)[:, None] * s.global_rank).sum())
            optimizer.step()
            if s.is_global_zero:
                with torch.no_grad():
                    model.module[2].weight.clamp_(-0.01, 0.01)
    finally:
        del os.environ["DDPKIT_CHECK_REPLICAS"]
    return s.progress.steps


def test_every_n_steps_a_plain_loop_is_checked_and_ranks_that_drifted_end_it_on_every_rank(pool2: WorkerPool) -> None:
    """Plain batch norm's running statistics differ per rank after each forward, and ddpkit's DDP
    broadcasts them after the backward: equal at the check, not flagged. The weight rank 0 alone
    clamps is, at step 2, on every rank."""
    with pytest.raises(RankFailedError, match=r"ReplicaMismatchError: the replicas differ at optimizer step 2 "
                                              r"\(DDPKIT_CHECK_REPLICAS=2\): parameter '2.weight': ranks \[0\] hold "
                                              r"one value, ranks \[1\] another\. "):
        pool2.run(plain_loop_where_rank_zero_alone_clips, timeout=60)


def test_track_refuses_what_it_cannot_move_and_a_name_taken_twice() -> None:
    tracked = TrackedState()
    with pytest.raises(TypeError, match=r"track\('counter', \.\.\.\) needs an object with state_dict\(\) and "
                                        r"load_state_dict\(\).*got a int"):
        tracked.track("counter", 3)
    with pytest.raises(ValueError, match="needs a non-empty name"):
        tracked.track("", nn.Linear(1, 1))
    tracked.track("ema", nn.Linear(1, 1))
    with pytest.raises(ValueError, match=r"the name 'ema' already tracks a Linear; give each object a name of its own"):
        tracked.track("ema", nn.Linear(1, 1))


def test_a_schedule_made_after_the_state_arrived_gets_the_received_state_and_learning_rate() -> None:
    """A replacement receives the state in setup(), then builds its schedule on the optimizer (whose
    constructor sets the learning rate for step 0) and tracks it: the schedule takes the survivors'
    position and the optimizer their learning rate, as in a survivor."""
    model = nn.Linear(2, 1)
    survivor = torch.optim.AdamW(model.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(survivor, lambda step: (step + 1) / 10)
    for _ in range(4):
        survivor.step()
        schedule.step()
    replacement = torch.optim.AdamW(nn.Linear(2, 1).parameters(), lr=1.0)
    replacement.load_state_dict(survivor.state_dict())
    tracked = TrackedState()
    tracked.receive({"scheduler": schedule.state_dict()}, replacement)
    with pytest.raises(UntrackedStateError, match=r"the survivors track 'scheduler' .* did not track it by its first step"):
        TrackedState.check_complete(tracked, replacement, None, look_for_untracked=False)
    tracked.receive({"scheduler": schedule.state_dict()}, replacement)
    late = torch.optim.lr_scheduler.LambdaLR(replacement, lambda step: (step + 1) / 10)
    assert replacement.param_groups[0]["lr"] == pytest.approx(0.1)  # what the constructor set
    tracked.track("scheduler", late)
    assert late.last_epoch == 4 and replacement.param_groups[0]["lr"] == pytest.approx(0.5)
    tracked.check_complete(replacement, None)  # nothing left over, the schedule tracked
