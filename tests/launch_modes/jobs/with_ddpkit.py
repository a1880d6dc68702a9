"""The same training with ddpkit's DDPStrategy and its loop (which in-place recovery needs)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import torch
from torch.utils.data import DataLoader

import ddpkit

strategy = ddpkit.DDPStrategy()
model = common.make_model()
model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=common.LR))
loader = strategy.setup_dataloader(DataLoader(common.dataset(strategy.world_size), batch_size=common.BATCH))
for _ in strategy.epochs(1):
    for x, y in strategy.batches(loader):
        with strategy.step():
            optimizer.zero_grad()
            strategy.backward(common.loss(model(x), y))
            optimizer.step()
        common.kill_if_asked(strategy.global_rank, strategy.progress.batch)
common.finish(strategy.global_rank, strategy.world_size, model.module)
strategy.teardown()
