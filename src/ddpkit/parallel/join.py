"""``DistributedDataParallel.join``'s work: which reductions a rank that ran out of data can shadow,
and the shadowing (one reduction of zero gradients for each step the others still take, then every
rank takes the state of the rank that trained longest)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ddpkit.comm.collective_call import collective_call
from ddpkit.comm.collectives import all_gather_object
from ddpkit.hooks.contract import describe_hook
from ddpkit.parallel.reducer import SYNCHRONISATION, Reducer

__all__ = ["check_join_supported", "shadow_until_all_joined"]


def check_join_supported(reducer: Reducer, reduce_function_given: bool) -> None:
    """Refuse, naming it, a reduction a finished rank cannot shadow with zeros."""
    if reducer.sparse_count:
        raise ValueError(
            "DistributedDataParallel.join() cannot shadow the reduction of sparse gradients "
            f"({reducer.sparse_count} embedding weight(s) with sparse=True). Stop every rank at the shortest one with "
            "ddpkit.even_batches(loader), or use sparse=False."
        )
    if not reducer.averages_elementwise or reducer.pre_sync_hooks:
        used = ("reduce_function" if reduce_function_given else
                "a one-argument comm hook" if reducer.pre_sync_hooks else
                f"the comm hook {describe_hook(reducer.comm_hook)}")
        raise ValueError(
            f"DistributedDataParallel.join() cannot shadow reductions made by {used}: it supports no hook, "
            "ddpkit.hooks' allreduce_hook, fp16_compress_hook and bf16_compress_hook, and hooks declared "
            "@ddpkit.hooks.elementwise_average. For uneven data with "
            "other reductions, stop every rank at the shortest one with ddpkit.even_batches(loader)."
        )


def shadow_until_all_joined(reducer: Reducer, group: Any, shadow_step: Callable[[], object] | None,
                            take_state_of: Callable[[int], None]) -> None:
    """Shadow the others' reductions (and ``shadow_step``'s collectives) until no rank trains, then
    ``take_state_of`` the group rank that synchronised the most backwards."""
    while _shadow_reduction(reducer, group):
        if shadow_step is not None:
            shadow_step()
    steps = all_gather_object(reducer.step.synced_backwards, group)
    take_state_of(steps.index(max(steps)))


def _shadow_reduction(reducer: Reducer, group: Any) -> bool:
    """Take part in one reduction with zero gradients and flags; True if some rank still trains."""
    with collective_call(SYNCHRONISATION, group):  # the same as a real backward's
        return reducer.reduce_zeros()
