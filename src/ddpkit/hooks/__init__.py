"""Communication hooks for torch's and ddpkit's DistributedDataParallel (see ``default``)."""

from ddpkit.hooks.contract import elementwise_average
from ddpkit.hooks.default import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
    noop_hook,
)
from ddpkit.hooks.powersgd import PowerSGDState, powerSGD_hook

__all__ = [
    "PowerSGDState",
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "elementwise_average",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "noop_hook",
    "powerSGD_hook",
]
