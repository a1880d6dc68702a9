"""Averaging sparse gradients over a process group, as sparse tensors.

``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)`` give their weight a sparse
COO gradient: only the rows looked up in the batch. ddpkit's DistributedDataParallel keeps these
parameters out of its dense buckets (as torch's Reducer does) and averages them here after the
dense buckets, so the optimizer receives a sparse gradient, as in one process (``SparseAdam``
needs one).

How: each rank coalesces its gradient (duplicate rows summed), the ranks exchange one small
header (has a gradient, number of rows), then all-gather the row indices and the rows, padded
to the largest count. Every rank builds the same sum from the same gathered pieces, so the
ranks agree bit for bit. Bytes sent grow with the rows touched on every rank, not with the
embedding's size. Only dense collectives are used, so it works on Gloo and NCCL alike.

When the gradient is dense on some rank (the weight was also used by a dense operation, e.g.
tied with an output layer), every rank averages it as a dense tensor and gets a dense result:
one process would get a dense gradient too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddpkit.diagnostics.waits import run_collective

__all__ = ["average_sparse_gradients", "sparse_gradient_parameters"]

# Header states of one parameter on one rank.
_NO_GRADIENT, _SPARSE, _DENSE = 0, 1, 2


def sparse_gradient_parameters(module: nn.Module) -> set[int]:
    """``id`` of every parameter that receives sparse gradients: the weights of embeddings
    built with ``sparse=True`` (how torch's DDP finds them too)."""
    return {id(submodule.weight) for submodule in module.modules()
            if isinstance(submodule, (nn.Embedding, nn.EmbeddingBag)) and submodule.sparse}


def average_sparse_gradients(parameters: Sequence[Tensor], group: Any, scale: float) -> None:
    """Replace each parameter's gradient by ``scale`` times its sum over the ranks of ``group``.

    Every rank must pass the same parameters in the same order. A parameter with no gradient on
    any rank keeps ``grad=None``; a rank without one contributes nothing.
    """
    world_size = dist.get_world_size(group)
    local = [_coalesced(parameter.grad) for parameter in parameters]
    device = parameters[0].device
    header = torch.tensor([_header(grad) for grad in local], dtype=torch.long, device=device)
    headers = [torch.empty_like(header) for _ in range(world_size)]
    run_collective(dist.all_gather, headers, header, group=group)
    everyone = torch.stack(headers).cpu().tolist()  # [rank][parameter] -> [state, rows, sparse dims]
    for index, (parameter, grad) in enumerate(zip(parameters, local)):
        states = [rank_headers[index] for rank_headers in everyone]
        if all(state == _NO_GRADIENT for state, _, _ in states):
            continue
        if any(state == _DENSE for state, _, _ in states):
            parameter.grad = _average_dense(parameter, grad, group, scale)
        else:
            sparse_dims = max(dims for _, _, dims in states)
            parameter.grad = _average_sparse(parameter, grad, [rows for _, rows, _ in states], sparse_dims,
                                             group, scale)


def _coalesced(grad: Tensor | None) -> Tensor | None:
    return grad.coalesce() if grad is not None and grad.is_sparse else grad


def _header(grad: Tensor | None) -> list[int]:
    if grad is None:
        return [_NO_GRADIENT, 0, 0]
    if grad.is_sparse:
        return [_SPARSE, grad._nnz(), grad.sparse_dim()]
    return [_DENSE, 0, 0]


def _average_dense(parameter: Tensor, grad: Tensor | None, group: Any, scale: float) -> Tensor:
    if grad is None:
        summed = torch.zeros_like(parameter)
    else:
        summed = (grad.to_dense() if grad.is_sparse else grad) * scale
    run_collective(dist.all_reduce, summed, group=group)
    return summed


def _average_sparse(parameter: Tensor, grad: Tensor | None, rows: list[int], sparse_dims: int, group: Any,
                    scale: float) -> Tensor:
    most = max(rows)
    row_shape = tuple(parameter.shape[sparse_dims:])
    indices = torch.zeros((sparse_dims, most), dtype=torch.long, device=parameter.device)
    values = torch.zeros((most, *row_shape), dtype=parameter.dtype, device=parameter.device)
    if grad is not None:
        indices[:, : grad._nnz()] = grad._indices()
        torch.mul(grad._values(), scale, out=values[: grad._nnz()])
    gathered_indices = [torch.empty_like(indices) for _ in rows]
    gathered_values = [torch.empty_like(values) for _ in rows]
    run_collective(dist.all_gather, gathered_indices, indices, group=group)
    run_collective(dist.all_gather, gathered_values, values, group=group)
    summed = torch.sparse_coo_tensor(
        torch.cat([piece[:, :count] for piece, count in zip(gathered_indices, rows)], dim=1),
        torch.cat([piece[:count] for piece, count in zip(gathered_values, rows)]),
        size=parameter.shape,
        check_invariants=False,  # built from valid gradients; checking costs a pass over the indices
    )
    return summed.coalesce()
