"""Collectives (Lightning's ``utilities.distributed`` API), each through the diagnostics wrapper.

Every collective is an identity or a no-op when torch.distributed is not initialised, so the
same code runs in one process and in many. Every ``group`` argument is honoured, including
subgroups that do not contain global rank 0: ranks given to a collective (``src``) count
inside the group, and ddpkit translates them to global ranks for torch.
"""

from __future__ import annotations

import ctypes
import math
import pickle
import zlib
from typing import Any, Union

import torch
import torch.distributed as dist
from torch import Tensor

from ddpkit.comm.collective_call import collective, collective_call
from ddpkit.comm.primitives import (
    ProcessGroup,
    all_gather_bytes,
    all_gather_stacked,
    communication_device,
    group_rank_and_size,
)
from ddpkit.diagnostics.waits import run_collective, wait_for
from ddpkit.membership.connection import distributed_available

__all__ = [
    "AllGatherGrad",
    "ReduceOpLike",
    "all_gather_ddp_if_available",
    "all_gather_object",
    "barrier",
    "broadcast",
    "broadcast_object",
    "gather_all_tensors",
    "sync_ddp",
    "sync_ddp_if_available",
]

ReduceOpLike = Union[str, "dist.ReduceOp", None]

# The shape header of `gather_all_tensors` has a fixed length, so that ranks agree on its size
# before they know each other's shapes: [ndim, dtype code, size_0 .. size_{MAX-1}].
_MAX_GATHER_NDIM = 16
_TOO_MANY_DIMS = -1


# ---------------------------------------------------------------------------------------------
# Gathers


class AllGatherGrad(torch.autograd.Function):
    """All-gather that keeps gradients: forward stacks every rank's tensor into
    ``(world_size, *shape)``; backward gives each rank's input the *sum*, over all ranks, of the
    gradients that reached its slice (as Lightning and ``torch.distributed.nn`` do). Every rank
    must run the backward, since it is a collective too.
    """

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: ProcessGroup = None) -> Tensor:
        rank, world_size = group_rank_and_size(group)
        ctx.group, ctx.rank = group, rank
        return all_gather_stacked(tensor, group, world_size)

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor) -> tuple[Tensor, None]:
        # all_reduce works in place; the incoming gradient may be shared, so reduce a copy.
        grad = grad_output[0].contiguous().clone()
        if grad.numel() > 0:
            with collective_call("AllGatherGrad backward", ctx.group, grad):  # after the forward's seam ended
                run_collective(dist.all_reduce, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[ctx.rank], None


@collective("tensor")  # same shape on every rank: different ones would abort the process in Gloo
def all_gather_ddp_if_available(tensor: Tensor, group: ProcessGroup = None, sync_grads: bool = False) -> Tensor:
    """Gather ``tensor`` (same shape on every rank) from all ranks of ``group``: ``(world_size, *shape)``.

    With ``sync_grads=True`` gradients flow back to every rank's input (see ``AllGatherGrad``).
    In one process it returns ``tensor`` unchanged, as Lightning does.
    """
    if not distributed_available():
        return tensor
    if sync_grads:
        return AllGatherGrad.apply(tensor, group)  # type: ignore[no-untyped-call, no-any-return]  # torch: unannotated
    _, world_size = group_rank_and_size(group)
    return all_gather_stacked(tensor, group, world_size)


def _exchange_with_peers(sends: list[Tensor], receives: list[Tensor], rank: int, group: ProcessGroup) -> None:
    """Send ``sends[peer]`` to, and receive ``receives[peer]`` from, every other rank of ``group``.

    Both sides know every size, so empty messages are skipped on both ends consistently.
    """
    operations = []
    for peer, (send, receive) in enumerate(zip(sends, receives)):
        if peer == rank:
            continue
        global_peer = peer if group is None else dist.get_global_rank(group, peer)
        if send.numel() > 0:
            operations.append(dist.P2POp(dist.isend, send, global_peer, group))
        if receive.numel() > 0:
            operations.append(dist.P2POp(dist.irecv, receive, global_peer, group))
    if operations:
        for request in dist.batch_isend_irecv(operations):
            wait_for(request, group)  # in slices: a peer's failure ends the wait


class _UnevenAllGather(torch.autograd.Function):
    """Every rank's flat tensor, whatever their lengths, one output per rank.

    Each rank sends its tensor to every other rank point to point: only real elements travel,
    with no padding and no staging copy: faster than an uneven all-to-all (which needs a
    world_size-fold send buffer) or a padded all_gather (benchmarks/README.md). The backward sends
    each piece's gradient to the rank that owns it, which sums what it receives (as
    ``AllGatherGrad`` does).
    """

    @staticmethod
    def forward(ctx: Any, flat: Tensor, group: ProcessGroup, numels: list[int], rank: int) -> tuple[Tensor, ...]:
        ctx.group, ctx.numels, ctx.rank = group, numels, rank
        pieces = [flat.new_empty(numel) for numel in numels]
        _exchange_with_peers([flat] * len(numels), pieces, rank, group)
        pieces[rank].copy_(flat)
        return tuple(pieces)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, None, None, None]:
        # Autograd fills the gradients of unused pieces with zeros (materialize_grads), so each is a tensor.
        mine = ctx.numels[ctx.rank]
        sends = [grad.contiguous() for grad in grads]
        received = [sends[ctx.rank].new_empty(mine) for _ in ctx.numels]
        with collective_call("gather_all_tensors backward", ctx.group, compare_shape=False):
            _exchange_with_peers(sends, received, ctx.rank, ctx.group)
        received[ctx.rank] = sends[ctx.rank]
        return torch.stack(received).sum(dim=0), None, None, None


