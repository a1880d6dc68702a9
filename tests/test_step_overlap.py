"""``DistributedDataParallel(overlap_optimizer=...)`` (issue 48, item 2) on 2 Gloo ranks: the
optimizer step deferred to the next forward gives the parameters of the same run without it, bit
for bit, with the loops users write; what reads gradients too early is refused naming the call."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpkit.diagnostics.debug import set_debug
from ddpkit.distributed import register_ddp_comm_hook
from ddpkit.hooks import PowerSGDState, fp16_compress_hook, powerSGD_hook
from ddpkit.parallel.batchnorm import SyncBatchNorm
from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.parallel.stand_ins import GradientsNotReducedError, ParametersNotUpdatedError
from ddpkit.parallel.step_overlap import launch_sequence
from ddpkit.testing import WorkerPool

STEPS = 8  # the first three synchronised backwards are synchronous (they measure the wire)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(),
                         nn.Linear(48, 8))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(16, 32, generator=generator), torch.randn(16, 8, generator=generator)


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw-for-loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
}


def train(optimizer_name: str, overlap: bool, loop: str, as_view: bool = True) -> list[torch.Tensor]:
    """STEPS steps of ``loop`` on a DDP model with small buckets (one a layer), with or without
    overlap_optimizer; this rank's final parameters."""
    try:
        return _train(optimizer_name, overlap, loop, as_view)
    finally:  # the pool's worker runs the next test: a failed debug or compiled loop leaves neither on
        set_debug(None)
        torch._dynamo.config.compiled_autograd = False


