"""The replica check: the ranks compare a fingerprint of what decides their next step, and a
difference is raised on every rank, naming what differs and on which ranks.

Data-parallel replicas stay bit for bit equal as long as every rank applies the same update to
the same state. When they do not (a state that a recovery did not move, a random number drawn
per rank, a rank that skipped a step), training goes on, silently wrong. The check makes that
loud. What is compared, each entry on its own so that the error can name it:

- each parameter and each buffer of the model (by name); buffers only where ddpkit's DDP module
  broadcasts them after each backward (``broadcast_buffers=True``, the default): with
  ``broadcast_buffers=False`` each rank keeps its own on purpose, and torch's DDP broadcasts them
  before the forward, so they differ between a forward and the next one;
- the optimizer: each parameter group's hyperparameters, and each parameter's state (momenta, step);
- each object tracked with ``DDPStrategy.track`` (a schedule, a ``GradScaler``, EMA weights...).

A tensor's fingerprint is the sum of its bits read as integers (exact, so equal replicas always
agree, and a change of any one element shows); the rest of a state (numbers, strings) is
hashed from its ``repr``. The ranks first all-gather three numbers (how many entries, a hash of
their names, a hash of their fingerprints); only when those differ do they gather every entry
to name the difference. The cost is a pass over the model's and optimizer's memory and a tiny
all-gather: ``benchmarks/replica_check.py`` measures it per step.

When: after every in-place recovery (replacement, shrink, grow), at the end of the first step
trained after it (once the step's block ran: a schedule stepped after ``optimizer.step()``, or a
learning rate set by hand from a counter that did not move, then shows), and every
``DDPKIT_CHECK_REPLICAS`` optimizer steps when that is set (0 or unset: never), in any mode (a loop
outside ``strategy.batches()`` is checked in its optimizer's step).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddpkit.comm.collectives import all_gather_ddp_if_available, all_gather_object
from ddpkit.logs import get_logger
from ddpkit.training.state import TrackedState
from ddpkit.variables import DDPKIT_CHECK_REPLICAS

__all__ = ["ReplicaCheck", "ReplicaMismatchError", "check_every", "compare_replicas", "fingerprints"]

_log = get_logger("recovery")

# Integer views of a tensor's elements by their size in bytes (bool and 1-byte types read as uint8).
_AS_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Tensors of at least this many elements are summed one by one; smaller ones together.
_SUMMED_ALONE = 1 << 16
# Fingerprints are folded to 63 bits, so that they fit an int64 tensor for the first comparison.
_MASK = (1 << 63) - 1
# How many entries that differ the error lists before "and N more".
_NAMED = 5


class ReplicaMismatchError(RuntimeError):
    """The ranks' replicas differ (raised on every rank alike by ``compare_replicas``)."""


def check_every() -> int:
    """``DDPKIT_CHECK_REPLICAS``: every how many optimizer steps the replicas are compared (0: never)."""
    value = os.environ.get(DDPKIT_CHECK_REPLICAS, "").strip()
    if not value:
        return 0
    try:
        every = int(value)
    except ValueError:
        raise ValueError(f"{DDPKIT_CHECK_REPLICAS}={value!r} is not a whole number of optimizer steps. Set e.g. 100 "
                         "(compare the replicas every 100 steps), or 0 to compare them only after a recovery.") from None
    return max(every, 0)


def fingerprints(module: nn.Module, optimizer: torch.optim.Optimizer | None, tracked: TrackedState | None = None,
                 buffers: bool = True) -> list[tuple[str, int]]:
    """(what, fingerprint) for each entry the check compares (the module docstring lists them);
    ``buffers``: the module's buffers too."""
    entries: list[tuple[str, int, list[Tensor]]] = []  # (what, hash of the rest, the tensors)
    for name, parameter in module.named_parameters():
        entries.append((f"parameter {name!r}", 0, [parameter]))
    for name, buffer in module.named_buffers() if buffers else ():
        entries.append((f"buffer {name!r}", 0, [buffer]))
    if optimizer is not None:
        names = {id(parameter): name for name, parameter in module.named_parameters()}
        for index, group in enumerate(optimizer.param_groups):
            for key, value in group.items():
                if key != "params":
                    rest, tensors = _apart(value)
                    entries.append((f"the optimizer's {key!r} of parameter group {index}", rest, tensors))
            for position, parameter in enumerate(group["params"]):
                if parameter in optimizer.state:
                    rest, tensors = _apart(optimizer.state[parameter])
                    named = names.get(id(parameter))
                    of = repr(named) if named is not None else f"parameter {position} of group {index}"
                    entries.append((f"the optimizer's state of {of}", rest, tensors))
    for name, obj in (tracked.items() if tracked is not None else iter(())):
        rest, tensors = _apart(obj.state_dict())
        entries.append((f"the tracked {name!r} ({type(obj).__name__})", rest, tensors))
    sums = _tensor_sums([tensor for _, _, tensors in entries for tensor in tensors])
    result, at = [], 0
    for what, rest, tensors in entries:
        value = rest
        for total in sums[at : at + len(tensors)]:
            value = _combine(value, total)
        at += len(tensors)
        result.append((what, value))
    return result


