"""Batch normalization over the whole group's batch, on any device and backend (Gloo/CPU included).

torch's ``nn.SyncBatchNorm`` runs only on CUDA (on CPU it raises "expected input tensor to be on
GPU"). ``SyncBatchNorm`` here has its constructor, attributes and ``convert_sync_batchnorm``, and
computes the same thing with plain collectives:

- forward (training): each rank's per-channel count, mean and sum of squared deviations are
  all-gathered and combined (the parallel variance formula: no cancellation, any batch size per
  rank, zero included); the running statistics get the group's mean and unbiased variance, as
  ``nn.BatchNorm`` would on the concatenated batch;
- backward: the per-channel sums of the output gradient and of its product with the normalised
  input are all-reduced, so each rank's input gradient is the one-process input gradient of its
  rows. ``weight`` and ``bias`` get this rank's share (the sum over its own rows), which DDP
  then averages like any gradient, as with torch's SyncBatchNorm;
- in a world that shrank (``ddpkit.membership.group``) a rank that trains several shares of each global
  batch has its loss averaged over all their rows, so its output gradient is that much smaller
  than a rank's with one share: its sums count that many times in the all-reduce, and it divides
  the result back, so every rank's input gradient is still the one-process one (the DDP module
  then weights each rank's gradients by its shares).

Both collectives run inside ddpkit's diagnostics seam (``collective_call``): a rank that fails
is named, and under in-place recovery a rank lost while the others are in a batch norm is
replaced like one lost in the gradients' all-reduce.

Statistics are computed in at least float32 (bf16/fp16 inputs are normalised in float32 and the
output cast back). In evaluation with running statistics, and without a process group of more
than one rank, it is plain batch norm and communicates nothing.

It is not a subclass of ``nn.SyncBatchNorm``: torch's DDP refuses any module containing one
unless the module is on CUDA, and this one is meant to work under either DDP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddpkit.comm.collective_call import collective_call
from ddpkit.diagnostics.waits import run_collective
from ddpkit.membership.group import current_group

__all__ = ["SyncBatchNorm", "share_batch_norm_state"]


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch norm whose batch statistics are those of the whole process group's batch.

    The same constructor as ``nn.SyncBatchNorm``; ``process_group=None`` is the default group.
    Works on inputs of shape (N, C, ...) with N >= 0 on each rank.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any = None, device: Any = None,
                 dtype: Any = None, *, bias: bool = True) -> None:
        # torch added `bias` to batch norm in 2.13; earlier releases (pyproject admits torch>=2.4)
        # always have one, so the argument is passed only when it asks for something else.
        without_bias = {"bias": False} if affine and not bias else {}
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, **without_bias)
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects input of shape (N, C, ...); got {input.dim()}D input of shape "
                             f"{tuple(input.shape)}.")
        if input.size(1) != self.num_features:
            raise ValueError(f"SyncBatchNorm was made for {self.num_features} channels; got input of shape "
                             f"{tuple(input.shape)} with {input.size(1)} in dimension 1.")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        uses_batch_statistics = self.training or not self.track_running_stats
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        synchronised = (uses_batch_statistics and dist.is_available() and dist.is_initialized()
                        and dist.get_world_size(group) > 1)
        if not synchronised:
            return nn.modules.batchnorm._BatchNorm.forward(self, input)

        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        update_running = self.training and self.track_running_stats
        return _SynchronisedBatchNorm.apply(  # type: ignore[no-untyped-call, no-any-return]  # torch: unannotated
            input, self.weight, self.bias,
            self.running_mean if update_running else None, self.running_var if update_running else None,
            self.eps, momentum, group,
        )

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: Any = None) -> nn.Module:
        """``module`` with every batch-norm layer (``nn.BatchNorm1d/2d/3d``, torch's
        ``SyncBatchNorm``) replaced by this class, sharing its parameters and buffers. Other
        ``_BatchNorm`` subclasses are replaced too, as torch's ``convert_sync_batchnorm`` does."""
        converted = module
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, cls):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group, bias=module.bias is not None)
            share_batch_norm_state(module, converted)
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted


def share_batch_norm_state(source: nn.Module, target: nn.Module) -> None:
    """Give ``target``, a batch norm made to replace ``source``, its parameters and buffers (the same
    tensors, not copies), its mode and its quantisation config."""
    if getattr(source, "affine", False):
        with torch.no_grad():
            target.weight = source.weight
            target.bias = source.bias
    target.running_mean = source.running_mean
    target.running_var = source.running_var
    target.num_batches_tracked = source.num_batches_tracked
    target.training = source.training
    if hasattr(source, "qconfig"):
        target.qconfig = source.qconfig


