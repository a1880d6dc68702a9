"""What the four training scripts of the launch-mode matrix share: the data, the model, the
fault, the report, and the single-process reference they are checked against.

Each rank trains ``STEPS`` steps of plain SGD on its share of the same data set (``BATCH``
samples a step, the global batch being ``BATCH * world``); rank 0 saves the final parameters to
``final.pt`` in the working folder. With ``KILL_RANK=R`` that rank kills itself (SIGKILL) after
step 1 of the first start, as a lost worker does; the restarted (or replacing) one trains again.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

STEPS, BATCH, LR = 3, 4, 0.1


def dataset(world: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    samples = STEPS * BATCH * world
    return TensorDataset(torch.randn(samples, 8, generator=generator), torch.randn(samples, 2, generator=generator))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(8, 2)


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def attempt() -> int:
    """Which start of the workers this is (torchrun's variable; ``ddpkit run`` sets it too)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def kill_if_asked(rank: int, step: int) -> None:
    """SIGKILL this process after ``step`` 1 when it is ``KILL_RANK`` in the first start (and not
    a process that replaced a lost rank in place: ``DDPKIT_GENERATION``)."""
    first = attempt() == 0 and int(os.environ.get("DDPKIT_GENERATION", "0")) == 0
    if first and step == 1 and os.environ.get("KILL_RANK") == str(rank):
        os.kill(os.getpid(), signal.SIGKILL)


def finish(rank: int, world: int, model: nn.Module) -> None:
    """Report the world (the issue's ``WORLD4 SUM4``), save rank 0's parameters, pass a barrier."""
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"WORLD{world} SUM{int(total.item())} RANK{rank} ATTEMPT{attempt()}", flush=True)
    if rank == 0:
        torch.save({name: value.detach().clone() for name, value in model.state_dict().items()}, "final.pt")
    dist.barrier()  # torch 2.13 + Gloo: a group destroyed without one can abort the process at exit


def settle() -> None:
    """Let Gloo's threads free their last work before the interpreter ends (the same hazard)."""
    time.sleep(0.1)


def reference(world: int) -> dict[str, torch.Tensor]:
    """One process trained on the concatenated global batches: what every rank must end with."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = dataset(world).tensors
    for step in range(STEPS):
        rows = slice(step * BATCH * world, (step + 1) * BATCH * world)
        optimizer.zero_grad()
        loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}