def compare_replicas(entries: list[tuple[str, int]], when: str, group: Any = None) -> None:
    """Compare ``entries`` (``fingerprints``) across the ranks of ``group``; ``ReplicaMismatchError``
    on every rank when they differ, naming up to five entries and the ranks that hold each value.
    ``when`` says where in training (for the message). Every rank must call it."""
    names = zlib.crc32("\n".join(what for what, _ in entries).encode())
    values = 0
    for _, value in entries:
        values = _combine(values, value)
    summary = torch.tensor([len(entries), names, values], dtype=torch.int64)
    gathered = all_gather_ddp_if_available(summary, group)
    if bool((gathered == gathered[0]).all()):
        return
    everyone: list[list[tuple[str, int]]] = all_gather_object(entries, group)
    raise ReplicaMismatchError(_describe(everyone, when))


def _describe(everyone: list[list[tuple[str, int]]], when: str) -> str:
    problems = []
    present = [{what for what, _ in entries} for entries in everyone]
    for what in sorted(set().union(*present) - present[0].intersection(*present[1:])):
        holding = [rank for rank, names in enumerate(present) if what in names]
        problems.append(f"{what} is kept on ranks {holding} only")
    if not problems:  # the same entries in the same order on every rank: compare them one by one
        for index, (what, _) in enumerate(everyone[0]):
            holders: dict[int, list[int]] = {}
            for rank, entries in enumerate(everyone):
                holders.setdefault(entries[index][1], []).append(rank)
            if len(holders) > 1:
                groups = sorted(holders.values(), key=lambda ranks: (-len(ranks), ranks))
                problems.append(f"{what}: ranks {groups[0]} hold one value, " +
                                ", ".join(f"ranks {ranks} another" for ranks in groups[1:]))
    shown = problems[:_NAMED] + ([f"and {len(problems) - _NAMED} more"] if len(problems) > _NAMED else [])
    return (f"the replicas differ {when}: " + "; ".join(shown) + ". Data-parallel ranks must hold the same state "
            "after every step. Under in-place recovery this is state the recovery did not move: hand every object "
            "that decides the next step to strategy.setup(model, optimizer, scheduler=..., scaler=...) or "
            "strategy.track(name, obj). Otherwise look for randomness drawn per rank outside torch's generator, or "
            "code that runs on some ranks only.")


def _apart(state: Any) -> tuple[int, list[Tensor]]:
    """The hash of ``state`` with each tensor replaced by a placeholder, and its tensors in order."""
    tensors: list[Tensor] = []

    def outline(value: Any) -> str:
        if isinstance(value, Tensor):
            tensors.append(value)
            return f"<tensor {value.dtype} {tuple(value.shape)}>"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{key!r}: {outline(item)}" for key, item in value.items()) + "}"
        if isinstance(value, (list, tuple)):
            return "[" + ", ".join(outline(item) for item in value) + "]"
        return _stable_repr(value)

    return zlib.crc32(outline(state).encode()), tensors


def _stable_repr(value: Any) -> str:
    """``repr`` without what differs between equal objects of two processes (their addresses)."""
    if callable(value) and not isinstance(value, type):
        return f"<callable {getattr(value, '__qualname__', type(value).__name__)}>"
    text = repr(value)
    return text if " at 0x" not in text else f"<{type(value).__name__}>"


