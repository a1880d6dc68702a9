"""Data for several ranks: ``shard`` (a loader's DistributedSampler, its epoch set at each pass)
and ``even_batches`` (every rank stops at the shortest rank's number of batches).

A loader ``shard`` made follows the group (``ddpkit.membership.group``): when the world shrinks and this
rank trains lost ranks' shares too, each of its batches is the concatenation of those shares'
batches (``ShareSampler``), the ones the ranks of the starting world read at that step, so the
global batch, its samples and their order within each share stay those of the run without the
loss; ``len(loader)`` stays the number of steps an epoch takes.

The simple answer to uneven inputs (the other is ``DistributedDataParallel.join``): ranks whose
data differ in length, e.g. shards of unequal size read by an ``IterableDataset``, would
otherwise leave the longer ones waiting in a collective for a rank that has finished. Before
each batch the ranks agree, with one all-reduce of a single integer, whether all of them have
one; the first time one has not, all stop. (``DistributedSampler`` already gives every rank the
same number of samples, by repeating or dropping a few; this is for data it does not shard.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

from ddpkit.comm.collectives import sync_ddp
from ddpkit.comm.primitives import communication_device
from ddpkit.membership.connection import distributed_available
from ddpkit.membership.group import Group, Membership

__all__ = ["EpochDataLoader", "ShareSampler", "even_batches", "set_epoch", "shard"]

T = TypeVar("T")
ProcessGroup = Any


def even_batches(batches: Iterable[T], group: ProcessGroup = None) -> Iterator[T]:
    """Yield ``batches`` while every rank of ``group`` still has one; all ranks stop together.

    Costs one all-reduce of one integer per batch (a ddpkit collective: in debug mode it is
    fingerprinted, and a failed peer is named). A rank with batches left over reads one more
    than it yields.

    Example::

        >>> import ddpkit
        >>> list(ddpkit.even_batches(range(3)))  # a rank with 5 batches beside one with 3 also stops at 3
        [0, 1, 2]
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


def shard(loader: DataLoader[Any], num_replicas: int, rank: int, group: Group | None = None,
          shares: Sequence[int] | None = None) -> DataLoader[Any]:
    """``loader`` with a ``DistributedSampler`` (shuffled unless it read its data in order), so that
    each rank reads its own share; each pass over it shuffles for the next epoch
    (``EpochDataLoader``). A loader with a DistributedSampler already is returned as it is.

    With ``group`` (``ddpkit.membership.group``; ``DDPStrategy`` gives the default group's), the shares
    follow the group's membership when it is formed again: each rank's share is taken anew, and a
    rank that trains several shares (``shares``, ranks of ``num_replicas``; ``(rank,)`` by default)
    reads their batches as one.
    """
    if isinstance(loader.sampler, DistributedSampler):
        return loader
    shuffle = not isinstance(loader.sampler, SequentialSampler)
    sampler = ShareSampler(loader.dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                           batch_size=loader.batch_size or 1)
    sharded = EpochDataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler,
                              num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                              pin_memory=loader.pin_memory, drop_last=loader.drop_last)
    if shares is not None and tuple(shares) != (rank,):
        sharded.take_shares(tuple(shares), num_replicas)
    if group is not None:
        group.on_reconfigure(sharded.follow_membership)
    return sharded


class ShareSampler(DistributedSampler):  # type: ignore[type-arg]
    """A ``DistributedSampler`` that can read several ranks' shares (``shares``, ranks of
    ``num_replicas``) as one: step after step, ``batch_size`` indices of each share in turn, the
    batch each of those ranks reads at that step, so that a loader batching ``len(shares) *
    batch_size`` indices reads their batches concatenated. ``start_batch`` skips that many steps in
    the next pass only (a rank that resumes in the middle of an epoch)."""

    def __init__(self, dataset: Any, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, batch_size: int = 1) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.shares: tuple[int, ...] = (rank,)
        self.batch_size = batch_size
        self.start_batch = 0

    def set_shares(self, shares: tuple[int, ...], num_replicas: int) -> None:
        """Read ``shares`` of a world of ``num_replicas`` from now on (the epoch is kept)."""
        epoch = self.epoch
        DistributedSampler.__init__(self, self.dataset, num_replicas=num_replicas, rank=shares[0],
                                    shuffle=self.shuffle, seed=self.seed, drop_last=self.drop_last)
        self.epoch = epoch
        self.shares = shares

    def _steps(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def __len__(self) -> int:
        return len(self.shares) * max(0, self.num_samples - self.start_batch * self.batch_size)

    def __iter__(self) -> Iterator[int]:
        start, self.start_batch = self.start_batch, 0
        if self.shares == (self.rank,) and start == 0:
            return super().__iter__()
        own = self.rank
        try:
            lists = []
            for share in self.shares:  # DistributedSampler's own lists (the same permutation for each)
                self.rank = share
                lists.append(list(super().__iter__()))
        finally:
            self.rank = own
        size = self.batch_size
        return iter([index for step in range(start, self._steps()) for indices in lists
                     for index in indices[step * size:(step + 1) * size]])


class EpochDataLoader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader whose DistributedSampler gets ``set_epoch`` at each new iteration.

    ``epoch`` is the epoch the next iteration shuffles for; set it when resuming a run.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch = 0

    def follow_membership(self, membership: Membership) -> None:
        """Take this rank's shares of the data in the group's new membership (``Group.on_reconfigure``)."""
        self.take_shares(membership.shares, membership.data_world_size)

    def take_shares(self, shares: tuple[int, ...], num_replicas: int) -> None:
        """Read ``shares`` of a world of ``num_replicas``, their batches as one (``ShareSampler``)."""
        sampler = self.sampler
        if not isinstance(sampler, ShareSampler):
            return
        if (sampler.num_replicas, sampler.shares) == (num_replicas, shares):
            return
        if len(shares) > 1 and self.batch_size is None:
            raise ValueError(f"this rank now trains the shares {list(shares)} of the world of {num_replicas} ranks the "
                             "job started with (the world shrank), but its DataLoader has batch_size=None, so their "
                             "batches cannot be read as one. Give the DataLoader a batch_size.")
        sampler.set_shares(shares, num_replicas)
        if self.batch_sampler is not None:  # torch's BatchSampler: one batch is every share's
            self.batch_sampler.batch_size = len(shares) * sampler.batch_size  # type: ignore[attr-defined]

    def start_at(self, epoch: int, batch: int) -> bool:
        """Make the next pass read ``epoch`` from its batch ``batch`` (without reading the ones
        before); False when this loader's sampler cannot (then it starts at the first)."""
        self.epoch = epoch
        if not isinstance(self.sampler, ShareSampler):
            return False
        self.sampler.start_batch = batch
        return True

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
