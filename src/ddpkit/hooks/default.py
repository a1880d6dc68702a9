"""Communication hooks with torch's signature, ``hook(state, bucket) -> Future[Tensor]``.

They run unchanged on ``torch.nn.parallel.DistributedDataParallel`` and on
``ddpkit.DistributedDataParallel``; ``state`` is the process group (``None``: the world).

Differences from ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``, on purpose:

- ``allreduce_hook`` multiplies by 1/world_size before summing, as DDP without a hook does,
  so its results are identical to no hook (torch's divides, which rounds differently on
  3 ranks).
- The compression hooks divide in the gradient's own precision *before* casting: a gradient
  beyond fp16's range (65504) on one rank whose mean fits still arrives (torch casts first and
  gets inf). Non-finite values stay non-finite.
- ``bf16_compress_hook`` works on Gloo: Gloo sums bfloat16 itself, so no CUDA/NCCL is needed
  (torch's refuses to run there).

On ddpkit's module ``allreduce_hook`` is bit-identical to no hook on any number of ranks: it
all-reduces the same buffer (negotiation flags included) with the same arithmetic. torch's own
``allreduce_hook`` divides after summing, which rounds differently on 3 ranks or more.

These three are declared ``elementwise_average`` (``ddpkit.hooks.contract``): they return the
elementwise average of the whole buffer. ddpkit's DDP then divides by the group size while
copying gradients into the bucket, a pass it makes anyway, so the hook skips its own
(``bucket.prescaled()``), and appends its negotiation flags to the buffer, so dynamic graphs
need no separate message. Declare your own hook so only if that promise holds; torch's DDP
ignores it.

Annotations here are real objects, not strings (no ``from __future__ import annotations``):
torch's DDP checks that a hook's ``bucket`` is annotated as ``GradBucket``.
"""

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

# torch.distributed.GradBucket itself (the stubs do not re-export it), so torch's DDP accepts the annotation.
from torch._C._distributed_c10d import GradBucket

from ddpkit.hooks.contract import GradBucket as DdpkitGradBucket
from ddpkit.hooks.contract import elementwise_average

__all__ = [
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "noop_hook",
]

Hook = Callable[[Any, GradBucket], torch.futures.Future[Tensor]]


def _first(value: Any) -> Tensor:
    """A future's value: a tensor, or (older hooks) a one-element list of it."""
    return cast(Tensor, value[0] if isinstance(value, (list, tuple)) else value)


def _divide_unless_prescaled(buffer: Tensor, process_group: Any, bucket: GradBucket) -> Tensor:
    """Divide by the group size, unless ddpkit's DDP already did while filling the bucket."""
    if isinstance(bucket, DdpkitGradBucket) and bucket.prescaled():
        return buffer
    return buffer.mul_(1.0 / dist.get_world_size(process_group))


@elementwise_average
def allreduce_hook(process_group: Any, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    """Average the bucket by one all-reduce: the same result as registering no hook."""
    buffer = bucket.buffer()
    _divide_unless_prescaled(buffer, process_group, bucket)
    future = dist.all_reduce(buffer, group=process_group, async_op=True).get_future()
    return cast("torch.futures.Future[Tensor]", future.then(lambda done: _first(done.value())))


def _compress_hook(dtype: torch.dtype, process_group: Any, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    buffer = bucket.buffer()
    # Divide first, in the gradient's precision; the cast then only has to hold the mean.
    compressed = _divide_unless_prescaled(buffer, process_group, bucket).to(dtype)
    future = dist.all_reduce(compressed, group=process_group, async_op=True).get_future()

    def decompress(done: torch.futures.Future[Any]) -> Tensor:
        buffer.copy_(_first(done.value()))  # in place: no second full-precision copy
        return buffer

    return cast("torch.futures.Future[Tensor]", future.then(decompress))


@elementwise_average
def fp16_compress_hook(process_group: Any, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    """All-reduce the bucket in float16 (half the bytes), averaged, decompressed in place.

    Example::

        >>> import torch, ddpkit
        >>> ddpkit.init_dist_connection(ddpkit.detect_environment())
        >>> model = ddpkit.DistributedDataParallel(torch.nn.Linear(4, 2))
        >>> model.register_comm_hook(None, fp16_compress_hook)
        >>> model(torch.ones(1, 4)).sum().backward()
        >>> model.module.weight.grad.dtype  # the gradients stay float32
        torch.float32
        >>> ddpkit.destroy_dist_connection()
    """
    return _compress_hook(torch.float16, process_group, bucket)


@elementwise_average
def bf16_compress_hook(process_group: Any, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    """All-reduce the bucket in bfloat16 (half the bytes, fp32's range), averaged; works on Gloo.

    Example::

        >>> import torch, ddpkit
        >>> ddpkit.init_dist_connection(ddpkit.detect_environment())
        >>> model = ddpkit.DistributedDataParallel(torch.nn.Linear(4, 2))
        >>> model.register_comm_hook(None, bf16_compress_hook)
        >>> model(torch.ones(1, 4)).sum().backward()
        >>> ddpkit.destroy_dist_connection()
    """
    return _compress_hook(torch.bfloat16, process_group, bucket)


# torch's DDP refuses any hook *named* "bf16_compress_hook" unless CUDA and NCCL are present,
# because torch's own needs them. Ours runs on Gloo, so its function carries another name;
# the public attribute keeps torch's.
bf16_compress_hook.__name__ = "ddpkit_bf16_compress_hook"  # __qualname__ stays, so pickling finds it


def _compress_wrapper(dtype: torch.dtype, hook: Hook) -> Hook:
    def compressed_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[Tensor]:
        original = bucket.buffer()
        bucket.set_buffer(original.to(dtype))
        future = hook(state, bucket)

        def decompress(done: torch.futures.Future[Any]) -> Tensor:
            original.copy_(_first(done.value()))
            return original

        return future.then(decompress)

    compressed_hook.__name__ = f"{_dtype_name(dtype)}_compress_wrapper({getattr(hook, '__name__', 'hook')})"
    return compressed_hook


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.").replace("float16", "fp16").replace("bfloat16", "bf16")


def fp16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on a float16 copy of the bucket and cast its result back (compose with any hook)."""
    return _compress_wrapper(torch.float16, hook)


def bf16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on a bfloat16 copy of the bucket and cast its result back."""
    return _compress_wrapper(torch.bfloat16, hook)


def noop_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    """Communicate nothing: each rank keeps its own gradients. For measuring what communication
    costs (step time with this hook against the real one), never for training."""
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future
