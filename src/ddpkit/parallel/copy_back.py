"""The end of a backward's synchronisation (``parallel.reducer``): each bucket's reduction awaited
in turn and its results copied back into the parameters' gradients at once, so that copying bucket
i overlaps with the reduction of the buckets after it (as torch's Reducer does); and the
negotiation of parameters no rank used, whose gradient stays None, as without DDP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ddpkit.diagnostics.waits import wait_for
from ddpkit.parallel.buckets import Bucket
from ddpkit.parallel.step_state import StepState

__all__ = ["await_and_copy_back", "settle_bucket"]


def await_and_copy_back(buckets: list[Bucket], step: StepState, group: Any, as_view: bool, negotiate: bool,
                        wait_into_bucket: Callable[[Bucket, Any], None]) -> None:
    """Wait for each bucket of ``step`` in turn (``wait_into_bucket``) and copy its results back.
    ``negotiate``: find the parameters no rank has a gradient for: from the flags the buckets carry
    (an elementwise average), else with one separate all-reduce."""
    separate = None
    if negotiate and not step.elementwise and buckets:
        # Its answer only matters for parameters no rank touched (rare): copy everything back
        # first and undo those afterwards, rather than wait for it before the first copy.
        separate = _launch_separate_negotiation(buckets, group)
    pending_by_bucket = {bucket.index: pending for bucket, pending in step.in_flight}
    for bucket in buckets:
        settle_bucket(bucket, pending_by_bucket.get(bucket.index), as_view,
                      negotiate and separate is None and bucket.index in step.buckets_missing_grads, wait_into_bucket)
    if separate is not None:
        counts, work = separate
        wait_for(work, group)
        parameters = [p for bucket in buckets for p in bucket.parameters]
        for parameter, count in zip(parameters, counts.tolist()):
            if count == 0:
                parameter.grad = None  # no rank has a gradient: None, as without DDP


def settle_bucket(bucket: Bucket, pending: Any, as_view: bool, read_flags: bool,
                  wait_into_bucket: Callable[[Bucket, Any], None]) -> None:
    """Wait for one bucket's reduction (``pending``; None: nothing in flight) and copy its results
    back. ``read_flags``: a parameter of the bucket lacked a gradient on this rank, so its summed
    flags say which ones no rank has a gradient for (their ``.grad`` stays None)."""
    if pending is not None:
        wait_into_bucket(bucket, pending)
    used = None  # None: every parameter of the bucket has a gradient somewhere
    # With a gradient for every parameter here, every summed flag is positive: no need to
    # read them (on a GPU the read would stall the CPU until the reduction has finished).
    if read_flags:
        flags = bucket.flags.real.tolist()  # .real: complex buckets carry their flags as 1+0j
        if min(flags) <= 0:
            used = [flag > 0 for flag in flags]
    _copy_back(bucket, used, as_view)


def _launch_separate_negotiation(buckets: list[Bucket], group: Any) -> tuple[Tensor, Any]:
    """Count, over ranks, who has a gradient for each parameter: one small asynchronous all-reduce,
    needed when a comm hook or reduce_function reduces the gradients (they carry no bucket flags)."""
    used = torch.tensor(
        [p.grad is not None for bucket in buckets for p in bucket.parameters],
        dtype=torch.int32, device=buckets[0].buffer.device,
    )
    return used, dist.all_reduce(used, group=group, async_op=True)


def _copy_back(bucket: Bucket, used: list[bool] | None, as_view: bool) -> None:
    targets, sources = [], []
    for slot, (parameter, view) in enumerate(zip(bucket.parameters, bucket.views)):
        if used is not None and not used[slot]:
            continue  # no rank has a gradient: keep None, as without DDP
        if parameter.grad is view:
            continue
        if parameter.grad is None or as_view:
            parameter.grad = view if as_view else view.clone()
        else:
            targets.append(parameter.grad)
            sources.append(view)
    if not targets:
        return
    try:
        torch._foreach_copy_(targets, sources)  # one call instead of one copy_ per parameter
    except RuntimeError:
        if all(target.layout == torch.strided for target in targets):
            raise
        _copy_back_densifying(bucket, used)


def _copy_back_densifying(bucket: Bucket, used: list[bool] | None) -> None:
    """The slow copy back, for a sparse gradient that went through a dense bucket: it comes back dense."""
    for slot, (parameter, view) in enumerate(zip(bucket.parameters, bucket.views)):
        if (used is None or used[slot]) and parameter.grad is not None and parameter.grad is not view:
            if parameter.grad.layout == torch.strided:
                parameter.grad.copy_(view)
            else:
                parameter.grad = view.clone()
