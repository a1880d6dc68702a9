"""What ``DistributedDataParallel`` checks when it wraps a module: this process is a member of the
group, one device per process, and the same parameters and buffers (names, shapes, dtypes) on every
rank of the group, raised on every rank otherwise; and ``to_device``, which moves a forward's inputs
to the module's device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddpkit.comm.collectives import all_gather_object

__all__ = ["check_device", "check_membership", "check_same_module_everywhere", "to_device"]

ProcessGroup = Any


def check_membership(process_group: ProcessGroup) -> tuple[int, int]:
    """This process's rank in ``process_group`` and the group's size; refused when it is not a member."""
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError(
            f"Global rank {dist.get_rank()} is not a member of the process group given to DistributedDataParallel "
            f"(members: {dist.get_process_group_ranks(process_group)})."
        )
    return rank, dist.get_world_size(process_group)


def check_device(module: nn.Module, device_ids: Sequence[int | torch.device] | None) -> torch.device:
    """The one device of ``module``'s tensors; on CUDA it must be this process's (``device_ids``)."""
    devices = {t.device for t in [*module.parameters(), *module.buffers()]}
    if len(devices) > 1:
        raise ValueError(
            f"The module's tensors are on several devices {sorted(map(str, devices))}; ddpkit needs one device per "
            "process. Move the module with module.to(device) before wrapping it."
        )
    device = devices.pop() if devices else torch.device("cpu")
    if device.type == "cuda":
        wanted = device_ids[0] if device_ids else torch.cuda.current_device()
        expected = torch.device("cuda", wanted) if isinstance(wanted, int) else torch.device(wanted)
        if device != expected:
            raise ValueError(
                f"The module is on {device} but this process's device is {expected}. Call "
                "torch.cuda.set_device(local_rank) and module.to(local_rank) before wrapping, with device_ids=[local_rank]."
            )
    return device


def check_same_module_everywhere(module: nn.Module, process_group: ProcessGroup) -> list[str]:
    """Compare parameter and buffer names, shapes and dtypes across ranks; raise on all if they differ.

    Returns the group's first rank's parameter names in reverse registration order: the
    order in which buckets are built and launched, identical on every rank.
    """
    mine = {
        "parameters": [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()],
        "buffers": [(n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()],
    }
    everyone = all_gather_object(mine, process_group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        for kind in ("parameters", "buffers"):
            problem = _first_difference(reference[kind], theirs[kind], rank)
            if problem is not None:
                raise ValueError(
                    f"The {kind} of the wrapped module differ between ranks of the group: {problem}. "
                    "Every rank must build the same model before wrapping it."
                )
    return [name for name, *_ in reversed(reference["parameters"])]


def _first_difference(reference: list[tuple[Any, ...]], other: list[tuple[Any, ...]], other_rank: int) -> str | None:
    """Describe the first entry, by name, that differs between rank 0's list and ``other_rank``'s."""
    mine, theirs = {entry[0]: entry for entry in reference}, {entry[0]: entry for entry in other}
    for name in sorted(set(mine) | set(theirs)):
        a, b = mine.get(name), theirs.get(name)
        if a == b:
            continue
        if a is None:
            return f"{name!r} exists on rank {other_rank} but not on rank 0"
        if b is None:
            return f"{name!r} exists on rank 0 but not on rank {other_rank}"
        message = f"{name!r} has shape {a[1]} and dtype {a[2]} on rank 0 but shape {b[1]} and dtype {b[2]} on rank {other_rank}"
        if len(a) > 3 and a[3] != b[3]:
            message += f" (requires_grad {a[3]} vs {b[3]})"
        return message
    return None


def to_device(value: Any, device: torch.device) -> Any:
    """Move every tensor inside nested tuples, lists and dicts to ``device``."""
    if isinstance(value, Tensor):
        return value if value.device == device else value.to(device, non_blocking=True)
    if isinstance(value, tuple):
        return type(value)(*(to_device(v, device) for v in value)) if hasattr(value, "_fields") else tuple(
            to_device(v, device) for v in value)
    if isinstance(value, list):
        return [to_device(v, device) for v in value]
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value
