"""ddpkit.hooks on torch's and ddpkit's DistributedDataParallel, 2 and 3 Gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from helpers import Counting
from torch import nn

from ddpkit.distributed import register_ddp_comm_hook
from ddpkit.hooks import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
    noop_hook,
)
from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.testing import WorkerPool

HOOKS = {
    "none": (None, None),
    "allreduce": (allreduce_hook, None),
    "fp16": (fp16_compress_hook, None),
    "bf16": (bf16_compress_hook, None),
    "fp16_wrapper": (allreduce_hook, fp16_compress_wrapper),
    "bf16_wrapper": (allreduce_hook, bf16_compress_wrapper),
    "noop": (noop_hook, None),
}
# Largest error as a fraction of each tensor's scale: two roundings (each rank's cast, the sum).
TOLERANCE = {"fp16": 2e-3, "bf16": 1.6e-2, "fp16_wrapper": 2e-3, "bf16_wrapper": 1.6e-2}


def wrap(model: nn.Module, kind: str) -> nn.Module:
    if kind == "torch":
        return nn.parallel.DistributedDataParallel(model)
    # Several buckets; static_graph so that only gradients are counted on the wire (with a hook,
    # ddpkit negotiates in a separate small all-reduce, tested in test_ddp.py).
    return DistributedDataParallel(model, bucket_cap_mb=0.001, static_graph=True)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def hooked_gradients(kind: str, hook_name: str) -> tuple[list[torch.Tensor], int]:
    rank = dist.get_rank()
    model = wrap(make_model(), kind)
    hook, wrapper = HOOKS[hook_name]
    register_ddp_comm_hook(model, ddp_comm_state=None, ddp_comm_hook=hook, ddp_comm_wrapper=wrapper)
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(5, 8, generator=generator), torch.randn(5, 4, generator=generator)
    with Counting() as counting:
        nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.module.parameters()], counting.sent


def local_and_mean_gradients(world: int) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    per_rank = []
    for rank in range(world):
        model = make_model()
        generator = torch.Generator().manual_seed(rank)
        x, y = torch.randn(5, 8, generator=generator), torch.randn(5, 4, generator=generator)
        nn.functional.mse_loss(model(x), y).backward()
        per_rank.append([p.grad.clone() for p in model.parameters()])
    return per_rank, [sum(grads) / world for grads in zip(*per_rank)]


@pytest.mark.parametrize("kind", ["torch", "ddpkit"])
def test_allreduce_hook_gives_the_same_gradients_as_no_hook(pool: WorkerPool, kind: str) -> None:
    plain = pool.run(hooked_gradients, kind, "none", timeout=60)
    hooked = pool.run(hooked_gradients, kind, "allreduce", timeout=60)
    for (a, _), (b, _) in zip(plain, hooked):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["torch", "ddpkit"])
@pytest.mark.parametrize("hook_name", ["fp16", "bf16", "fp16_wrapper", "bf16_wrapper"])
def test_compression_averages_within_the_format_and_halves_the_bytes(pool: WorkerPool, kind: str,
                                                                      hook_name: str) -> None:
    _, mean = local_and_mean_gradients(pool.world_size)
    numel = sum(p.numel() for p in make_model().parameters())
    flags = len(list(make_model().parameters()))
    # On ddpkit, hooks that average elementwise carry the negotiation flags (one per parameter) in
    # their buffer; the wrappers see gradients only. Either way compression halves the bytes exactly.
    carries_flags = kind == "ddpkit" and not hook_name.endswith("wrapper")
    elements = numel + (flags if carries_flags else 0)
    full = pool.run(hooked_gradients, kind, "allreduce", timeout=60)
    compressed = pool.run(hooked_gradients, kind, hook_name, timeout=60)
    for (grads, sent), (_, full_sent) in zip(compressed, full):
        assert sent == 2 * elements  # two bytes per element on the wire, where fp32 takes four
        assert full_sent == 4 * (numel + (flags if kind == "ddpkit" else 0))
        for grad, expected in zip(grads, mean):
            atol = TOLERANCE[hook_name] * expected.abs().max().item()
            torch.testing.assert_close(grad, expected, rtol=0, atol=atol)


@pytest.mark.parametrize("kind", ["torch", "ddpkit"])
def test_noop_hook_keeps_local_gradients(pool2: WorkerPool, kind: str) -> None:
    per_rank, _ = local_and_mean_gradients(2)
    for rank, (grads, sent) in enumerate(pool2.run(hooked_gradients, kind, "noop", timeout=60)):
        assert sent == 0
        assert all(torch.allclose(g, e) for g, e in zip(grads, per_rank[rank]))


class Scaled(nn.Module):
    """loss = <w, c>, so w.grad is exactly c: each rank chooses its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c).sum()


def chosen_gradient(kind: str, hook_name: str, values: list[list[float]]) -> list[float]:
    model = wrap(Scaled(), kind)
    hook, wrapper = HOOKS[hook_name]
    register_ddp_comm_hook(model, ddp_comm_hook=hook, ddp_comm_wrapper=wrapper)
    model(torch.tensor(values[dist.get_rank()])).backward()
    return model.module.w.grad.tolist()


@pytest.mark.parametrize("kind", ["torch", "ddpkit"])
def test_a_gradient_beyond_fp16_whose_mean_fits_survives(pool2: WorkerPool, kind: str) -> None:
    # 100000 does not fit fp16 (max 65504); the mean 50000 does. Casting first would give inf.
    values = [[100000.0, 1.0, -70000.0, 0.5], [0.0, 3.0, 0.0, 0.5]]
    for grad in pool2.run(chosen_gradient, kind, "fp16", values, timeout=30):
        assert grad == pytest.approx([50000.0, 2.0, -35000.0, 0.5], rel=1e-3)


@pytest.mark.parametrize("hook_name", ["fp16", "bf16"])
def test_non_finite_values_stay_non_finite(pool2: WorkerPool, hook_name: str) -> None:
    values = [[math.nan, math.inf, 1.0, 1.0], [1.0, 1.0, 1.0, -math.inf]]
    for grad in pool2.run(chosen_gradient, "ddpkit", hook_name, values, timeout=30):
        assert math.isnan(grad[0]) and grad[1] == math.inf and grad[2] == 1.0 and grad[3] == -math.inf
