"""The collective primitives below the diagnostics seam: where a group's tensors live, a rank's
place in a group, a stacked all-gather of equal tensors, and an all-gather of byte strings of any
length. They call ``torch.distributed`` with waits in slices (``diagnostics.waits``) and nothing
more: the seam (``collective_call``, which needs them for its debug-mode fingerprints) and the
public collectives (``collectives``) are built on them, and each of their callers runs them
inside a seam of its own. Imports no other part of ddpkit than the waits.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ddpkit.diagnostics.waits import run_collective

__all__ = ["ProcessGroup", "all_gather_bytes", "all_gather_stacked", "communication_device", "group_rank_and_size"]

ProcessGroup = Any  # torch.distributed.ProcessGroup, or None for the default group


def group_rank_and_size(group: ProcessGroup) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; raises if this process is not in it."""
    rank = dist.get_rank(group)
    if rank < 0:
        members = dist.get_process_group_ranks(group)
        raise ValueError(
            f"Global rank {dist.get_rank()} called a collective on a process group it is not a member of "
            f"(members: global ranks {members}). Call collectives on a group only from its members."
        )
    return rank, dist.get_world_size(group)


def communication_device(group: ProcessGroup) -> torch.device:
    """Where tensors that ddpkit creates for a collective must live: NCCL only moves CUDA tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); earlier
# releases, which pyproject's torch>=2.4 admits, have only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_stacked(tensor: Tensor, group: ProcessGroup, world_size: int) -> Tensor:
    """All ranks' ``tensor`` (same shape everywhere) stacked into ``(world_size, *shape)``.

    Gathers a flat view into one output buffer: no list of outputs and no ``torch.stack`` copy.
    """
    flat = tensor.detach().contiguous().reshape(-1)
    out = flat.new_empty(world_size * flat.numel())
    if flat.numel() > 0:  # every rank has the same numel here, so all skip or none does
        run_collective(_all_gather_single, out, flat, group=group)
    return out.view(world_size, *tensor.shape)


def all_gather_bytes(mine: bytes, group: ProcessGroup) -> list[bytes]:
    """Every rank's ``mine`` (any length, each its own), in rank order of ``group``: the lengths
    first, then every rank's bytes padded to the longest (two equal-size gathers, which Gloo and
    NCCL both take)."""
    _, world_size = group_rank_and_size(group)
    device = communication_device(group)
    length = torch.tensor([len(mine)], dtype=torch.long, device=device)
    lengths = [int(n) for n in all_gather_stacked(length, group, world_size).reshape(-1).tolist()]
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    if mine:
        padded[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    rows = all_gather_stacked(padded.to(device), group, world_size).cpu()
    return [ctypes.string_at(row.data_ptr(), n) if n else b"" for row, n in zip(rows.contiguous(), lengths)]
