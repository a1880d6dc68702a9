"""Data for several ranks: ``shard`` (a loader's DistributedSampler, its epoch set at each pass)
and ``even_batches`` (every rank stops at the shortest rank's number of batches).

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
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

from ddpkit.collective_call import communication_device
from ddpkit.collectives import sync_ddp
from ddpkit.connection import distributed_available
from ddpkit.group import Group, Membership

__all__ = ["EpochDataLoader", "even_batches", "set_epoch", "shard"]

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


def shard(loader: DataLoader[Any], num_replicas: int, rank: int, group: Group | None = None) -> DataLoader[Any]:
    """``loader`` with a ``DistributedSampler`` (shuffled unless it read its data in order), so that
    each rank reads its own share; each pass over it shuffles for the next epoch
    (``EpochDataLoader``). A loader with a DistributedSampler already is returned as it is.

    With ``group`` (``ddpkit.group``; ``DDPStrategy`` gives the default group's), the shares
    follow the group's membership when it is formed again: each rank's share is taken anew.
    """
    if isinstance(loader.sampler, DistributedSampler):
        return loader
    shuffle = not isinstance(loader.sampler, SequentialSampler)
    sampler: DistributedSampler[Any] = DistributedSampler(loader.dataset, num_replicas=num_replicas, rank=rank,
                                                          shuffle=shuffle)
    sharded = EpochDataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler,
                              num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                              pin_memory=loader.pin_memory, drop_last=loader.drop_last)
    if group is not None:
        group.on_reconfigure(sharded.follow_membership)
    return sharded


class EpochDataLoader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader whose DistributedSampler gets ``set_epoch`` at each new iteration.

    ``epoch`` is the epoch the next iteration shuffles for; set it when resuming a run.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch = 0

    def follow_membership(self, membership: Membership) -> None:
        """Take this rank's share of the data in the group's new membership (``Group.on_reconfigure``)."""
        sampler = self.sampler
        if not isinstance(sampler, DistributedSampler):
            return
        if (sampler.num_replicas, sampler.rank) == (membership.world_size, membership.rank):
            return
        epoch = sampler.epoch
        DistributedSampler.__init__(sampler, sampler.dataset, num_replicas=membership.world_size,
                                    rank=membership.rank, shuffle=sampler.shuffle, seed=sampler.seed,
                                    drop_last=sampler.drop_last)
        sampler.set_epoch(epoch)

    def __iter__(self) -> Any:
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return super().__iter__()


def set_epoch(loader: Iterable[Any], epoch: int) -> None:
    """Give ``loader``'s sampler the epoch, so that its shuffle is the epoch's on every rank."""
    if isinstance(loader, EpochDataLoader):
        loader.epoch = epoch
    elif isinstance(getattr(loader, "sampler", None), DistributedSampler):
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
