"""Hooks on ddpkit's DistributedDataParallel: what they see, and how they are checked when registered."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpkit.ddp import DistributedDataParallel
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
