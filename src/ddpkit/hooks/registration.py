"""``register_ddp_comm_hook``: Lightning's way of registering a hook on a DDP module (torch's or ddpkit's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from ddpkit.hooks.contract import NamesParameters

__all__ = ["register_ddp_comm_hook"]


HookFn = Callable[[Any, Any], "torch.futures.Future[Tensor]"]


@runtime_checkable
class _DataParallelModule(Protocol):
    """torch's DistributedDataParallel or ddpkit's: the wrapped module and ``register_comm_hook``."""

    module: torch.nn.Module

    def register_comm_hook(self, state: object, hook: HookFn) -> Any: ...


def register_ddp_comm_hook(
    model: torch.nn.Module,
    ddp_comm_state: object | None = None,
    ddp_comm_hook: HookFn | None = None,
    ddp_comm_wrapper: Callable[[HookFn], HookFn] | None = None,
) -> None:
    """Register a communication hook ``hook(state, bucket) -> Future[Tensor]`` on a DDP module.

    Works with ``torch.nn.parallel.DistributedDataParallel`` and with ddpkit's own module.
    ``ddp_comm_wrapper`` (e.g. ``fp16_compress_wrapper``) wraps ``ddp_comm_hook``. Nothing is
    registered when no hook is given.
    """
    if ddp_comm_hook is None:
        if ddp_comm_wrapper is not None:
            raise ValueError(
                f"ddp_comm_wrapper={getattr(ddp_comm_wrapper, '__name__', ddp_comm_wrapper)!r} was given without "
                "ddp_comm_hook: a wrapper changes another hook. Pass the hook to wrap too, "
                "e.g. ddp_comm_hook=ddpkit.hooks.allreduce_hook."
            )
        return
    if not isinstance(model, _DataParallelModule):
        raise TypeError(
            f"register_ddp_comm_hook needs a DistributedDataParallel module (torch's or ddpkit's), got "
            f"{type(model).__name__}. Wrap the model first, e.g. model = ddpkit.DistributedDataParallel(model)."
        )
    hook = ddp_comm_wrapper(ddp_comm_hook) if ddp_comm_wrapper is not None else ddp_comm_hook
    if isinstance(ddp_comm_state, NamesParameters):  # torch's buckets carry no parameter names
        ddp_comm_state.name_parameters(model.module)
    model.register_comm_hook(state=ddp_comm_state, hook=hook)
