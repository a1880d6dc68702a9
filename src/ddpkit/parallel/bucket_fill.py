"""How gradients enter their bucket (``parallel.reducer``): a large one copied at once in its hook,
multiplied on the way, and the small ones a bucket's hooks only recorded copied together when it
launches. The multiplier is ``factor``: 1/world (or this rank's weight) where DDP averages
elementwise itself (``always``: applied even when it is 1, the arithmetic every rank shares), else
the rank's weighting before a reduction that averages by itself, applied only when it is not 1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddpkit.parallel.buckets import Bucket

__all__ = ["copy_batched", "copy_into_bucket"]


def copy_into_bucket(parameter: Tensor, view: Tensor, factor: float, always: bool, as_view: bool) -> None:
    """Copy ``parameter``'s gradient into its bucket ``view`` (zeros when it has none), multiplied
    by ``factor``; with ``as_view``, ``.grad`` then points at the view."""
    grad = parameter.grad
    scaled = always or factor != 1.0
    if grad is None:
        view.zero_()
    elif grad is view:
        if scaled:
            view.mul_(factor)
    elif grad.layout != torch.strided:  # sparse, from a module ddpkit did not recognise: densified
        view.copy_(grad.to_dense())
        if scaled:
            view.mul_(factor)
    elif scaled:
        torch.mul(grad, factor, out=view)  # copy and divide in one pass, as torch's Reducer
    else:
        view.copy_(grad)
    if as_view and grad is not None and grad is not view:
        parameter.grad = view


def copy_batched(bucket: Bucket, factor: float, always: bool, as_view: bool) -> None:
    """Copy the small gradients that the hooks only recorded, in two calls for the bucket."""
    if not bucket.batched:
        return
    arrived, bucket.batched = bucket.batched, []
    every_one = len(arrived) == len(bucket.batched_slots)  # the usual case
    parameters = bucket.batched_parameters if every_one else [parameter for parameter, _ in arrived]
    views = bucket.batched_views if every_one else [view for _, view in arrived]
    grads = [parameter.grad for parameter in parameters]  # each hook fired, so none is None
    try:
        torch._foreach_copy_(views, grads)  # type: ignore[arg-type]
    except RuntimeError:
        if all(grad.layout == torch.strided for grad in grads):  # type: ignore[union-attr]
            raise
        # Sparse gradients from a module ddpkit did not recognise: densified one by one.
        for view, grad in zip(views, grads):
            view.copy_(grad.to_dense())  # type: ignore[union-attr]
    if always or factor != 1.0:  # g * (1/world): the same arithmetic as mul(out=)
        if every_one:
            bucket.batched_region.mul_(factor)  # they lie contiguous: one pass, not one call each
        else:
            torch._foreach_mul_(views, factor)
    if as_view:
        for parameter, view in zip(parameters, views):
            parameter.grad = view
