"""What a communication hook must look like, checked when it is registered (as torch's DDP does)
rather than discovered inside backward.

- torch-style: ``hook(state, bucket) -> torch.futures.Future[Tensor]``. Annotations, where given,
  must say so (``bucket: GradBucket``, a ``Future`` return); a hook without annotations is
  checked by what it returns, on its first call.
- pytorch-pfn-extras style (one argument): ``hook(ddp_module) -> None``.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["check_comm_hook", "check_hook_result", "check_pre_sync_hook"]


def _describe(hook: object) -> str:
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
            f"The communication hook {_describe(hook)} has the signature {signature}, which cannot be called as "
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
            f"The communication hook {_describe(hook)} annotates its bucket as {bucket_parameter.annotation!r}; "
            "it receives a GradBucket (torch.distributed.GradBucket). Annotate it so, or not at all."
        )
    if not _annotation_names(signature.return_annotation, "Future"):
        raise ValueError(
            f"The communication hook {_describe(hook)} is annotated to return {signature.return_annotation!r}; "
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
            f"The communication hook {_describe(hook)} returned {type(result).__name__} ({result!r:.80}); a hook "
            "must return a torch.futures.Future whose value is the reduced bucket tensor, e.g. "
            "dist.all_reduce(bucket.buffer(), async_op=True).get_future(), or torch.futures.Future() with "
            "set_result(tensor)."
        )
