"""The same training with Hugging Face Accelerate's Accelerator() loop."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

accelerator = Accelerator(cpu=True)
world = accelerator.num_processes
model = common.make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=common.LR)
loader = DataLoader(common.dataset(world), batch_size=common.BATCH)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for step, (x, y) in enumerate(loader):
    optimizer.zero_grad()
    accelerator.backward(common.loss(model(x), y))
    optimizer.step()
    common.kill_if_asked(accelerator.process_index, step)
common.finish(accelerator.process_index, world, accelerator.unwrap_model(model))
accelerator.end_training()  # destroys the process group
common.settle()
