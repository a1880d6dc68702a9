"""ddpkit's DistributedDataParallel combined with what users combine it with, against one process
on the concatenated batch: frozen parameters, sparse gradients, ..."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpkit.ddp import DistributedDataParallel
from ddpkit.testing import WorkerPool
from test_ddp import global_batch, make_mlp, shard


# --- requires_grad changed after wrapping ---------------------------------------------------------

FREEZE_SCHEDULE = {0: "2.weight", 2: None}  # step -> parameter frozen from then on (None: unfreeze all)


def apply_freeze_schedule(module: nn.Module, step: int) -> None:
    if step in FREEZE_SCHEDULE:
        frozen = FREEZE_SCHEDULE[step]
        for name, parameter in module.named_parameters():
            parameter.requires_grad_(name != frozen)


def sgd_with_freezing(model: nn.Module, module: nn.Module, world: int, rank: int | None, steps: int) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(steps):
        apply_freeze_schedule(module, step)
        x, y = global_batch(world, step)
        if rank is not None:
            x, y = shard(x, rank), shard(y, rank)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in module.parameters()]


def train_with_freezing(steps: int, use_torch_ddp: bool) -> list[torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    module = make_mlp()
    # torch's DDP needs find_unused_parameters for a parameter that stops getting gradients.
    model = (nn.parallel.DistributedDataParallel(module, find_unused_parameters=True) if use_torch_ddp
             else DistributedDataParallel(module))
    return sgd_with_freezing(model, module, world, rank, steps)


def test_a_parameter_frozen_after_wrapping_then_unfrozen_trains_as_one_process(pool: WorkerPool) -> None:
    """Frozen before the first synchronised backward (whose bucket rebuild re-hooked every
    parameter and raised), then unfrozen: the same parameters as one process, and as torch's DDP."""
    module = make_mlp()
    expected = sgd_with_freezing(module, module, pool.world_size, None, 4)
    for framework in (False, True):
        for params in pool.run(train_with_freezing, 4, framework, timeout=60):
            for actual, wanted in zip(params, expected):
                torch.testing.assert_close(actual, wanted, rtol=0, atol=1e-6)
