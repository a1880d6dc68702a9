"""What a training loop keeps beside the model and the optimizer, by name: the state that in-place
recovery moves to a replacement and holds equal on every rank, and that the replica check compares.

A real loop keeps more than parameters and optimizer state, and each of these decides the next
step: a learning-rate schedule, AMP's ``GradScaler`` (its scale), an EMA copy of the weights
(``torch.optim.swa_utils.AveragedModel``, or one's own), a step counter, a stateful data loader, a
metric accumulator. ``DDPStrategy.setup(model, optimizer, scheduler=..., scaler=...)`` and
``DDPStrategy.track(name, obj)`` hand them over: any object with ``state_dict()`` and
``load_state_dict()`` (torch.distributed.checkpoint's ``Stateful``).

- **A survivor** that did not send the state loads every object's from the sender.
- **A replacement** receives the state in ``setup``, before the script made what it tracks after
  ``setup`` (a schedule built on the wrapped optimizer, say): each such state waits until
  ``track`` names its object, and is loaded then. A schedule's constructor sets the optimizer's
  learning rates, so once an object is loaded late the optimizer's hyperparameters are set back
  to those received.
- **Before the first step** (and after each recovery), ``check_complete`` refuses what would
  silently diverge: a state received for a name this process never tracked, and an object it
  could have moved but was not handed (a learning-rate schedule of the optimizer, an enabled
  ``GradScaler``, an ``AveragedModel``), naming it.

Tensors arrive on the CPU (as ``torch.load(..., map_location="cpu")`` gives them): torch's own
``load_state_dict`` methods copy them to their device; one's own must too.
"""

from __future__ import annotations

import collections
import copy
import gc
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.optim.lr_scheduler import ChainedScheduler, LRScheduler, SequentialLR
from torch.optim.swa_utils import AveragedModel

__all__ = ["BufferSnapshot", "Stateful", "TrackedState", "UntrackedStateError"]