@collective("result", compare_shape=False)
def gather_all_tensors(result: Tensor, group: ProcessGroup = None, sync_grads: bool = False) -> list[Tensor]:
    """Gather ``result`` from every rank of ``group`` into a list, one tensor per rank.

    Tensors must have the same ndim and dtype on every rank, but any dimension may differ
    (0-size and 0-dim tensors included). Sizes are exchanged in one small message; then equal
    shapes take one all_gather, and uneven ones a point-to-point exchange of the real elements
    (no padding, no trimming; see ``_UnevenAllGather``).
    A mismatch of ndim or dtype raises ``ValueError`` on every rank. With ``sync_grads=True``
    gradients flow back to each rank's input, summed over ranks as in ``AllGatherGrad``.
    In one process it returns ``[result]``.

    Example::

        >>> import torch, ddpkit
        >>> ddpkit.gather_all_tensors(torch.arange(3))  # rank r's tensor may have r + 3 rows: no padding
        [tensor([0, 1, 2])]
    """
    if not distributed_available():
        return [result]
    rank, world_size = group_rank_and_size(group)
    shapes = _exchange_shapes(result, group, world_size, rank)
    source = result if sync_grads else result.detach()

    if all(shape == shapes[0] for shape in shapes):
        if sync_grads:
            stacked = AllGatherGrad.apply(source, group)  # type: ignore[no-untyped-call]  # torch: unannotated
        else:
            stacked = all_gather_stacked(source, group, world_size)
        return list(stacked.unbind(0))

    numels = [math.prod(shape) for shape in shapes]
    pieces = _UnevenAllGather.apply(source.contiguous().reshape(-1), group, numels, rank)  # type: ignore[no-untyped-call]
    return [piece.view(shape) for piece, shape in zip(pieces, shapes)]


def _exchange_shapes(result: Tensor, group: ProcessGroup, world_size: int, rank: int,
                     operation: str = "gather_all_tensors") -> list[tuple[int, ...]]:
    """Every rank's shape, after checking that ndim and dtype agree (raising on every rank if not)."""
    dtype_code = zlib.crc32(str(result.dtype).encode())  # stable across processes, unlike hash()
    if result.ndim > _MAX_GATHER_NDIM:
        fields = [_TOO_MANY_DIMS, dtype_code]  # still take part, so the other ranks raise instead of hanging
    else:
        fields = [result.ndim, dtype_code, *result.shape]
    fields += [0] * (2 + _MAX_GATHER_NDIM - len(fields))
    header = torch.tensor(fields, dtype=torch.long, device=result.device)
    headers = all_gather_stacked(header, group, world_size).cpu().tolist()

    ndims = [row[0] for row in headers]
    if _TOO_MANY_DIMS in ndims:
        raise ValueError(
            f"{operation} supports tensors of at most {_MAX_GATHER_NDIM} dimensions; rank(s) "
            f"{[r for r, n in enumerate(ndims) if n == _TOO_MANY_DIMS]} passed more. Reshape first."
        )
    if len(set(ndims)) > 1:
        raise ValueError(
            f"{operation} needs the same number of dimensions on every rank, got ndim per rank {ndims} "
            f"(this is rank {rank}, shape {tuple(result.shape)}). Reshape so that every rank passes the same ndim."
        )
    if len({row[1] for row in headers}) > 1:
        raise ValueError(
            f"{operation} needs the same dtype on every rank; rank {rank} has {result.dtype} and at least "
            "one other rank differs. Cast to a common dtype before gathering."
        )
    return [tuple(row[2 : 2 + ndims[0]]) for row in headers]