class StepInsideForward(nn.Module):
    """Forward, backward and step inside the wrapped module's forward, as Lightning's wrapper runs a
    ``training_step`` under manual optimization."""

    def __init__(self, net: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__()
        self.net, self.optimizer = net, optimizer

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.net(x), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.detach()


def _train(optimizer_name: str, overlap: bool, loop: str, as_view: bool) -> list[torch.Tensor]:
    inner = model()
    if loop == "syncbn":  # collectives in the forward, and buffers broadcast after backward
        torch.manual_seed(0)
        inner = SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(
            nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 48), nn.BatchNorm1d(48), nn.ReLU(),
            nn.Linear(48, 8)))
    optimizer = OPTIMIZERS[optimizer_name](list(inner.parameters()))
    first = next(inner.parameters())
    first.requires_grad_(loop != "unfrozen")  # frozen at wrapping: in no bucket, its gradient this rank's own
    wrapped = StepInsideForward(inner, optimizer) if loop == "step-inside-forward" else inner
    ddp = DistributedDataParallel(wrapped, bucket_cap_mb=0.01, gradient_as_bucket_view=as_view,
                                  static_graph=loop in ("static-graph", "powersgd-static"),
                                  overlap_optimizer=optimizer if overlap else None)
    first.requires_grad_(True)  # unfrozen: the optimizer steps it on this rank's gradient, with the mode or without
    if loop == "fp16-hook":  # an elementwise average: overlapped
        register_ddp_comm_hook(ddp, ddp_comm_state=None, ddp_comm_hook=fp16_compress_hook)
    if loop in ("powersgd", "powersgd-static"):  # negotiates apart (its steps synchronous) unless static_graph
        register_ddp_comm_hook(ddp, ddp_comm_state=PowerSGDState(None, start_powerSGD_iter=2),
                               ddp_comm_hook=powerSGD_hook)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step) if loop == "scheduler" else None
    ema = torch.optim.swa_utils.AveragedModel(inner, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    steps_seen = [0]
    losses: list[torch.Tensor] = []
    deferred = 0  # steps still to be applied right after optimizer.step()
    if loop == "step-hooks":  # once per step: a pre-hook sets this step's lr, a post-hook counts (as a framework does)
        optimizer.register_step_pre_hook(lambda opt, *_: opt.param_groups[0].update(lr=1e-2 * 0.8 ** steps_seen[0]))
        optimizer.register_step_post_hook(lambda *_: steps_seen.__setitem__(0, steps_seen[0] + 1))
    forward_backward = _forward_backward(ddp, compiled=loop == "compiled-autograd")
    if loop == "debug":  # fingerprints before reducing: synchronous steps
        set_debug(True)
    for step in range(STEPS):
        x, y = batch(step)
        if loop == "compiled-autograd":  # each gradient averaged inside the compiled backward: synchronous steps
            forward_backward(x, y)
            optimizer.step()
            deferred += ddp.step_deferred
            optimizer.zero_grad()
            continue
        if loop == "step-inside-forward":  # the step is the next forward's to apply, not this one's
            losses.append(ddp(x, y))
            deferred += ddp.step_deferred
            continue
        if loop == "framework-closure":  # Lightning's automatic optimization: forward, zero_grad, backward in a closure
            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                loss = nn.functional.mse_loss(ddp(x), y)
                optimizer.zero_grad()
                loss.backward()
                return loss
            losses.append(optimizer.step(closure))
            deferred += ddp.step_deferred
            continue
        if loop == "zero-first":
            optimizer.zero_grad()
        if loop == "no_sync":  # two micro-batches, the first accumulated locally
            with ddp.no_sync():
                nn.functional.mse_loss(ddp(x[:8]), y[:8]).backward()
            x, y = x[8:], y[8:]
        nn.functional.mse_loss(ddp(x), y).backward()
        if loop == "clip":
            ddp.settle()  # every gradient averaged first: the clip reads them
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05)
        if loop == "cleared-before-step":  # one layer left out of this step (sync: it has no gradient)
            inner[2].weight.grad = None
        if loop == "closure":  # a closure needs the parameters now: the step is not deferred
            optimizer.step(lambda: 0.0)
        else:
            optimizer.step()
        deferred += ddp.step_deferred
        if scheduler is not None:
            scheduler.step()  # changes the next step's lr, not the deferred one
        if loop == "ema":  # an EMA of the weights reads them after the step: settle() applies it first
            ddp.settle()
            ema.update_parameters(inner)
        if loop == "module-zero":  # the module's own zero_grad, not the optimizer's
            ddp.zero_grad()
        elif loop == "module-zero-keep":
            inner.zero_grad(set_to_none=False)
        elif loop != "zero-first":
            optimizer.zero_grad(set_to_none=loop != "zero-keep")
    ddp.settle()
    return ([p.detach().clone() for p in [*inner.parameters(), *ema.parameters()]] + [b.clone() for b in inner.buffers()]
            + [loss.detach() for loss in losses] + [torch.tensor(steps_seen[0]), torch.tensor(deferred)])


def _forward_backward(ddp: nn.Module, compiled: bool) -> Callable[[torch.Tensor, torch.Tensor], None]:
    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> None:
        nn.functional.mse_loss(ddp(x), y).backward()
    if not compiled:
        return forward_backward
    torch._dynamo.reset()
    torch._dynamo.config.compiled_autograd = True  # read when the function is compiled
    return torch.compile(forward_backward, backend="aot_eager")  # type: ignore[no-any-return]


@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
def test_the_deferred_step_gives_the_parameters_of_the_synchronous_run_bit_for_bit(pool2: WorkerPool,
                                                                                   optimizer_name: str) -> None:
    synchronous = pool2.run(train, optimizer_name, False, "step-then-zero", timeout=60)
    overlapped = pool2.run(train, optimizer_name, True, "step-then-zero", timeout=60)
    for sync_rank, overlap_rank in zip(synchronous, overlapped):
        assert all(torch.equal(a, b) for a, b in zip(sync_rank[:-1], overlap_rank[:-1]))
        assert int(overlap_rank[-1]) == STEPS - 3 and int(sync_rank[-1]) == 0  # deferred after the first three
    assert not torch.equal(synchronous[0][0], next(model().parameters()))  # it trained


# Exact, but not overlapped: settle() before clipping; PowerSGD negotiating unused parameters with an
# all-reduce of its own (unless static_graph); debug mode's fingerprints; a compiled autograd backward.
NOT_OVERLAPPED = {"clip", "powersgd", "debug", "compiled-autograd"}


