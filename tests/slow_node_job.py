"""A job for tests/test_straggler_replacement.py and benchmarks/straggler_replacement.py: ddpkit's
loop on a small MLP, one epoch of ``STEPS`` optimizer steps (default 1500) of ``BATCH`` samples a rank,
the data in order (no shuffle: the test knows every rank's batches). ``SLOW_NODE_SECONDS``, given to
a node's launcher: the data loader of each rank there but rank 0 waits that long once a batch, as a
slow disk would (a spare node's launcher, not given it, is not slow). Rank 0 saves the final
parameters to final.pt."""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import ddpkit

BATCH = 4


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, delay: float, world: int) -> None:
        self.x, self.y, self.delay, self.world = x, y, delay, world

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay and index % (BATCH * self.world) < self.world:  # once a batch of this rank's share
            time.sleep(self.delay)
        return self.x[index], self.y[index]


def main() -> None:
    strategy = ddpkit.DDPStrategy()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    generator = torch.Generator().manual_seed(1)
    world = strategy.world_size
    samples = int(os.environ.get("STEPS", "1500")) * BATCH * world
    x, y = torch.randn(samples, 8, generator=generator), torch.randn(samples, 2, generator=generator)
    slow = float(os.environ.get("SLOW_NODE_SECONDS", "0")) if os.environ["RANK"] != "0" else 0.0
    loader = strategy.setup_dataloader(DataLoader(Samples(x, y, slow, world), batch_size=BATCH))
    for _ in strategy.epochs(1):
        for xb, yb in strategy.batches(loader):
            with strategy.step():
                optimizer.zero_grad()
                strategy.backward(nn.functional.mse_loss(model(xb), yb))
                optimizer.step()
    if strategy.global_rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], "final.pt")
    print(f"rank {strategy.global_rank} done, recovered {strategy.recovered_in_place}", flush=True)
    strategy.teardown()


if __name__ == "__main__":
    main()
