"""The same training with Lightning's Trainer(strategy="ddp", accelerator="cpu")."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = common.make_model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return common.loss(self.layer(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        common.kill_if_asked(self.global_rank, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=common.LR)


world, devices = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
# Lightning's own sampler shuffles; the one given here keeps the order of the reference.
trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=devices, num_nodes=world // devices, max_epochs=1,
                     use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
data = common.dataset(world)
sampler = DistributedSampler(data, num_replicas=world, rank=int(os.environ["RANK"]), shuffle=False)
module = Regression()
trainer.fit(module, DataLoader(data, batch_size=common.BATCH, sampler=sampler))
common.finish(trainer.global_rank, trainer.world_size, module.layer)
torch.distributed.destroy_process_group()
common.settle()
