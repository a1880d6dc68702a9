"""Lightning's DDP plugin hooks that plugin code calls around its training step, each doing what
Lightning's did where it applies here; ``DDPStrategy`` has them through this base class."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ddpkit.parallel.ddp import DistributedDataParallel

__all__ = ["LightningPluginHooks"]


class LightningPluginHooks:
    """``model_to_device``, ``pre_dispatch``, ``post_dispatch``, ``on_before_forward``,
    ``pre_backward``, ``get_model_from_plugin`` and ``print``, over the strategy's ``model``,
    ``root_device``, ``barrier`` and ``is_global_zero``."""

    model: nn.Module | None

    @property
    def root_device(self) -> torch.device:
        raise NotImplementedError

    @property
    def is_global_zero(self) -> bool:
        raise NotImplementedError

    def barrier(self, name: str | None = None) -> None:
        raise NotImplementedError

    def model_to_device(self, model: nn.Module | None = None) -> nn.Module:
        """``model`` (by default the strategy's) on this process's device."""
        target = model if model is not None else self.model
        if target is None:
            raise ValueError("model_to_device needs a model: pass one, or call setup(model, optimizer) first.")
        return target.to(self.root_device)

    def pre_dispatch(self) -> None:
        """Before training starts: make sure every process is connected and ready."""
        self.barrier("pre_dispatch")

    def post_dispatch(self) -> None:
        """After training ends: wait for every process, so none tears down while others still talk."""
        self.barrier("post_dispatch")

    def on_before_forward(self, model: nn.Module, *args: Any) -> tuple[Any, ...]:
        """Move the batch to this process's device."""
        return tuple(a.to(self.root_device) if isinstance(a, Tensor) else a for a in args)

    def pre_backward(self, closure_loss: Tensor, *lightning_arguments: Any) -> None:
        """Lightning's hook before ``backward``: nothing to do. Lightning prepared torch DDP there for a
        loss that bypassed DDP's forward; here torch's DDP prepares in its forward and ddpkit's at
        the backward's first gradient. Lightning 1.3's further arguments are accepted."""

    def get_model_from_plugin(self, model: nn.Module) -> nn.Module:
        """The user's module inside a DDP wrapper (or the model itself)."""
        if isinstance(model, (DistributedDataParallel, nn.parallel.DistributedDataParallel)):
            return model.module
        return model

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.is_global_zero:
            print(*args, **kwargs)