@pytest.mark.parametrize("loop", ["zero-first", "zero-keep", "scheduler", "no_sync", "clip", "copies", "fp16-hook",
                                  "powersgd", "closure", "framework-closure", "syncbn", "unfrozen",
                                  "static-graph", "powersgd-static", "debug", "compiled-autograd",
                                  "module-zero", "module-zero-keep", "cleared-before-step", "ema",
                                  "step-hooks", "step-inside-forward"])
def test_with_the_loops_users_write_the_result_is_that_of_the_synchronous_run(pool2: WorkerPool, loop: str) -> None:
    as_view = loop != "copies"  # gradient_as_bucket_view=False: each .grad has storage of its own
    kind = "step-then-zero" if loop == "copies" else loop
    synchronous = pool2.run(train, "adamw", False, kind, as_view, timeout=60)
    overlapped = pool2.run(train, "adamw", True, kind, as_view, timeout=60)
    for sync_rank, overlap_rank in zip(synchronous, overlapped):
        assert all(torch.equal(a, b) for a, b in zip(sync_rank[:-1], overlap_rank[:-1]))
        assert int(overlap_rank[-2]) == (STEPS if loop == "step-hooks" else 0)
        # Deferred: every step after the first three (synchronous: they lay out and time the buckets),
        # except where the loop or the reduction needs every gradient at the step.
        assert int(overlap_rank[-1]) == (0 if loop in NOT_OVERLAPPED else STEPS - 3), (loop, int(overlap_rank[-1]))


def deferred_until_the_next_forward(with_closure: bool) -> tuple[bool, bool, bool]:
    inner = model()
    optimizer = torch.optim.SGD(inner.parameters(), lr=0.1)
    ddp = DistributedDataParallel(inner, bucket_cap_mb=0.01, overlap_optimizer=optimizer)
    for step in range(4):  # the first three synchronised backwards are not deferred
        x, y = batch(step)
        before = [p.detach().clone() for p in inner.parameters()]
        if with_closure:  # the loss computed by the closure (as Lightning does): still deferred
            optimizer.step(lambda x=x, y=y: nn.functional.mse_loss(ddp(x), y).backward())  # type: ignore[misc]
        else:
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
        optimizer.zero_grad()
    with torch._C.DisableTorchFunctionSubclass():  # past the guard (test_a_read_of_parameters_before...)
        unchanged = all(torch.equal(a, p) for a, p in zip(before, inner.parameters()))
    ddp(batch(4)[0])
    changed = not any(torch.equal(a, p) for a, p in zip(before, inner.parameters()))
    return unchanged, changed, all(p.grad is None for p in inner.parameters())


@pytest.mark.parametrize("with_closure", [False, True])
def test_the_step_is_applied_by_the_next_forward_and_zero_grad_after_it(pool2: WorkerPool, with_closure: bool) -> None:
    for unchanged, changed, zeroed in pool2.run(deferred_until_the_next_forward, with_closure, timeout=60):
        assert unchanged and changed and zeroed