# ---------------------------------------------------------------------------------------------
# Reductions

_REDUCE_OP_NAMES = ("sum", "mean", "avg", "max", "min")


def _resolve_reduce_op(reduce_op: ReduceOpLike) -> tuple[Any, bool]:
    """Map ``reduce_op`` to (torch ReduceOp, whether to divide by the group size afterwards)."""
    if reduce_op is None:
        return dist.ReduceOp.SUM, False
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
        if name in ("mean", "avg"):
            return dist.ReduceOp.SUM, True
        if name in ("sum", "max", "min"):
            return getattr(dist.ReduceOp, name.upper()), False
        raise ValueError(
            f"reduce_op={reduce_op!r} is not a known reduction; use one of {', '.join(map(repr, _REDUCE_OP_NAMES))} "
            "or a torch.distributed.ReduceOp."
        )
    if isinstance(reduce_op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        # The stubs type ReduceOp and RedOpType apart; at runtime they compare equal.
        if reduce_op == dist.ReduceOp.AVG:  # type: ignore[comparison-overlap]  # Gloo has no AVG: sum, then divide
            return dist.ReduceOp.SUM, True
        return reduce_op, False
    raise TypeError(
        f"reduce_op must be a string ({', '.join(_REDUCE_OP_NAMES)}), a torch.distributed.ReduceOp or None, "
        f"got {type(reduce_op).__name__}: {reduce_op!r}."
    )


def _as_tensor(result: Tensor | float | int | bool, group: ProcessGroup) -> Tensor:
    if isinstance(result, Tensor):
        return result
    if not isinstance(result, (int, float, bool)):
        raise TypeError(f"sync_ddp reduces tensors and numbers, got {type(result).__name__}: {result!r}.")
    return torch.tensor(result, device=communication_device(group) if distributed_available() else None)


@collective("result")
def sync_ddp(result: Tensor | float | int, group: ProcessGroup = None, reduce_op: ReduceOpLike = None) -> Tensor:
    """Reduce ``result`` over the ranks of ``group`` and return the reduced value on every rank.

    ``reduce_op``: ``None``/``"sum"`` (default), ``"mean"``/``"avg"``, ``"max"``, ``"min"`` or a
    ``torch.distributed.ReduceOp``. Numbers are accepted and returned as tensors. Integer and
    bool tensors averaged give a floating-point result (default dtype) instead of a silently
    truncated one. The input tensor is not modified. In one process the value passes through
    (as a tensor).

    Example::

        >>> import torch, ddpkit
        >>> ddpkit.sync_ddp(torch.tensor([1.0, 2.0]), reduce_op="sum")  # on two ranks: [2., 4.]
        tensor([1., 2.])
        >>> ddpkit.sync_ddp(3, reduce_op="mean")
        tensor(3.)
    """
    op, divide = _resolve_reduce_op(reduce_op)
    tensor = _as_tensor(result, group)
    if divide and not (tensor.is_floating_point() or tensor.is_complex()):
        tensor = tensor.to(torch.get_default_dtype())
    if not distributed_available():
        return tensor
    _, world_size = group_rank_and_size(group)
    reduced = tensor.detach().clone()  # torch reduces in place; the caller's tensor stays as it was
    run_collective(dist.all_reduce, reduced, op=op, group=group)
    if divide:
        reduced /= world_size
    return reduced


def sync_ddp_if_available(
    result: Tensor | float | int, group: ProcessGroup = None, reduce_op: ReduceOpLike = None
) -> Tensor | float | int:
    """``sync_ddp`` when distributed; otherwise ``result`` unchanged (``reduce_op`` is still checked)."""
    if distributed_available():
        return sync_ddp(result, group=group, reduce_op=reduce_op)
    _resolve_reduce_op(reduce_op)
    return result


# ---------------------------------------------------------------------------------------------
# Objects, barriers, hooks


@collective("tensor")
def broadcast(tensor: Tensor, src: int = 0, group: ProcessGroup = None) -> Tensor:
    """Copy rank ``src``'s ``tensor`` (``src`` counts inside ``group``) into every rank's ``tensor``,
    in place, and return it; an identity when not distributed.

    torch's broadcast on Gloo, given tensors of different sizes, exits 0 and leaves garbage in
    the receiver. Here every rank first shares its shape and dtype (one all-gather of 18
    integers) and, if they differ, all raise ``ValueError`` naming the ranks and shapes, before
    any data moves. For data whose shape only the source knows, use ``broadcast_object``.
    """
    if not distributed_available():
        return tensor
    rank, world_size = group_rank_and_size(group)
    if not 0 <= src < world_size:
        raise ValueError(f"broadcast src={src} is not a rank of the group (ranks 0..{world_size - 1}, counted "
                         "inside the group).")
    shapes = _exchange_shapes(tensor, group, world_size, rank, operation="broadcast")
    differing = [other for other, shape in enumerate(shapes) if shape != shapes[src]]
    if differing:
        raise ValueError(
            f"broadcast needs the source's shape on every rank: source rank {src} has {shapes[src]}, but "
            + ", ".join(f"rank {other} has {shapes[other]}" for other in differing)
            + ". Give every rank a tensor of the source's shape (or use broadcast_object when only the source "
            "knows the shape)."
        )
    run_collective(dist.broadcast, tensor, src=src if group is None else dist.get_global_rank(group, src), group=group)
    return tensor


@collective()
def broadcast_object(obj: Any, src: int = 0, group: ProcessGroup = None) -> Any:
    """Send a picklable ``obj`` from rank ``src`` of ``group`` to all its ranks and return it.

    ``src`` counts inside ``group`` (0 is the group's first member), so the default works for
    subgroups that do not contain global rank 0. The size travels first, then the bytes, so a
    receiver never reads a buffer of the wrong length. Unlike ``broadcast_object_list`` this
    needs no numpy. ``src`` gets ``obj`` itself back; in one process ``obj`` is returned.
    """
    if not distributed_available():
        return obj
    rank, world_size = group_rank_and_size(group)
    if not 0 <= src < world_size:
        raise ValueError(f"src={src} is not a rank of the group, whose ranks are 0..{world_size - 1}.")
    global_src = src if group is None else dist.get_global_rank(group, src)
    device = communication_device(group)
    if rank == src:
        payload = _pickle(obj)
        size = torch.tensor([payload.numel()], dtype=torch.long, device=device)
    else:
        size = torch.zeros(1, dtype=torch.long, device=device)
    run_collective(dist.broadcast, size, src=global_src, group=group)
    if rank != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    data = payload.to(device)
    run_collective(dist.broadcast, data, src=global_src, group=group)
    return obj if rank == src else _unpickle(data)


@collective()
def all_gather_object(obj: Any, group: ProcessGroup = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order of ``group``; ``[obj]`` in one process.

    Pickled and gathered as byte strings of any length (``primitives.all_gather_bytes``, which the
    seam's debug fingerprints use too); unlike torch's ``all_gather_object`` this needs no numpy.
    """
    if not distributed_available():
        return [obj]
    return [pickle.loads(theirs) for theirs in all_gather_bytes(pickle.dumps(obj), group)]


def _pickle(obj: Any) -> Tensor:
    """``obj`` pickled into a CPU byte tensor, ready to send."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _unpickle(data: Tensor) -> Any:
    data = data.cpu().contiguous()
    return pickle.loads(ctypes.string_at(data.data_ptr(), data.numel()))  # a memcpy; tolist() is O(n) Python


@collective()
def barrier(group: ProcessGroup = None) -> None:
    """Wait until every rank of ``group`` arrives; a no-op when not distributed."""
    if distributed_available():
        group_rank_and_size(group)
        run_collective(dist.barrier, group=group)
