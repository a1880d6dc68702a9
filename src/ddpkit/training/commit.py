"""The optimizer's step as the training side's commit point, followed in one place.

Every part of the training side that must know a step was taken listens here, never on the
optimizer itself, and runs after each step in the order of ``Stage``:

1. ``COUNT``: the loop counts it (``ResumableLoop``: ``progress.steps``), which the later stages read;
2. ``COMMIT``: the recovery commits the batch (or window) trained and keeps what a redo starts from
   (``InPlaceRecovery``, ``TrainerRecovery``: the buffers, the random state, the position);
3. ``CHECK``: the replica check runs when it is due (``ReplicaCheck.run``), comparing the state
   just committed.

What the DDP module does around the step is its own, not the commit's: timing it
(``DistributedDataParallel.time_optimizer``) and, with ``overlap_optimizer``, deferring it to the
next forward (``parallel.step_overlap``), which then tells the recovery when it is applied.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["OptimizerCommits", "Stage"]


class Stage(enum.IntEnum):
    """What runs after an optimizer step, in this order."""

    COUNT = 1
    COMMIT = 2
    CHECK = 3


class OptimizerCommits:
    """The one step hook of the training side's on ``optimizer``; listeners run in ``Stage`` order
    (those of one stage in the order they were added)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._listeners: dict[Stage, list[Callable[[], None]]] = {stage: [] for stage in Stage}
        optimizer.register_step_post_hook(self._commit)

    def after_each_step(self, stage: Stage, listener: Callable[[], None]) -> None:
        """Run ``listener`` after every step of the optimizer, at ``stage``."""
        self._listeners[stage].append(listener)

    def _commit(self, *_: Any) -> None:
        for stage in Stage:
            for listener in self._listeners[stage]:
                listener()
