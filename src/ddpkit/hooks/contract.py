"""The contract between the DDP module and communication hooks, typed, and checked when a hook
is registered (as torch's DDP does) rather than discovered inside backward.

What a hook receives: ``GradBucket`` (below), torch ``GradBucket``'s methods plus two of ddpkit's,
``prescaled()`` and ``parameter_names()``. Hooks written for torch receive torch's own bucket
when registered on torch's DDP, so a hook uses ddpkit's two additions only after
``isinstance(bucket, GradBucket)``.

What a hook is:

- torch-style: ``hook(state, bucket) -> torch.futures.Future[Tensor]``. Annotations, where given,
  must say so (``bucket: GradBucket``, a ``Future`` return); a hook without annotations is
  checked by what it returns, on its first call.
- pytorch-pfn-extras style (one argument): ``hook(ddp_module) -> None``.

How a torch-style hook says that it returns the elementwise average of the whole buffer:
decorate it with ``@elementwise_average`` (or set ``hook.averages_elementwise = True``, as
ddpkit 0.1 documented: the same attribute). ``ElementwiseAveragingHook`` is that promise as a
type; ``is_elementwise_average(hook)`` the one place that reads it (ddpkit's DDP reads it once,
when the hook is registered). ddpkit's DDP then divides by
the group size while copying gradients into the bucket (``bucket.prescaled()`` is True, the hook
skips its own division) and puts its negotiation flags after the gradients in ``buffer()``,
summed along with them. torch's DDP ignores the promise.

What a hook's state may offer: ``NamesParameters`` (``name_parameters(module)``), called by
``register_ddp_comm_hook`` because torch's buckets carry no parameter names.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor, nn

__all__ = [
    "BucketContents",
    "ElementwiseAveragingHook",
    "GradBucket",
    "NamesParameters",
    "check_comm_hook",
    "check_hook_result",
    "check_pre_sync_hook",
    "describe_hook",
    "elementwise_average",
    "is_elementwise_average",
]


class BucketContents(Protocol):
    """One bucket as the DDP module keeps it (``ddpkit.parallel.buckets.Bucket``): its place in the
    launch order, its flat ``buffer`` (the gradients ``grads``, then one negotiation flag per
    parameter), a view of ``grads`` per parameter, the parameters and their names."""

    @property
    def index(self) -> int: ...
    @property
    def buffer(self) -> Tensor: ...
    @property
    def grads(self) -> Tensor: ...
    @property
    def views(self) -> Sequence[Tensor]: ...
    @property
    def parameters(self) -> Sequence[Tensor]: ...
    @property
    def names(self) -> Sequence[str]: ...


class GradBucket:
    """What a torch-style communication hook receives from ddpkit's DDP: torch ``GradBucket``'s
    methods, plus ``prescaled()`` and ``parameter_names()``.

    ``buffer()`` is the flat tensor to reduce; the hook returns a future whose value is the
    reduced flat tensor (or a one-element list of it, as older torch hooks return).
    """

    def __init__(self, bucket: BucketContents, is_last: bool, prescaled: bool = False, with_flags: bool = False) -> None:
        self._bucket = bucket
        # For hooks that average elementwise, the buffer also holds the negotiation flags after
        # the gradients, so they are summed with them (see DistributedDataParallel).
        self._buffer = bucket.buffer if with_flags else bucket.grads
        self._is_last = is_last
        self._prescaled = prescaled

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> Tensor:
        return self._buffer

    def get_tensors(self) -> list[Tensor]:
        """The pre-1.10 torch spelling, still used by hooks written against it."""
        return [self._buffer]

    def gradients(self) -> list[Tensor]:
        return list(self._bucket.views)

    def parameters(self) -> list[Tensor]:
        return list(self._bucket.parameters)

    def prescaled(self) -> bool:
        """ddpkit's addition: True when the gradients are already divided by the group size (DDP
        did it while copying them in, for hooks that are ``is_elementwise_average``)."""
        return self._prescaled

    def parameter_names(self) -> list[str]:
        """ddpkit's addition: the names of ``parameters()``, for state kept per parameter (PowerSGD)."""
        return list(self._bucket.names)

    def is_last(self) -> bool:
        return self._is_last

    def set_buffer(self, buffer: Tensor) -> None:
        """Replace the tensor this bucket hands out, as torch's does (a wrapper may swap in an
        fp16 copy); DDP copies the hook's result back into its own gradients."""
        if buffer.numel() != self._buffer.numel():
            raise ValueError(
                f"set_buffer needs {self._buffer.numel()} elements (the bucket's buffer), got {buffer.numel()}."
            )
        self._buffer = buffer


