"""``DDPStrategy(overlap_optimizer=True)`` inside Lightning's Trainer: which optimizer the mode
defers (``the_one_optimizer``), and the callbacks the strategy puts first.

The mode keeps a step's gradients in flight past the backward (docs/ddp.md). Lightning reads them
there when the fit clips (``gradient_clip_val``) or a hook of the user's may:
``on_after_backward`` and ``on_before_optimizer_step`` (a gradient norm logged, as Lightning's docs
show with ``grad_norm``), ``configure_gradient_clipping``. A hook cannot say whether it reads them,
so a module or callback that overrides one has the gradients awaited before any of them runs
(``AwaitGradients``): those steps are exact and not overlapped, instead of raising
``GradientsNotReducedError`` in the user's hook.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden

from ddpkit.logs import get_logger
from ddpkit.parallel.ddp import DistributedDataParallel

__all__ = ["ApplyTheLastStep", "AwaitGradients", "gradient_readers", "the_one_optimizer"]

_log = get_logger("lightning")

# The hooks that run after the backward and before the step, where a gradient may be read.
_MODULE_HOOKS = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping")
_CALLBACK_HOOKS = ("on_after_backward", "on_before_optimizer_step")


def the_one_optimizer(optimizers: list[torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """The optimizer ``configure_optimizers`` returned, for ``overlap_optimizer=True``; refused unless one."""
    if len(optimizers) != 1:
        raise ValueError(f"DDPStrategy(overlap_optimizer=True) defers one optimizer's step, and configure_optimizers "
                         f"returned {len(optimizers)}. Return one optimizer over all of the model's parameters, or "
                         "leave overlap_optimizer off.")
    return optimizers[0]


def gradient_readers(trainer: pl.Trainer, module: pl.LightningModule | None, callbacks: list[Callback]) -> list[str]:
    """What in this fit may read the gradients between the backward and the step: the clip, and
    each hook of ``_MODULE_HOOKS``/``_CALLBACK_HOOKS`` the module or a callback overrides."""
    readers = [f"Trainer(gradient_clip_val={trainer.gradient_clip_val})"] if trainer.gradient_clip_val else []
    readers += [f"{type(module).__name__}.{hook}" for hook in _MODULE_HOOKS
                if module is not None and is_overridden(hook, module)]
    readers += [f"{type(callback).__name__}.{hook}" for callback in callbacks for hook in _CALLBACK_HOOKS
                if is_overridden(hook, callback, Callback)]
    return readers


class AwaitGradients(Callback):
    """Put first: every gradient of the backward is awaited before any ``on_after_backward`` (the
    callbacks' run before the module's), so the hooks after it and Lightning's clip read them."""

    def __init__(self, model: DistributedDataParallel, readers: list[str]) -> None:
        self._model = model
        _log.info(f"ddpkit DDPStrategy(overlap_optimizer=True): the gradients are awaited after each backward for "
                  f"{', '.join(readers)}, which may read them: those steps are exact and not overlapped (a hook "
                  "that reads no gradient costs the overlap too: which ones do cannot be told).")

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._model.settle()


class ApplyTheLastStep(Callback):
    """The fit's last step, deferred to a forward that will not come, applied before any
    ``on_train_end`` (this callback goes first, the module's hook after the callbacks'), so that
    they and the module the fit leaves see the parameters after every step."""

    def __init__(self, model: DistributedDataParallel) -> None:
        self._model = model

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._model.settle()