@runtime_checkable
class Stateful(Protocol):
    """What ``track`` takes: an object that says and takes its state (torch.distributed.checkpoint's ``Stateful``)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


class UntrackedStateError(ValueError):
    """Under in-place recovery, state that decides the next step would not be the same on every
    rank after a recovery: an object not handed to ``DDPStrategy.track``, or one tracked on some
    ranks only. Raised on every rank before the step, naming it."""


class TrackedState:
    """The objects a loop keeps, by name, and the states received for them (in a replacement) that
    wait for their object."""

    def __init__(self) -> None:
        self._objects: dict[str, Stateful] = {}
        self._received: dict[str, Any] = {}  # states received for names no object is tracked under yet
        # The optimizer and its hyperparameters as received (set back after an object loaded late).
        self._optimizer: torch.optim.Optimizer | None = None
        self._hyperparameters: list[dict[str, Any]] = []

    def track(self, name: str, obj: Any) -> None:
        """Hold ``obj`` under ``name``; a state received for ``name`` is loaded into it now."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"DDPStrategy.track needs a non-empty name (a str); got {name!r}.")
        if not isinstance(obj, Stateful):
            raise TypeError(f"DDPStrategy.track({name!r}, ...) needs an object with state_dict() and load_state_dict() "
                            f"(torch.distributed.checkpoint's Stateful); got a {type(obj).__name__}. Wrap what it keeps "
                            "in a small class with both methods.")
        if name in self._objects and self._objects[name] is not obj:
            raise ValueError(f"DDPStrategy.track: the name {name!r} already tracks a {type(self._objects[name]).__name__}; "
                             "give each object a name of its own.")
        self._objects[name] = obj
        if name in self._received:
            obj.load_state_dict(self._received.pop(name))
            self._restore_hyperparameters()

    def items(self) -> Iterator[tuple[str, Stateful]]:
        return iter(sorted(self._objects.items()))

    def state_dicts(self) -> dict[str, Any]:
        """Every tracked object's state, by name (what a survivor sends)."""
        return {name: obj.state_dict() for name, obj in self._objects.items()}

    def receive(self, states: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """Load the sender's ``states`` (after ``optimizer`` loaded its own): into the objects tracked
        here, and keep the others until ``track`` names their objects."""
        self._optimizer = optimizer
        self._hyperparameters = [_hyperparameters(group) for group in optimizer.param_groups]
        for name, state in states.items():
            if name in self._objects:
                self._objects[name].load_state_dict(state)
            else:
                self._received[name] = state
        self._restore_hyperparameters()

    def copies(self, model: nn.Module | None = None) -> dict[str, Any]:
        """Every tracked object's state, copied (``restore`` puts it back), when a step is asked for
        and deferred (``overlap_optimizer``). An ``AveragedModel`` of ``model`` is not copied (a
        copy of the weights each step costs more than the average's update): its update reads the
        model's parameters, which stay guarded until the step is applied, so it cannot move before
        that. Its count of updates is kept instead, and ``restore`` checks it."""
        return {name: _UpdatesOf(obj.n_averaged.clone()) if isinstance(obj, AveragedModel) and model is not None
                and _averages(obj, model) else copy.deepcopy(obj.state_dict()) for name, obj in self._objects.items()}

    def restore(self, copies: Mapping[str, Any]) -> None:
        for name, state in copies.items():
            obj = self._objects[name]
            if not isinstance(state, _UpdatesOf):
                obj.load_state_dict(state)
            elif not isinstance(obj, AveragedModel) or not torch.equal(obj.n_averaged, state.count):
                raise RuntimeError(
                    f"in-place recovery: the AveragedModel tracked as {name!r} was updated after optimizer.step() and "
                    "before the forward applied that step (overlap_optimizer), from parameters the step does not "
                    "guard, so the recovery cannot put it back as it was. Call model.settle() before updating it.")

    def start_fresh_window(self) -> None:
        """A step is trained again from the last optimizer step: a ``GradScaler`` forgets that it
        unscaled or stepped in the step that was abandoned (its ``update`` would have)."""
        for _, obj in self.items():
            if isinstance(obj, torch.amp.GradScaler) and hasattr(obj, "_per_optimizer_states"):
                obj._per_optimizer_states = collections.defaultdict(torch.amp.grad_scaler._refresh_per_optimizer_state)

    def check_complete(self, optimizer: torch.optim.Optimizer | None, model: nn.Module | None,
                       look_for_untracked: bool = True) -> None:
        """``UntrackedStateError`` for a state received that no object took, or (``look_for_untracked``)
        an object of this process that a recovery would leave behind (a schedule of ``optimizer``, an
        enabled ``GradScaler``, an ``AveragedModel`` of ``model``) and that was not tracked. Once
        checked, the received hyperparameters are forgotten: training goes on from here."""
        self._hyperparameters, self._optimizer = [], None
        if self._received:
            names = ", ".join(repr(name) for name in sorted(self._received))
            raise UntrackedStateError(
                f"in-place recovery: the survivors track {names} (their state reached this process), but this process "
                f"did not track it by its first step. Call strategy.track(name, obj) for it on every rank, before the "
                "training loop, in the same place (a replacement runs the script from the top).")
        left_behind = self._left_behind(optimizer, model) if look_for_untracked else []
        if left_behind:
            raise UntrackedStateError(
                "in-place recovery would leave state behind: " + "; ".join(left_behind) + ". A replacement would "
                "start it afresh and the ranks would diverge silently. Hand it over before the loop: "
                "strategy.setup(model, optimizer, scheduler=..., scaler=...), or strategy.track(name, obj) for "
                "anything with state_dict()/load_state_dict().")

    def _left_behind(self, optimizer: torch.optim.Optimizer | None, model: nn.Module | None) -> list[str]:
        """What this process holds that a recovery would have to move and that is not tracked."""
        if optimizer is None:
            return []
        covered = {id(obj) for _, obj in self.items()}
        for _, obj in self.items():  # a chain's or a sequence's schedules travel in its state
            if isinstance(obj, (ChainedScheduler, SequentialLR)):
                covered.update(id(child) for child in obj._schedulers)
        marked = any("initial_lr" in group for group in optimizer.param_groups)
        found = []
        for obj in gc.get_objects():  # once per process: a pass over the heap's objects
            kind = type(obj)  # not isinstance: it reads __class__, which some of torch's objects warn about
            if id(obj) in covered or not issubclass(kind, (LRScheduler, torch.amp.GradScaler, AveragedModel)):
                continue
            if marked and issubclass(kind, LRScheduler) and getattr(obj, "optimizer", None) is optimizer:
                found.append(f"a learning-rate schedule ({kind.__name__}) steps the optimizer")
            elif issubclass(kind, torch.amp.GradScaler) and obj.is_enabled():
                found.append(f"a GradScaler (scale {obj.get_scale():g}) is enabled")
            elif issubclass(kind, AveragedModel) and model is not None and _averages(obj, model):
                found.append("an AveragedModel (EMA/SWA weights) averages the model")
        return sorted(set(found))

    def _restore_hyperparameters(self) -> None:
        """Set the optimizer's hyperparameters (learning rate, momentum, ...) back to those received:
        a schedule built after they arrived set its own in its constructor."""
        if self._optimizer is None:
            return
        for group, received in zip(self._optimizer.param_groups, self._hyperparameters):
            group.update({key: value.clone() if isinstance(value, torch.Tensor) else value
                          for key, value in received.items()})


def _hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value.clone() if isinstance(value, torch.Tensor) else value
            for key, value in group.items() if key != "params"}


class _UpdatesOf:
    """In ``copies``, for an ``AveragedModel`` left uncopied: its count of updates then."""

    def __init__(self, count: torch.Tensor) -> None:
        self.count = count


def _averages(averaged: AveragedModel, model: nn.Module) -> bool:
    """Whether ``averaged`` is an average of ``model``'s parameters (the same shapes, in order)."""
    shapes = [p.shape for p in averaged.module.parameters()]
    return bool(shapes) and shapes == [p.shape for p in model.parameters()]


class BufferSnapshot:
    """A module's buffers as of the last optimizer step: a forward that failed, or is trained again
    after a recovery, may have moved them (a batch norm's running statistics)."""

    def __init__(self, module: nn.Module | None = None) -> None:
        self.kept: list[torch.Tensor] = [] if module is None else [b.detach().clone() for b in module.buffers()]

    def keep(self, module: nn.Module) -> None:
        """Copy ``module``'s buffers as they are now into the snapshot."""
        for kept, buffer in zip(self.kept, module.buffers()):
            kept.copy_(buffer)

    def restore(self, module: nn.Module) -> None:
        """Put the snapshot back into ``module``'s buffers."""
        with torch.no_grad():
            for kept, buffer in zip(self.kept, module.buffers()):
                buffer.copy_(kept)