@runtime_checkable
class ElementwiseAveragingHook(Protocol):
    """A torch-style hook that returns the elementwise average over the group of the whole
    ``bucket.buffer()`` it is given (flags included), and divides only when not ``prescaled()``."""

    averages_elementwise: bool

    def __call__(self, state: Any, bucket: Any) -> torch.futures.Future[Tensor]: ...


_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def elementwise_average(hook: _Hook) -> _Hook:
    """Declare that ``hook`` is an ``ElementwiseAveragingHook`` (returns it, so it decorates)."""
    hook.averages_elementwise = True  # type: ignore[attr-defined]  # functions take attributes
    return hook


def is_elementwise_average(hook: object) -> bool:
    """Whether ``hook`` declared that it averages elementwise (``elementwise_average``)."""
    return isinstance(hook, ElementwiseAveragingHook) and hook.averages_elementwise is True


@runtime_checkable
class NamesParameters(Protocol):
    """A hook state that keeps memory per parameter name learns the names from the module, since
    torch's buckets carry none (``PowerSGDState``); ``register_ddp_comm_hook`` calls it."""

    def name_parameters(self, module: nn.Module) -> None: ...


def describe_hook(hook: object) -> str:
    return repr(getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or hook)


def _signature(hook: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(hook)
    except (TypeError, ValueError):  # some builtins and C extensions have none: nothing to check
        return None


def _check_arity(hook: Callable[..., Any], count: int, expected: str) -> inspect.Signature | None:
    signature = _signature(hook)
    if signature is None:
        return None
    try:
        signature.bind(*([None] * count))
    except TypeError as error:
        raise TypeError(
            f"The communication hook {describe_hook(hook)} has the signature {signature}, which cannot be called as "
            f"{expected} ({error}). Write it as {expected}."
        ) from None
    return signature


def check_pre_sync_hook(hook: object) -> None:
    """A one-argument hook, ``hook(ddp_module)``, run before each synchronisation."""
    if not callable(hook):
        raise TypeError(f"register_comm_hook(hook) needs a callable hook(ddp_module), got {type(hook).__name__}.")
    _check_arity(hook, 1, "hook(ddp_module)")


def check_comm_hook(hook: object) -> None:
    """A torch-style hook, ``hook(state, bucket) -> Future[Tensor]``: arity and annotations."""
    if not callable(hook):
        raise TypeError(
            f"register_comm_hook(state, hook) needs a callable hook(state, bucket) -> Future[Tensor], "
            f"got {type(hook).__name__}."
        )
    signature = _check_arity(hook, 2, "hook(state, bucket) -> torch.futures.Future[torch.Tensor]")
    if signature is None:
        return
    bucket_parameter = list(signature.parameters.values())[1] if len(signature.parameters) > 1 else None
    if bucket_parameter is not None and not _annotation_names(bucket_parameter.annotation, "GradBucket"):
        raise ValueError(
            f"The communication hook {describe_hook(hook)} annotates its bucket as {bucket_parameter.annotation!r}; "
            "it receives a GradBucket (torch.distributed.GradBucket). Annotate it so, or not at all."
        )
    if not _annotation_names(signature.return_annotation, "Future"):
        raise ValueError(
            f"The communication hook {describe_hook(hook)} is annotated to return {signature.return_annotation!r}; "
            "a hook returns a torch.futures.Future whose value is the reduced bucket tensor "
            "(e.g. dist.all_reduce(..., async_op=True).get_future()). Annotate it so, or not at all."
        )


def _annotation_names(annotation: Any, wanted: str) -> bool:
    """True when ``annotation`` is absent or names ``wanted`` (a class, a generic of it, or a string)."""
    if annotation is inspect.Parameter.empty:
        return True
    if isinstance(annotation, str):
        return wanted in annotation
    origin = typing.get_origin(annotation) or annotation
    return getattr(origin, "__name__", "") == wanted


def check_hook_result(hook: object, result: object) -> None:
    """What the hook returned must be waitable (a Future, or a process-group Work)."""
    if not isinstance(result, torch.futures.Future) and not callable(getattr(result, "wait", None)):
        raise TypeError(
            f"The communication hook {describe_hook(hook)} returned {type(result).__name__} ({result!r:.80}); a hook "
            "must return a torch.futures.Future whose value is the reduced bucket tensor, e.g. "
            "dist.all_reduce(bucket.buffer(), async_op=True).get_future(), or torch.futures.Future() with "
            "set_result(tensor)."
        )
