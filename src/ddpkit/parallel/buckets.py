"""Gradient buckets: which parameters are reduced together, and their flat buffers (the
``GradBucket`` view that communication hooks receive is part of ``ddpkit.hooks.contract``).

Parameters are taken in reverse order of registration (roughly the order backward produces
their gradients), grouped by dtype and device, and cut into buckets; every rank builds the same
buckets because the order comes from one rank's parameter list. Three caps apply:

- The first bucket of each kind is small (``first_cap_bytes``, 1 MB) so that communication starts
  early in backward, as torch's Reducer does.
- The buckets after it hold about a ``spread``-th (16) of their kind's gradient bytes, never less
  than the first cap and never more than ``cap_bytes`` (the user's ``bucket_cap_mb``, 25 MB by
  default). Torch's one jump from 1 MB to 25 MB puts most of a mid-sized model in the second
  bucket, which is complete only when backward ends: where compute and wire are of one order,
  nothing is then sent while backward runs (the 8 x 1024 MLP on 384 rows a rank at 1 Gbit/s:
  its second bucket holds seven of eight layers, and the step is 1.6x max(compute, all-reduce)).
  A share of the model's bytes gives the wire a bucket after about every 16th of backward
  whatever the layers' sizes, while 16 messages' fixed costs stay small beside the bytes. Where
  the wire is fast the last bucket, sent after backward ends, is a 16th of the model rather than
  up to 25 MB. Models of 400 MB and more keep torch's 25 MB. Gradients on an accelerator keep
  torch's caps: there each bucket's launch costs the host tens of microseconds, which a step of a
  few milliseconds feels, and NCCL's wire is fast; the share was measured on Gloo's (the GPU's
  figures: benchmarks/README.md, ``gpu_check.py``).
- With an elementwise-averaging comm hook (ddpkit's ``allreduce_hook``, ``fp16_compress_hook``,
  ``bf16_compress_hook``: ``growing=True``) the caps after the first also double (1, 2, 4, 8, 16
  MB, then ``cap_bytes``): a hook that sends fewer bytes than it reduces has sent each bucket
  before backward fills a much larger next one, and the wire would idle; for large models that
  keeps the first buckets below the share.

The measurements behind each choice are in benchmarks/README.md (``links.py``, ``memory.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

# The view of a bucket that communication hooks receive; defined with the hook contract.
from ddpkit.hooks.contract import GradBucket

__all__ = ["BUCKETS_PER_MODEL", "UNBATCHED_BESIDE_BYTES", "Bucket", "GradBucket", "assign_buckets"]

DEFAULT_CAP_BYTES = 25 * 1024 * 1024
DEFAULT_FIRST_CAP_BYTES = 1024 * 1024
#: The buckets after the first hold about this share of a kind's gradient bytes (see the module's docstring).
BUCKETS_PER_MODEL = 16
#: A bucket holding a parameter of this many bytes or more copies every gradient in its hook (see Bucket).
UNBATCHED_BESIDE_BYTES = 1024 * 1024


def assign_buckets(
    tensors: Sequence[Tensor], cap_bytes: int = DEFAULT_CAP_BYTES, first_cap_bytes: int = DEFAULT_FIRST_CAP_BYTES,
    growing: bool = False, spread: int = BUCKETS_PER_MODEL,
) -> list[list[int]]:
    """Split ``tensors`` (already in launch order) into buckets of indices.

    A bucket holds one dtype and one device. As torch's Reducer does, a tensor is added to its
    kind's open bucket, which closes once it reaches its cap; so the first bucket holds at
    least the first whole tensor (on an MLP, the last layer), and its reduction starts as soon
    as backward has produced it. Every bucket after the first closes at ``min(cap_bytes,
    max(first_cap_bytes, kind's bytes // spread))`` (``spread=0``, or a kind on an accelerator: at
    ``cap_bytes``, as in torch), with ``growing`` the k-th bucket of a kind (from 0) at ``first_cap_bytes * 2**k`` if
    that is less (see the module's docstring). Buckets are ordered by their first tensor, so
    bucket 0 holds the first tensors of ``tensors``.
    """
    if cap_bytes <= 0 or first_cap_bytes <= 0 or spread < 0:
        raise ValueError(f"bucket caps must be positive, got cap_bytes={cap_bytes}, first_cap_bytes={first_cap_bytes}, "
                         f"spread={spread}.")
    kind_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    for tensor in tensors:
        kind = (tensor.dtype, tensor.device)
        kind_bytes[kind] = kind_bytes.get(kind, 0) + tensor.numel() * tensor.element_size()
    later_caps = {kind: min(cap_bytes, max(first_cap_bytes, total // spread)) if spread and _on_the_host(kind[1])
                  else cap_bytes for kind, total in kind_bytes.items()}
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    closed_for_kind: dict[tuple[torch.dtype, torch.device], int] = {}
    buckets: list[list[int]] = []
    for index, tensor in enumerate(tensors):
        kind = (tensor.dtype, tensor.device)
        members, used = open_buckets.get(kind, ([], 0))
        members.append(index)
        used += tensor.numel() * tensor.element_size()
        closed = closed_for_kind.get(kind, 0)
        if closed == 0:
            cap = first_cap_bytes
        else:
            cap = min(later_caps[kind], first_cap_bytes << closed) if growing else later_caps[kind]
        if used >= cap:
            buckets.append(members)
            closed_for_kind[kind] = closed + 1
            members, used = [], 0
        open_buckets[kind] = (members, used)
    buckets.extend(members for members, _ in open_buckets.values() if members)
    return sorted(buckets, key=lambda members: members[0])


def _on_the_host(device: torch.device) -> bool:
    """Whether a kind's gradients are on the CPU (a layout planned on the meta device, without
    memory, counts as the CPU's)."""
    return device.type in ("cpu", "meta")


@dataclass(eq=False)
class Bucket:
    """One bucket's parameters and the flat buffer their gradients are reduced in.

    ``buffer`` holds the gradients (``grads``, with one view per parameter) followed by one
    flag per parameter (``flags``: 1 where this rank has a gradient). Reducing the whole
    buffer sums the flags too, so "which parameters have a gradient anywhere" travels with
    the gradients and costs no collective of its own.

    Parameters smaller than ``batch_below_numel`` elements ("batched": their gradients are
    copied in together when the bucket launches, see DistributedDataParallel) lie first and
    contiguous, in slot order, in ``batched_region``, so one pass divides them all (a call per
    small tensor costs more than its data); the larger ones follow. A bucket with a gradient of
    ``UNBATCHED_BESIDE_BYTES`` or more batches nothing: each small gradient kept until the
    launch would sit in the heap between the large gradients that backward frees one by one,
    and glibc cannot reuse the holes they leave (benchmarks/memory.py: ~10 MiB more peak memory
    on the 8 x 1024 MLP), while beside such copies a few calls more cost nothing. The layout
    inside a bucket is free: it is reduced as a whole.
    """

    index: int
    parameters: list[torch.nn.Parameter]
    names: list[str]
    buffer: Tensor
    grads: Tensor
    flags: Tensor
    views: list[Tensor]
    batched_slots: list[int]
    batched_region: Tensor
    batched_parameters: list[Tensor]  # in batched_slots order
    batched_views: list[Tensor]
    ready: list[bool] = field(default_factory=list)
    pending: int = 0
    #: (parameter, view) pairs of batched slots whose gradients arrived in this backward.
    batched: list[tuple[Tensor, Tensor]] = field(default_factory=list)

    @classmethod
    def build(cls, index: int, parameters: list[torch.nn.Parameter], names: list[str],
              batch_below_numel: int = 0) -> Bucket:
        if any(p.numel() * p.element_size() >= UNBATCHED_BESIDE_BYTES for p in parameters):
            batch_below_numel = 0  # every gradient is copied in its hook
        total = sum(p.numel() for p in parameters)
        buffer = torch.zeros(total + len(parameters), dtype=parameters[0].dtype, device=parameters[0].device)
        grads, flags = buffer[:total], buffer[total:]
        batched_slots = [slot for slot, p in enumerate(parameters) if p.numel() < batch_below_numel]
        others = [slot for slot, p in enumerate(parameters) if p.numel() >= batch_below_numel]
        layout = batched_slots + others
        views: list[Tensor] = [grads] * len(parameters)  # placeholders, each replaced below
        offset = 0
        for slot in layout:
            views[slot] = grads[offset : offset + parameters[slot].numel()].view_as(parameters[slot])
            offset += parameters[slot].numel()
        batched_numel = sum(parameters[slot].numel() for slot in batched_slots)
        bucket = cls(index, parameters, names, buffer, grads, flags, views, batched_slots, grads[:batched_numel],
                     [parameters[slot] for slot in batched_slots], [views[slot] for slot in batched_slots])
        bucket.reset()
        return bucket

    def reset(self) -> None:
        """Forget which gradients arrived: the start of a new backward."""
        self.ready = [False] * len(self.parameters)
        self.pending = len(self.parameters)
        self.batched = []
