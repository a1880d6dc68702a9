"""A module wrapped for data parallelism (``wrap``: ddpkit's DDP or torch's, batch norm synchronised
over the group), and the blocks a training loop puts around it, for either DDP: ``no_sync``
(accumulate gradients locally) and ``join`` (ranks with different numbers of batches finish
cleanly); a plain block for a model that is not wrapped."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ddpkit.parallel.batchnorm import SyncBatchNorm
from ddpkit.parallel.ddp import DistributedDataParallel

__all__ = ["join", "no_sync", "wrap"]


def wrap(model: nn.Module, device: torch.device, ddp_kwargs: Mapping[str, Any], sync_batchnorm: bool = False,
         use_torch_ddp: bool = False) -> nn.Module:
    """``model`` (on ``device``) in ddpkit's DistributedDataParallel, or torch's with ``use_torch_ddp``;
    with ``sync_batchnorm`` its batch norms first become synchronised ones (torch's on CUDA, where
    they have fused kernels; ddpkit's elsewhere, where torch's do not run)."""
    if sync_batchnorm:
        synchronised = nn.SyncBatchNorm if device.type == "cuda" else SyncBatchNorm
        model = synchronised.convert_sync_batchnorm(model)
    if use_torch_ddp:
        device_ids = [device] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs)
    return DistributedDataParallel(model, **ddp_kwargs)


def no_sync(model: nn.Module | None) -> contextlib.AbstractContextManager[Any]:
    """The model's ``no_sync()`` when it has one."""
    method = getattr(model, "no_sync", None)
    return method() if callable(method) else contextlib.nullcontext()


def join(model: nn.Module | None, shadow_step: Callable[[], object] | None = None) -> contextlib.AbstractContextManager[Any]:
    """ddpkit's ``DistributedDataParallel.join`` (see it for ``shadow_step``), or torch's ``Join``
    around torch's DDP (which has no ``shadow_step``)."""
    if isinstance(model, DistributedDataParallel):
        return model.join(shadow_step)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        if shadow_step is not None:
            raise ValueError("shadow_step needs ddpkit's DistributedDataParallel; torch's Join only shadows "
                             "its DDP's own reductions. Drop use_torch_ddp=True, or call collectives after the block.")
        from torch.distributed.algorithms.join import Join

        return Join([model])
    return contextlib.nullcontext()
