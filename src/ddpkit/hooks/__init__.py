"""Communication hooks for torch's and ddpkit's DistributedDataParallel (see ``default``)."""

from ddpkit.hooks.default import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
    noop_hook,
)

__all__ = [
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "noop_hook",
]
