"""``even_batches``: every rank stops at the shortest rank's number of batches.

The simple answer to uneven inputs (the other is ``DistributedDataParallel.join``): ranks whose
data differ in length, e.g. shards of unequal size read by an ``IterableDataset``, would
otherwise leave the longer ones waiting in a collective for a rank that has finished. Before
each batch the ranks agree, with one all-reduce of a single integer, whether all of them have
one; the first time one has not, all stop. (``DistributedSampler`` already gives every rank the
same number of samples, by repeating or dropping a few; this is for data it does not shard.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch

from ddpkit.collectives import communication_device, sync_ddp
from ddpkit.connection import distributed_available

__all__ = ["even_batches"]

T = TypeVar("T")
ProcessGroup = Any


def even_batches(batches: Iterable[T], group: ProcessGroup = None) -> Iterator[T]:
    """Yield ``batches`` while every rank of ``group`` still has one; all ranks stop together.

    Costs one all-reduce of one integer per batch (a ddpkit collective: in debug mode it is
    fingerprinted, and a failed peer is named). A rank with batches left over reads one more
    than it yields.
    """
    iterator = iter(batches)
    if not distributed_available():
        yield from iterator
        return
    device = communication_device(group)
    while True:
        try:
            batch, has_one = next(iterator), 1
        except StopIteration:
            batch, has_one = None, 0
        everyone = sync_ddp(torch.tensor([has_one], dtype=torch.int32, device=device), group, reduce_op="min")
        if int(everyone.item()) == 0:
            return
        yield batch  # type: ignore[misc]
