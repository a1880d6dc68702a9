"""What ``overlap_optimizer`` (``ddpkit.parallel.step_overlap``) puts in the user's way while a
step is deferred, so that a read too early raises naming the call instead of reading stale values.

- Between backward and the bucket's landing, each ``.grad`` is a ``NotYetReduced`` stand-in: a
  read (``clip_grad_norm_``, a ``GradScaler``'s inf check) raises ``GradientsNotReducedError``.
  What ``Module.zero_grad`` does to it, or setting ``.grad``, is noted (``GradientChange``) and
  done again after the deferred step has used the gradient.
- Between ``optimizer.step()`` and the forward that applies it, each parameter of a held bucket
  is a ``HeldParameter`` (its class swapped in place, the same object): a read of its values (an
  EMA of the weights, a norm for logging, ``p.data``) or a write raises
  ``ParametersNotUpdatedError``; its metadata and ``.grad`` stay open.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["GradientChange", "GradientsNotReducedError", "HeldParameter", "NotYetReduced", "ParametersNotUpdatedError",
           "hold_parameters", "release_parameters", "stand_in"]

_TORCH_FOLDER = os.path.dirname(torch.__file__)
_GRAD_FN_GETTER = vars(torch._C.TensorBase)["grad_fn"].__get__  # what reading a tensor's .grad_fn calls
_SETTLE_ADVICE = ("Call model.settle() first: it finishes the averaging and the step now (this step is then not "
                  "overlapped); or leave overlap_optimizer off.")


class GradientsNotReducedError(RuntimeError):
    """A gradient was read while it was still being averaged across ranks (``overlap_optimizer``)."""


class ParametersNotUpdatedError(RuntimeError):
    """A parameter was used after ``optimizer.step()`` and before the next forward applied that step
    to it (``overlap_optimizer``)."""


def _reader(called_directly: str) -> str:
    """What the user's code called that reached a stand-in, and where: the first function inside
    torch below the user's frames, past torch's private wrappers (a decorator's); else
    ``called_directly`` (the operation), called by the innermost frame."""
    frames = []
    frame = sys._getframe(2)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back  # type: ignore[assignment]
    frames.reverse()  # outermost first
    for index, caller in enumerate(frames[:-1]):
        if caller.f_code.co_filename.startswith(_TORCH_FOLDER) or not frames[index + 1].f_code.co_filename.startswith(
                _TORCH_FOLDER):
            continue
        called = next((inner for inner in frames[index + 1:] if not inner.f_code.co_name.startswith("_")
                       and inner.f_code.co_name not in ("wrapper", "decorate_context")), frames[index + 1])
        return f"{called.f_code.co_qualname} (called at {caller.f_code.co_filename}:{caller.f_lineno})"
    innermost = frames[-1]
    return f"{called_directly} (called at {innermost.f_code.co_filename}:{innermost.f_lineno})"


class NotYetReduced(Tensor):
    """A parameter's ``.grad`` while its bucket is still being averaged: any use raises, except
    what ``Module.zero_grad(set_to_none=False)`` does to it, which is noted (``zeroed``) and done
    to the gradient once it has landed and the step asked for before has used it."""

    zeroed = False

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func == _GRAD_FN_GETTER:  # a gradient has none
            return None
        if func is Tensor.requires_grad_ or func is Tensor.detach_:  # nothing to do on a gradient
            return args[0]
        if func is Tensor.zero_:
            args[0].zeroed = True
            return args[0]
        raise GradientsNotReducedError(
            f"ddpkit DistributedDataParallel(overlap_optimizer=...): {_reader(_operation(func))} read the gradients before "
            "optimizer.step(), while they are still being averaged across ranks (this mode finishes the "
            f"averaging during the next forward). {_SETTLE_ADVICE} Gradient clipping and a GradScaler need it."
        )


def stand_in(gradient: Tensor) -> Tensor:
    return Tensor._make_subclass(NotYetReduced, gradient)


@dataclass(frozen=True)
class GradientChange:
    """What the user's code did to a parameter's ``.grad`` while it was a stand-in: set it (to
    None by ``Module.zero_grad()``, or to a tensor of its own), or zeroed it in place."""

    parameter: Tensor
    zeroed: bool
    value: Tensor | None = None  # what it was set to, when not zeroed

    def apply(self) -> None:
        if not self.zeroed:
            self.parameter.grad = self.value
        elif self.parameter.grad is not None:
            self.parameter.grad.zero_()


# Calls on a held parameter that read no value: its shape and kind, and what a set or dict keyed by
# parameters (an optimizer's state, named_parameters' memo) calls.
_METADATA = frozenset({"numel", "nelement", "size", "dim", "ndimension", "element_size", "stride", "is_contiguous",
                       "is_floating_point", "is_complex", "get_device", "__hash__", "__len__", "data_ptr"})
_VALUE_ATTRIBUTES = frozenset({".data"})  # reading or setting it reads or writes the values


class HeldParameter(nn.Parameter):
    """A parameter whose step is asked for and not yet applied: using its values raises."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        operation = _operation(func)
        if (operation.startswith(".") and operation not in _VALUE_ATTRIBUTES) or operation in _METADATA:
            return _as_plain(func, args, kwargs)
        raise ParametersNotUpdatedError(
            f"ddpkit DistributedDataParallel(overlap_optimizer=...): {_reader(operation)} used a parameter after "
            "optimizer.step() and before the next forward, which applies that step bucket by bucket, so it would "
            f"see the parameter as it was before the step. {_SETTLE_ADVICE} An EMA of the weights, a weight norm "
            "for logging, or weights set by hand need it."
        )


def _operation(func: Any) -> str:
    """``func``'s name; an attribute's (``Tensor.grad`` read or set) as ``.grad``."""
    name = getattr(func, "__name__", str(func))
    if name in ("__get__", "__set__"):  # the descriptor's method: the attribute's name is the descriptor's
        return "." + getattr(getattr(func, "__self__", None), "__name__", "")
    return name


def _as_plain(func: Any, args: Any, kwargs: Any) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **(kwargs or {}))


def hold_parameters(parameters: Iterable[Tensor]) -> list[Tensor]:
    """Make each plain ``nn.Parameter`` of ``parameters`` a ``HeldParameter`` (a subclass of the
    user's own is left as it is); the ones made so."""
    held: list[Tensor] = [p for p in parameters if type(p) is nn.Parameter]
    for parameter in held:
        parameter.__class__ = HeldParameter
    return held


def release_parameters(parameters: Iterable[Tensor]) -> None:
    for parameter in parameters:
        if type(parameter) is HeldParameter:
            parameter.__class__ = nn.Parameter  # type: ignore[assignment]
