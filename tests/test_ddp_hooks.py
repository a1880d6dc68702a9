"""Hooks on ddpkit's DistributedDataParallel: what they see, and how they are checked when registered."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.testing import WorkerPool

# One small parameter (copied in batches), one above the batching threshold and one large one:
# before the fix, gradients of 16384 elements or more were copied into their bucket as they
# arrived, so a pre-sync hook's change to them was lost.
SIZES = (100, 40_000, 1_000_000)


class Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(n)) for n in SIZES)

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return sum((w * scale).sum() for w in self.weights)  # type: ignore[return-value]


def zero_on_rank0(ddp: DistributedDataParallel) -> None:
    if dist.get_rank() == 0:
        for p in ddp.module.parameters():
            p.grad.zero_()


def clip_to_half(ddp: DistributedDataParallel) -> None:
    for p in ddp.module.parameters():
        p.grad.clamp_(max=0.5)


def pre_sync_step(hook_name: str, as_view: bool) -> list[tuple[float, float]]:
    model = DistributedDataParallel(Flat(), gradient_as_bucket_view=as_view)
    model.register_comm_hook(globals()[hook_name])
    for _ in range(2):  # the second backward runs on the buckets rebuilt after the first
        model.zero_grad()
        model(torch.tensor(2.0)).backward()  # every element's local gradient is 2
    return [(p.grad.min().item(), p.grad.max().item()) for p in model.module.parameters()]


@pytest.mark.parametrize("as_view", [False, True], ids=["copies", "bucket-views"])
@pytest.mark.parametrize(("hook_name", "expected"), [("zero_on_rank0", 1.0), ("clip_to_half", 0.5)])
def test_a_pre_sync_hook_changes_gradients_of_every_size(pool2: WorkerPool, hook_name: str, expected: float,
                                                        as_view: bool) -> None:
    """pytorch-pfn-extras' semantics: the hook changes the local gradients, then they are averaged."""
    for extremes in pool2.run(pre_sync_step, hook_name, as_view, timeout=60):
        assert extremes == [(expected, expected)] * len(SIZES)


# --- hooks are checked when registered ----------------------------------------------------------
# (This file has string annotations, from __future__: the checks read those as well.)


def one_argument(bucket):  # type: ignore[no-untyped-def]
    return bucket


def returns_int(state: object, bucket: dist.GradBucket) -> int:
    return 0


def takes_a_tensor(state: object, bucket: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    raise AssertionError("never called")


def two_arguments_pre_sync(ddp, extra):  # type: ignore[no-untyped-def]
    pass


def registration_errors() -> list[str]:
    model = DistributedDataParallel(nn.Linear(2, 2))
    messages = []
    for args in [(None, one_argument), (None, returns_int), (None, takes_a_tensor), (two_arguments_pre_sync,),
                 (None, 3)]:
        with pytest.raises((TypeError, ValueError)) as error:
            model.register_comm_hook(*args)
        messages.append(str(error.value))
    return messages


def test_a_malformed_hook_is_refused_when_registered_with_what_to_write(pool2: WorkerPool) -> None:
    for messages in pool2.run(registration_errors, timeout=60):
        signature, annotated_int, annotated_tensor, pre_sync, not_callable = messages
        assert "one_argument" in signature and "hook(state, bucket)" in signature
        assert "returns_int" in annotated_int and "'int'" in annotated_int and "Future" in annotated_int
        assert "takes_a_tensor" in annotated_tensor and "GradBucket" in annotated_tensor
        assert "two_arguments_pre_sync" in pre_sync and "hook(ddp_module)" in pre_sync
        assert "got int" in not_callable


def returns_none_unannotated(state, bucket):  # type: ignore[no-untyped-def]
    dist.all_reduce(bucket.buffer())  # does the work, forgets to return the future


def hook_returning_no_future() -> str:
    model = DistributedDataParallel(nn.Linear(2, 2))
    model.register_comm_hook(None, returns_none_unannotated)  # nothing to check yet: no annotations
    with pytest.raises(TypeError) as error:
        model(torch.ones(1, 2)).sum().backward()
    return str(error.value)


def test_a_hook_returning_no_future_fails_naming_the_hook() -> None:
    """Not AttributeError "'NoneType' object has no attribute 'wait'" from inside DDP. A failure
    in backward ends the group (ddpkit.diagnostics.failures), so this test has its own ranks."""
    with WorkerPool(2, timeout=60, pg_timeout=20) as pool:
        for message in pool.run(hook_returning_no_future, timeout=60):
            assert "returns_none_unannotated" in message and "returned NoneType" in message
            assert "torch.futures.Future" in message


# --- the elementwise promise (ddpkit.hooks.contract) ----------------------------------------------


def averaging_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A user's own averaging hook: divides unless DDP already did, and notes what it was given."""
    from ddpkit.hooks.contract import GradBucket

    buffer = bucket.buffer()
    assert isinstance(bucket, GradBucket)
    SEEN.append((bucket.prescaled(), buffer.numel()))
    if not bucket.prescaled():
        buffer.div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda done: done.value()[0])


SEEN: list[tuple[bool, int]] = []


def train_with_declared_hook(declaration: str) -> tuple[list[tuple[bool, int]], list[float]]:
    from ddpkit.hooks.contract import elementwise_average

    hook = lambda state, bucket: averaging_hook(state, bucket)  # noqa: E731  # a fresh function to declare
    if declaration == "decorator":
        hook = elementwise_average(hook)
    elif declaration == "attribute (0.1)":
        hook.averages_elementwise = True  # type: ignore[attr-defined]
    elif declaration == "attribute False":
        hook.averages_elementwise = False  # type: ignore[attr-defined]
    SEEN.clear()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(3, 2))
    model.register_comm_hook(None, hook)
    x = torch.arange(12.0).view(4, 3) + dist.get_rank()
    model(x).pow(2).sum().backward()
    return list(SEEN), [g for p in model.module.parameters() for g in p.grad.flatten().tolist()]


@pytest.mark.parametrize(("declaration", "prescaled"), [
    ("decorator", True), ("attribute (0.1)", True), ("none", False), ("attribute False", False)])
def test_a_hook_declared_elementwise_gets_prescaled_buffers_with_the_flags(pool2: WorkerPool, declaration: str,
                                                                           prescaled: bool) -> None:
    """Declared: DDP divided already and the two negotiation flags ride in the buffer (6 + 2 + 2 elements);
    not declared: the gradients alone (8), undivided. The averaged gradients are the same either way."""
    results = pool2.run(train_with_declared_hook, declaration, timeout=60)
    torch.manual_seed(0)
    reference = nn.Linear(3, 2)
    x = torch.cat([torch.arange(12.0).view(4, 3) + rank for rank in range(2)])
    reference(x).pow(2).sum().div(2).backward()
    expected = [g for p in reference.parameters() for g in p.grad.flatten().tolist()]
    for seen, gradients in results:
        assert seen == [(prescaled, 8 + 2 if prescaled else 8)]
        assert gradients == pytest.approx(expected, rel=1e-6)