def schedule_warnings() -> list[str]:
    """The warnings of a loop whose LR schedule was made before the wrapper (as a script that builds
    optimizer and schedule, then hands them to a strategy, does)."""
    import warnings

    inner = model()
    optimizer = torch.optim.AdamW(inner.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9 ** step)
    ddp = DistributedDataParallel(inner, bucket_cap_mb=0.01, overlap_optimizer=optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            x, y = batch(step)
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        ddp.settle()
    return [str(warning.message) for warning in caught]


def test_a_schedule_made_before_the_wrapper_does_not_warn_that_the_step_was_overridden(pool2: WorkerPool) -> None:
    for messages in pool2.run(schedule_warnings, timeout=60):
        assert not [message for message in messages if "lr_scheduler" in message or "overridden" in message], messages


def deferred_with_one_bucket() -> bool:
    """Whether the fifth step is deferred when the whole model fits one bucket (the default caps)."""
    inner = model()
    optimizer = torch.optim.SGD(inner.parameters(), lr=0.1)
    ddp = DistributedDataParallel(inner, overlap_optimizer=optimizer)
    assert len(ddp._reducer.buckets) == 1
    for step in range(5):
        nn.functional.mse_loss(ddp(batch(step)[0]), batch(step)[1]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return ddp.step_deferred


def test_with_one_bucket_nothing_could_overlap_and_the_step_is_applied_at_once(pool2: WorkerPool) -> None:
    """The next forward's first module would wait for the one bucket: the mode's bookkeeping would
    only cost (LeNet and the 120-tensor model of benchmarks/links.py)."""
    assert pool2.run(deferred_with_one_bucket, timeout=60) == [False, False]


def read_too_early(how: str) -> str:
    inner = model()
    optimizer = torch.optim.AdamW(inner.parameters(), lr=1e-2)
    ddp = DistributedDataParallel(inner, bucket_cap_mb=0.01, overlap_optimizer=optimizer)
    for step in range(4):
        x, y = batch(step)
        out = ddp(x)
        try:
            if how == "second backward":
                loss = nn.functional.mse_loss(out, y)
                loss.backward(retain_graph=True)
                if step == 3:
                    loss.backward()
            elif how == "scaler":
                scaler = torch.amp.GradScaler("cpu")
                scaler.scale(nn.functional.mse_loss(out, y)).backward()
                if step == 3:
                    scaler.step(optimizer)
            else:
                nn.functional.mse_loss(out, y).backward()
                if step == 3:
                    torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        except (GradientsNotReducedError, RuntimeError) as error:
            ddp.settle()
            return f"{type(error).__name__}: {error}"
        optimizer.step()
        optimizer.zero_grad()
    return "no error"


def read_parameters_too_early(how: str) -> str:
    inner = model()
    optimizer = torch.optim.AdamW(inner.parameters(), lr=1e-2)
    ddp = DistributedDataParallel(inner, bucket_cap_mb=0.01, overlap_optimizer=optimizer)
    ema = torch.optim.swa_utils.AveragedModel(inner, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    if how == "post-hook":  # runs at optimizer.step(), before the deferred step is applied
        optimizer.register_step_post_hook(lambda *_: inner[0].weight.sum())
    for step in range(4):
        x, y = batch(step)
        nn.functional.mse_loss(ddp(x), y).backward()
        try:
            optimizer.step()
            optimizer.zero_grad()
            ddp.zero_grad()  # its metadata and .grad stay open
            sum(p.numel() for p in inner.parameters())
            if how == "ema":
                ema.update_parameters(inner)
            elif how == "norm":
                float(inner[0].weight.norm())
            elif how == "data":
                inner[0].weight.data.clone()
        except ParametersNotUpdatedError as error:
            ddp.settle()
            after = float(inner[0].weight.norm())  # settled: open again
            return f"{type(error).__name__}: {error} ({after > 0})"
    return "no error"


@pytest.mark.parametrize(("how", "named"), [("ema", "AveragedModel.update_parameters"), ("norm", "Tensor.norm"),
                                            ("data", ".data"), ("post-hook", "sum")])
def test_a_read_of_parameters_before_the_deferred_step_is_refused_naming_the_call(pool2: WorkerPool, how: str,
                                                                                  named: str) -> None:
    for message in pool2.run(read_parameters_too_early, how, timeout=60):
        assert message.startswith(f"ParametersNotUpdatedError: ddpkit DistributedDataParallel(overlap_optimizer=...): "
                                  f"{named} (called at {__file__}:"), message
        assert "model.settle()" in message and message.endswith("(True)"), message


def test_a_read_of_gradients_before_they_land_is_refused_naming_the_call(pool2: WorkerPool) -> None:
    for message in pool2.run(read_too_early, "clip", timeout=60):
        assert message.startswith("GradientsNotReducedError") and "clip_grad_norm_" in message, message
        assert "model.settle()" in message
    for message in pool2.run(read_too_early, "scaler", timeout=60):
        assert message.startswith("GradientsNotReducedError") and "GradScaler" in message, message
    for message in pool2.run(read_too_early, "second backward", timeout=60):
        assert "a second backward after one forward" in message, message


def build_with_a_sparse_embedding() -> str:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.EmbeddingBag(10, 8, mode="sum", sparse=True), nn.Linear(8, 4))
    try:
        DistributedDataParallel(inner, overlap_optimizer=torch.optim.SGD(inner.parameters(), lr=0.1))
    except ValueError as error:
        return str(error)
    return "built"


def test_a_sparse_gradient_in_the_optimizer_is_refused(pool2: WorkerPool) -> None:
    """Sparse gradients are averaged apart from the buckets, after them: the mode does not step them."""
    for message in pool2.run(build_with_a_sparse_embedding, timeout=60):
        assert "1 of the optimizer's parameters" in message and "sparse" in message, message


def build_with_lbfgs() -> str:
    inner = model()
    try:
        DistributedDataParallel(inner, overlap_optimizer=torch.optim.LBFGS(inner.parameters()))
    except ValueError as error:
        return str(error)
    return "built"


def test_an_optimizer_that_is_not_per_parameter_is_refused_at_construction(pool2: WorkerPool) -> None:
    for message in pool2.run(build_with_lbfgs, timeout=60):
        assert "LBFGS is not one of the optimizers" in message and "Leave overlap_optimizer off" in message


def refused(what: str) -> str:
    inner = model()
    optimizer = torch.optim.SGD(inner.parameters(), lr=0.1)
    options: dict[str, object] = {}
    if what == "pre-hook with arguments":
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: (args, kwargs))
    if what == "foreign parameter":
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    if what == "reduce_function":
        options["reduce_function"] = lambda tensors, group: None
    try:
        ddp = DistributedDataParallel(inner, bucket_cap_mb=0.01, overlap_optimizer=optimizer, **options)  # type: ignore[arg-type]
        if what == "join":
            with ddp.join():
                pass
        if what == "second optimizer":  # overlap_with: the mode for an optimizer made after wrapping
            ddp.overlap_with(torch.optim.Adam(inner.parameters()))
    except ValueError as error:
        return str(error)
    try:
        for step in range(5):
            x, y = batch(step)
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
    except ValueError as error:
        ddp.settle()
        return f"step {step}: {error}"
    return "accepted"


@pytest.mark.parametrize(("what", "named"), [("foreign parameter", "1 of the optimizer's"),
                                             ("reduce_function", "reduce_function"), ("join", "join()"),
                                             ("second optimizer", "for SGD already, and one optimizer per model"),
                                             ("pre-hook with arguments", "step 3: overlap_optimizer: the optimizer step "
                                                                         "pre-hook refused.<locals>.<lambda> returned")])
def test_what_the_mode_cannot_take_is_refused_naming_it(pool2: WorkerPool, what: str, named: str) -> None:
    for message in pool2.run(refused, what, timeout=60):
        assert named in message and "overlap_optimizer" in message, message


def checkpoint_between_step_and_forward(overlap: bool, of: str = "wrapper"
                                        ) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
    """The model's (``of``: the wrapper, or a submodule: a framework saves the module it trains,
    inside its own wrapper) and the optimizer's state_dict right after optimizer.step(), and whether
    a checkpoint loaded there is what the next forward computes with (not overwritten by the
    deferred step)."""
    inner = model()
    optimizer = torch.optim.AdamW(inner.parameters(), lr=1e-2)
    ddp = DistributedDataParallel(inner, bucket_cap_mb=0.01, overlap_optimizer=optimizer if overlap else None)
    start = {key: value.clone() for key, value in inner.state_dict().items()}
    for step in range(5):
        x, y = batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
    saved = ddp if of == "wrapper" else inner[2]
    parameters = [value.clone() for value in saved.state_dict().values()]  # before the optimizer's state_dict
    moments = [state["exp_avg"].clone() for state in optimizer.state_dict()["state"].values()]
    nn.functional.mse_loss(ddp(batch(5)[0]), batch(5)[1]).backward()
    optimizer.step()
    ddp.load_state_dict(start)
    ddp(batch(6)[0])
    return parameters, moments, all(torch.equal(start[key], value) for key, value in inner.state_dict().items())


@pytest.mark.parametrize("of", ["wrapper", "submodule"])
def test_a_checkpoint_between_the_step_and_the_next_forward_holds_the_step_and_a_loaded_one_is_kept(
        pool2: WorkerPool, of: str) -> None:
    synchronous = pool2.run(checkpoint_between_step_and_forward, False, of, timeout=60)
    overlapped = pool2.run(checkpoint_between_step_and_forward, True, of, timeout=60)
    for (sync_parameters, sync_moments, _), (parameters, moments, loaded_kept) in zip(synchronous, overlapped):
        assert all(torch.equal(a, b) for a, b in zip(sync_parameters, parameters))
        assert all(torch.equal(a, b) for a, b in zip(sync_moments, moments))
        assert loaded_kept


def test_the_buckets_the_wire_sends_during_backward_go_first_then_the_first_layers_and_the_second_bucket_last() -> None:
    assert launch_sequence(8, None) == (list(range(8)), 8)
    assert launch_sequence(8, 0.1) == ([0, 7, 6, 5, 4, 3, 2, 1], 1)  # the wire is slow: one during backward
    assert launch_sequence(8, 0.5) == ([0, 2, 3, 4, 7, 6, 5, 1], 4)
    assert launch_sequence(8, 1.0) == ([0, 2, 3, 4, 5, 6, 7, 1], 7)  # it keeps up: all but one during backward
    assert launch_sequence(2, 0.1) == ([0, 1], 2)


def train_through_the_strategy(overlap: bool) -> tuple[list[torch.Tensor], int]:
    """The loop of docs/strategy.md with DDPStrategy(overlap_optimizer=...): AdamW, an LR schedule
    tracked by the strategy, a checkpoint saved mid-way, and the replicas compared every two steps
    (its read of the parameters settles first)."""
    import os

    from helpers import strategy

    os.environ["DDPKIT_CHECK_REPLICAS"] = "2"  # read by setup
    try:
        s = strategy(overlap_optimizer=overlap)
        inner = model()
        optimizer = torch.optim.AdamW(inner.parameters(), lr=1e-2, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9 ** step)
        ddp, optimizer = s.setup(inner, optimizer, scheduler=scheduler)
    finally:
        del os.environ["DDPKIT_CHECK_REPLICAS"]  # the pool's workers run other tests after this one
    assert isinstance(ddp, DistributedDataParallel) and (ddp._reducer.overlapped is not None) == overlap
    for _ in s.epochs(2):
        for step in s.batches(range(STEPS // 2)):
            x, y = batch(step)
            with s.step():
                optimizer.zero_grad()
                s.backward(nn.functional.mse_loss(ddp(x), y))
                optimizer.step()
                scheduler.step()
    ddp.settle()
    return [p.detach().clone() for p in inner.parameters()], s.progress.steps


def test_ddpstrategy_overlap_optimizer_gives_the_parameters_of_the_synchronous_run(pool2: WorkerPool) -> None:
    synchronous = pool2.run(train_through_the_strategy, False, timeout=60)
    overlapped = pool2.run(train_through_the_strategy, True, timeout=60)
    for (sync_parameters, sync_steps), (parameters, steps) in zip(synchronous, overlapped):
        assert steps == sync_steps == STEPS
        assert all(torch.equal(a, b) for a, b in zip(sync_parameters, parameters))


def strategy_refusal(how: str) -> str:
    from helpers import strategy

    try:
        s = strategy(overlap_optimizer=True, use_torch_ddp=how == "torch ddp")
        s.setup(model())
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize(("how", "named"), [("torch ddp", "drop use_torch_ddp=True"),
                                            ("no optimizer", "call setup(model, optimizer)")])
def test_ddpstrategy_overlap_optimizer_refuses_what_it_cannot_take(pool2: WorkerPool, how: str, named: str) -> None:
    for message in pool2.run(strategy_refusal, how, timeout=60):
        assert "overlap_optimizer=True" in message and named in message, message