def _tensor_sums(tensors: list[Tensor]) -> list[int]:
    """Each tensor's elements read as integers and summed (int64, wrapping), in one transfer to the
    host. Large tensors are summed one by one; small ones of one dtype together, flattened into one
    buffer by one call and summed by segment, since a few operations each would cost more in calls
    than in reading their bytes (a model of many small layers and their optimizer state)."""
    parts: list[Tensor] = []  # the sums, as 1-element or longer int64 vectors, in ``places`` order
    places: list[int] = []
    small: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    with torch.no_grad():
        for index, tensor in enumerate(tensors):
            if tensor.numel() < _SUMMED_ALONE and not tensor.is_complex() and tensor.element_size() in _AS_INTEGERS:
                small.setdefault((tensor.device, tensor.dtype), []).append(index)
            else:
                parts.append(_as_integers(tensor).sum().reshape(1))  # int64: integers sum in int64
                places.append(index)
        for (device, dtype), indices in small.items():
            group = [tensors[index] for index in indices]
            joined = torch._C._nn.flatten_dense_tensors(group).view(_AS_INTEGERS[torch.empty(0, dtype=dtype).element_size()])
            lengths = torch.tensor([tensor.numel() for tensor in group], device=device)
            segments = torch.repeat_interleave(torch.arange(len(group), device=device), lengths)
            parts.append(torch.zeros(len(group), dtype=torch.int64, device=device)
                         .index_add_(0, segments, joined.to(torch.int64)))
            places.extend(indices)
    sums = [0] * len(tensors)
    if parts:
        for place, value in zip(places, torch.cat([part.cpu() for part in parts]).tolist(), strict=True):
            sums[place] = int(value)
    return sums


def _as_integers(tensor: Tensor) -> Tensor:
    """``tensor``'s elements as a flat tensor of integers of the same size (its bits, not its values)."""
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    view = _AS_INTEGERS.get(flat.element_size())
    return flat.contiguous().view(view) if view is not None else flat.to(torch.float64).view(torch.int64)


def _combine(seed: int, value: int) -> int:
    """Fold ``value`` into ``seed`` (order matters: entries are compared position by position)."""
    return ((seed * 1_000_003) ^ (value & 0xFFFFFFFFFFFFFFFF)) & _MASK


class ReplicaCheck:
    """When the replicas are compared during training: ``run`` at each step boundary (under
    in-place recovery the loop calls it after the block of each step that ended in an optimizer
    step, so that what the block did after ``optimizer.step()``, a schedule's step say, is
    compared too; otherwise an optimizer step hook does). ``objects`` gives what to fingerprint;
    ``settle`` (the DDP module's) applies a step ``overlap_optimizer`` deferred before it is compared."""

    def __init__(self, every: int, objects: Callable[[], tuple[nn.Module, torch.optim.Optimizer | None,
                                                               TrackedState]],
                 steps: Callable[[], int], buffers: bool = True, settle: Callable[[], None] | None = None) -> None:
        self._every = every
        self._settle = settle  # the step deferred by overlap_optimizer applied first, so that it is compared
        self._objects = objects
        self._steps = steps
        self._buffers = buffers
        self._after_recovery: str | None = None
        self._recovered_at = -1  # the optimizer steps taken when the last recovery ended

    def recovered(self, how: str) -> None:
        """A recovery (``how``, in the same words on every rank) brought this rank to the group's
        state: compare at the end of the next step trained."""
        self._after_recovery = how
        self._recovered_at = self._steps()

    def run(self) -> None:
        """Compare the replicas if it is time: after a recovery, or every ``DDPKIT_CHECK_REPLICAS``
        optimizer steps. Every rank calls it at the same step (the loop's, or as a listener of the
        optimizer's steps: ``training.commit``). Not at the boundary a recovery between steps (in a
        checkpoint save) ended at: a replacement starts at the next step, and compares there, so the
        survivors must too."""
        steps = self._steps()
        if steps <= self._recovered_at:
            return
        if self._after_recovery is not None:
            when = f"at optimizer step {steps}, the first after {self._after_recovery}"
        elif self._every and steps % self._every == 0:
            when = f"at optimizer step {steps} ({DDPKIT_CHECK_REPLICAS}={self._every})"
        else:
            return
        self._after_recovery = None
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        if self._settle is not None:
            self._settle()
        module, optimizer, tracked = self._objects()
        compare_replicas(fingerprints(module, optimizer, tracked, buffers=self._buffers), when)
