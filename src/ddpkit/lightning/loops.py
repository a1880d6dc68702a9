"""Lightning's loops as in-place recovery moves them inside ``Trainer.fit``: a batch trained again
through the fit loop's own closure (``redo_batch``), a checkpoint's progress moved back over the
batches trained again (``move_back``), and the validation loop set up to run again from its start
(``start_again``). Lightning's private attributes are touched here only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

__all__ = ["forget_loader", "move_back", "redo_batch", "run_through", "start_again"]


def run_through(loop: Any, runner: Callable[[Callable[[], Any], Any], Any]) -> None:
    """Lightning's ``loop`` runs as ``runner(loop's own run, loop)`` from now on (once: a loop
    already run through a runner keeps it)."""
    if getattr(loop.run, "_ddpkit_runner", False):
        return
    run = loop.run

    def run_through_runner() -> Any:
        return runner(run, loop)

    run_through_runner._ddpkit_runner = True  # type: ignore[attr-defined]
    loop.run = run_through_runner


def start_again(loop: Any, trainer: pl.Trainer | None, progress: dict[str, Any]) -> None:
    """Lightning's validation loop, as before it ran: its batches' progress back to ``progress`` (the
    totals as the run began: a replacement that loads a checkpoint with an unfinished run in them
    takes it for a validation to finish first), the values it logged dropped, the module's mode
    back, its loader to be set up again (for the world the survivors form now: Lightning's sampler
    then deals them the replacements' rows too)."""
    loop.batch_progress.total.load_state_dict(progress)
    if trainer is not None:
        trainer._logger_connector.reset_results()
        loop._module_mode.restore(trainer.lightning_module)
    forget_loader(loop)


def forget_loader(loop: Any) -> None:
    """Lightning's evaluation ``loop`` sets its loader up again when it next runs (for the world of
    then: the survivors' part while they run it again, the whole world after they rejoin)."""
    if loop._data_fetcher is not None:
        loop._data_fetcher.teardown()
        loop._data_fetcher = None
    loop._combined_loader = None


def redo_batch(trainer: pl.Trainer, optimizer: torch.optim.Optimizer, batch: Any, batch_idx: int) -> None:
    """Train ``batch`` again as the fit loop trained it: Lightning's closure of the batch (its
    ``training_step``, the loss scaled for the accumulation, the window's ``zero_grad`` on its first
    batch, the backward through the strategy with its hooks)."""
    loop = trainer.fit_loop.epoch_loop
    closure = loop.automatic_optimization._make_closure(loop._build_kwargs(OrderedDict(), batch, batch_idx),
                                                        optimizer, batch_idx)
    closure()
    closure.consume_result()


def move_back(checkpoint: dict[str, Any], batches: int) -> None:
    """Count ``batches`` fewer trained in the checkpoint's training loop: its progress (every
    counter at the batches done, as after an optimizer step) and ``ResumableBatches``' position."""
    loop = checkpoint["loops"]["fit_loop"]
    progress = loop["epoch_loop.batch_progress"]
    for counts in (progress["total"], progress["current"]):
        done = counts["processed"] - batches
        counts.update(ready=done, started=done, processed=done, completed=done)
    for state in loop["state_dict"].get("combined_loader", []) or []:
        if isinstance(state, dict) and set(state) == {"epoch", "batches_trained"}:
            state["batches_trained"] -= batches
