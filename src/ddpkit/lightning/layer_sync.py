"""``Trainer(sync_batchnorm=True)`` with ddpkit's strategy: batch norm synchronised by ddpkit's
``SyncBatchNorm`` (through the diagnostics seam, following a group that shrank) on CPU, by torch's
on CUDA (fused kernels), and reverted to plain batch norm after fitting as Lightning's is."""

from __future__ import annotations

import torch
from lightning.pytorch.plugins.layer_sync import LayerSync
from torch import Tensor, nn

from ddpkit.parallel.batchnorm import SyncBatchNorm, share_batch_norm_state

__all__ = ["DdpkitSyncBatchNorm"]


class DdpkitSyncBatchNorm(LayerSync):
    """Lightning's ``LayerSync`` for ddpkit's strategy (``device``: where the model trains)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def apply(self, model: nn.Module) -> nn.Module:
        synchronised = nn.SyncBatchNorm if self.device.type == "cuda" else SyncBatchNorm
        return synchronised.convert_sync_batchnorm(model)

    def revert(self, model: nn.Module) -> nn.Module:
        converted = model
        if isinstance(model, (SyncBatchNorm, nn.SyncBatchNorm)):
            converted = _AnyBatchNorm(model.num_features, model.eps, model.momentum, model.affine,
                                      model.track_running_stats)
            share_batch_norm_state(model, converted)
        for name, child in model.named_children():
            converted.add_module(name, self.revert(child))
        return converted


class _AnyBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Plain batch norm of any dimension: the layer a synchronised one was made from is not kept."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"batch norm expects an input of shape (N, C, ...), got {tuple(input.shape)}")
