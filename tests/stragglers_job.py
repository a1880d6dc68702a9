"""A job for tests/test_stragglers.py: ddpkit's loop on an MLP under ``ddpkit run --report-every 1``,
long enough for several windows (``STEPS``). ``PIN=1``: each rank pins itself to the core of its
rank (the test slows one core with a busy process pinned to it; two ranks on one core, or threads
of two ranks on both, would slow each other at random). ``SLOW_DATA=RANK``: that
rank's data loader takes ``DATA_SECONDS`` (default 0.003) more for each batch, as a slow disk would.
``OVERLAP=1``: the strategy's ``overlap_optimizer`` (the model's two buckets end in the next forward)."""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import ddpkit

BATCH, FEATURES = 64, 256
# Hidden width: a wider model gives each step's compute several of the scheduler's slices.
WIDTH = int(os.environ.get("WIDTH", "512"))


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, count: int, delay: float) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(count, FEATURES, generator=generator), torch.randn(count, 1, generator=generator)
        self.delay, self.drawn = delay, 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.drawn += 1
        if self.delay and self.drawn % BATCH == 1:  # once a batch, whichever samples the rank's share holds
            time.sleep(self.delay)
        return self.x[index], self.y[index]


def main() -> None:
    if os.environ.get("PIN"):
        os.sched_setaffinity(0, {int(os.environ["RANK"]) % (os.cpu_count() or 1)})
    strategy = ddpkit.DDPStrategy(overlap_optimizer=os.environ.get("OVERLAP") == "1")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))
    model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    slow = os.environ.get("SLOW_DATA") == os.environ["RANK"]
    steps = int(os.environ.get("STEPS", "1000"))
    samples = Samples(BATCH * strategy.world_size * 50, float(os.environ.get("DATA_SECONDS", "0.003")) if slow else 0.0)
    loader = strategy.setup_dataloader(DataLoader(samples, batch_size=BATCH))
    for _ in strategy.epochs(steps // 50):
        for x, y in strategy.batches(loader):
            with strategy.step():
                optimizer.zero_grad()
                strategy.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
    print(f"rank {strategy.global_rank}: {strategy.progress.steps} steps", flush=True)
    strategy.teardown()


if __name__ == "__main__":
    main()
