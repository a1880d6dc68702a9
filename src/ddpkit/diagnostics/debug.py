"""The collective mismatch guard: an opt-in debug mode (``DDPKIT_DEBUG=1``, or ``set_debug(True)``).

Two ranks that call collectives with different shapes abort with a C++ message (all_reduce on
Gloo), or finish with garbage (broadcast); two ranks that call them in a different order hang.
In debug mode every ddpkit collective (the functions of ``ddpkit.distributed`` and each
backward of ``ddpkit.DistributedDataParallel``) first exchanges a fingerprint: its sequence
number in the group, the operation, the dtype and shape of its tensor, and the caller's
file:line. If they differ, every rank raises ``CollectiveMismatchError`` naming the ranks,
both fingerprints and both call sites, before the real collective runs. It does not use
torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (which crashes DDP construction in torch 2.13).

The check is one extra all-gather of 24 integers per collective (the full fingerprints, with
call sites, travel only when they differ): see
``benchmarks/debug_overhead.py`` for what it costs. Collectives made with torch.distributed
directly are not fingerprinted.
"""

from __future__ import annotations

import os
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from ddpkit.process_state import PROCESS
from ddpkit.variables import DDPKIT_DEBUG

__all__ = ["CollectiveMismatchError", "Fingerprint", "call_site", "debug_enabled", "set_debug"]

#: Integers per fingerprint in the all-gather that compares them.
CODE_LENGTH = 24
_PACKAGE = str(Path(__file__).resolve().parents[1])  # the ddpkit folder, every part of it
_TORCH = str(Path(torch.__file__).resolve().parent)


class CollectiveMismatchError(ValueError):
    """Ranks called different collectives, or the same one with different tensors (debug mode)."""


@dataclass(frozen=True)
class Fingerprint:
    """What one rank is about to do. ``shape`` is None where ranks may legitimately differ."""

    sequence: int
    operation: str
    dtype: str | None
    shape: tuple[int, ...] | None
    call_site: str

    def code(self) -> list[int]:
        """What ranks must agree on, as ``CODE_LENGTH`` integers (the call site is not compared:
        ranks may call the same collective from different lines)."""
        shape = list(self.shape) if self.shape is not None else [-1]
        if len(shape) > CODE_LENGTH - 4:
            shape = [-2, zlib.crc32(repr(shape).encode())]
        fields = [self.sequence, zlib.crc32(self.operation.encode()), zlib.crc32(str(self.dtype).encode()), len(shape)]
        return fields + shape + [0] * (CODE_LENGTH - len(fields) - len(shape))

    def describe(self) -> str:
        tensor = "" if self.dtype is None else f"({self.dtype}{'' if self.shape is None else f', shape {self.shape}'})"
        return f"#{self.sequence} {self.operation}{tensor} at {self.call_site}"


def set_debug(enabled: bool | None) -> None:
    """Turn debug mode on or off for this process (None: follow ``DDPKIT_DEBUG`` again). Every
    rank must make the same choice: the fingerprints are themselves a collective."""
    PROCESS.debug.forced = enabled


def debug_enabled() -> bool:
    if PROCESS.debug.forced is not None:
        return PROCESS.debug.forced
    return os.environ.get(DDPKIT_DEBUG, "").strip().lower() in ("1", "true", "yes", "on")


def fingerprint(operation: str, group: Any, tensor: Any = None, compare_shape: bool = True) -> Fingerprint:
    """This rank's fingerprint of the collective it is entering (and its next sequence number)."""
    key = id(group)
    sequence = PROCESS.debug.sequences.get(key, 0)
    PROCESS.debug.sequences[key] = sequence + 1
    dtype = shape = None
    if isinstance(tensor, torch.Tensor):
        dtype = str(tensor.dtype).replace("torch.", "")
        shape = tuple(tensor.shape) if compare_shape else None
    elif tensor is not None:
        dtype = type(tensor).__name__
    return Fingerprint(sequence, operation, dtype, shape, _call_site(sys._getframe(1)))


def mismatch(fingerprints: list[Fingerprint]) -> str | None:
    """Describe how the ranks' fingerprints differ, or None when they agree."""
    reference = fingerprints[0]
    for rank, other in enumerate(fingerprints[1:], start=1):
        if (other.sequence, other.operation) != (reference.sequence, reference.operation):
            return (f"collectives called in a different order: at sequence numbers {reference.sequence}/"
                    f"{other.sequence} rank 0 called {reference.describe()} but rank {rank} called "
                    f"{other.describe()}. Every rank must call the same collectives in the same order.")
        if (other.dtype, other.shape) != (reference.dtype, reference.shape):
            return (f"ranks 0 and {rank} called {reference.operation} with different tensors: rank 0 "
                    f"{reference.describe()}; rank {rank} {other.describe()}. Pass tensors of the same dtype and "
                    "shape on every rank.")
    return None


class checking:
    """``with checking():`` marks the inside of a fingerprinted collective (nested ones are not checked)."""

    def __enter__(self) -> bool:
        outermost = PROCESS.debug.depth == 0
        PROCESS.debug.depth += 1
        return outermost

    def __exit__(self, *exc: object) -> None:
        PROCESS.debug.depth -= 1


def call_site() -> str:
    """Where the user's code called into ddpkit: the first caller outside ddpkit and torch."""
    return _call_site(sys._getframe(1))


def _call_site(frame: FrameType | None) -> str:
    """The first caller outside ddpkit and torch: where the user's code called the collective."""
    fallback = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith((_PACKAGE, _TORCH, "<frozen")):
            return f"{filename}:{frame.f_lineno}"
        fallback = fallback or f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback or "<unknown>"
