"""A plain torchrun script: torch.distributed's env:// connection and torch's DDP, nothing of ddpkit."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = torch.nn.parallel.DistributedDataParallel(common.make_model())
optimizer = torch.optim.SGD(model.parameters(), lr=common.LR)
data = common.dataset(world)
for step, (x, y) in enumerate(DataLoader(data, batch_size=common.BATCH, sampler=DistributedSampler(data, shuffle=False))):
    optimizer.zero_grad()
    common.loss(model(x), y).backward()
    optimizer.step()
    common.kill_if_asked(rank, step)
common.finish(rank, world, model.module)
dist.destroy_process_group()
common.settle()