def _shares_held(group: Any) -> int:
    """How many shares of each global batch this rank trains in ``group``: more than one only in the
    default group of a world that shrank (``ddpkit.membership.group``)."""
    if group is not dist.group.WORLD or (current := current_group()) is None:
        return 1
    return len(current.membership.shares)


def _reduced_dims(input: Tensor) -> list[int]:
    return [0, *range(2, input.dim())]


def _per_channel(values: Tensor, like: Tensor) -> Tensor:
    """A per-channel vector shaped to broadcast over ``like`` (N, C, ...)."""
    return values.view(1, -1, *([1] * (like.dim() - 2)))


class _SynchronisedBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: Tensor, weight: Tensor | None, bias: Tensor | None,
                running_mean: Tensor | None, running_var: Tensor | None,
                eps: float, momentum: float, group: Any) -> Tensor:
        compute_dtype = torch.promote_types(input.dtype, torch.float32)
        values = input.to(compute_dtype)
        dims = _reduced_dims(input)
        channels = input.shape[1]
        count = input.numel() // channels
        if count > 0:
            local_mean = values.mean(dims)
            local_m2 = (values - _per_channel(local_mean, values)).square().sum(dims)
        else:  # this rank has no rows this step: it contributes nothing, but takes part
            local_mean = values.new_zeros(channels)
            local_m2 = values.new_zeros(channels)
        local = torch.stack([local_mean.new_full((channels,), float(count)), local_mean, local_m2])
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        with collective_call("SyncBatchNorm forward", group, local):  # a lost peer: PeerLostError, recoverable
            run_collective(dist.all_gather, gathered, local, group=group)
        counts, means, m2s = torch.stack(gathered).unbind(1)  # each (world, C)
        total = counts[:, 0].sum()
        if total.item() <= 1:
            raise ValueError(
                f"SyncBatchNorm needs more than 1 value per channel across the group when training; got input "
                f"shape {tuple(input.shape)} on this rank and {int(total.item())} value(s) per channel in all. "
                "Use a larger batch, or call model.eval() to use the running statistics."
            )
        mean = (counts * means).sum(0) / total
        m2 = m2s.sum(0) + (counts * (means - mean).square()).sum(0)
        variance = m2 / total
        invstd = torch.rsqrt(variance + eps)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                unbiased = m2 / (total - 1)
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)

        normalised = (values - _per_channel(mean, values)) * _per_channel(invstd, values)
        output = normalised
        if weight is not None:
            output = output * _per_channel(weight.to(compute_dtype), values)
        if bias is not None:
            output = output + _per_channel(bias.to(compute_dtype), values)
        ctx.save_for_backward(normalised, invstd, weight)
        # The default group is looked up again in backward rather than held: the graph outlives the
        # step (the loss the script keeps holds it), and a reference to an abandoned group keeps
        # its connections open, holding the other survivors of a lost rank (``Group.abort``).
        ctx.group = None if group is dist.group.WORLD else group
        ctx.total, ctx.input_dtype = total, input.dtype
        ctx.shares = _shares_held(group)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return output.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        normalised, invstd, weight = ctx.saved_tensors
        dims = _reduced_dims(grad_output)
        grad = grad_output.to(normalised.dtype)
        local_sums = torch.stack([grad.sum(dims), (grad * normalised).sum(dims)])  # zeros for a rank without rows
        # In the scale of a rank that trains one share (the module docstring says why).
        global_sums = local_sums * ctx.shares if ctx.shares != 1 else local_sums.clone()
        group = dist.group.WORLD if ctx.group is None else ctx.group
        with collective_call("SyncBatchNorm backward", group, global_sums):
            run_collective(dist.all_reduce, global_sums, group=group)
        mean_grad, mean_grad_normalised = (global_sums / (ctx.total * ctx.shares)).unbind(0)
        scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
        grad_input = (grad - _per_channel(mean_grad, grad)
                      - normalised * _per_channel(mean_grad_normalised, grad)) * _per_channel(scale, grad)
        # This rank's share of the parameter gradients: DDP averages them like any other.
        grad_weight = local_sums[1].to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = local_sums[0].to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        return grad_input.to(ctx.input_dtype), grad_weight, grad_bias, None, None, None, None, None
