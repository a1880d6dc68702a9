"""Communication hooks: step time and bytes per step, ddpkit's against torch's.

    python benchmarks/hooks.py [--steps 20]

Two Gloo ranks with one thread each, the 8 x Linear(1024, 1024) MLP of ddp_step.py (batch 64,
SGD). Timed in one run, interleaved in a shuffled order each round; medians of rank 0.
Bytes per step are those passed to torch.distributed.all_reduce in the last step (counted by
wrapping it); without a hook torch's DDP reduces in C++ and ddpkit's calls the process group
directly, so their bytes are not counted there (they are every gradient byte: ``allreduce``'s).

- ddpkit DDP with: no hook, ddpkit.hooks allreduce / fp16 / bf16, PowerSGD rank 1 and rank 4
  (start_powerSGD_iter=2, so every timed step is compressed), noop (communication removed);
- torch DDP with: no hook, torch's allreduce_hook and fp16_compress_hook. torch's
  bf16_compress_hook refuses to run without CUDA/NCCL, so it is not run; torch's
  powerSGD_hook aborts on Gloo with more than one bucket (this model has three), so PowerSGD
  is compared with one 64 MB bucket for both libraries ("PSGD r1 1bucket").

What bounds the step on this machine: compute (~43 ms for one process) plus the CPU that Gloo
spends reducing. fp16/bf16 halve the bytes but add two casts over 32 MB; PowerSGD sends
~1000x fewer bytes but adds matrix products and, in ddpkit, two blocking round trips per
bucket. Loopback on two shared cores cannot show bandwidth savings as wall-clock gains, so
the bytes column is the figure that carries to real networks.

The measured figures, with the command, are in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from ddpkit.distributed import register_ddp_comm_hook
from ddpkit.hooks import (
    PowerSGDState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    noop_hook,
    powerSGD_hook,
)
from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.testing import WorkerPool

sys.path.insert(0, str(Path(__file__).parent))
from _timing import interleaved_medians, sgd_step  # noqa: E402
from ddp_step import build  # noqa: E402  (the same models as the step benchmark)


class ByteCounter:
    """Wraps torch.distributed.all_reduce to count the bytes of the current step."""

    def __init__(self) -> None:
        self.step_bytes = 0
        self._original = dist.all_reduce
        counter = self

        def counted(tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
            counter.step_bytes += tensor.numel() * tensor.element_size()
            return counter._original(tensor, *args, **kwargs)

        dist.all_reduce = counted


def measure(steps: int) -> dict[str, tuple[float, int | None]]:
    base, batch, loss_fn = build("mlp")
    counter = ByteCounter()

    def copy() -> nn.Module:
        clone, _, _ = build("mlp")
        clone.load_state_dict(base.state_dict())
        return clone

    def ddpkit(hook: Callable[..., object] | None, state: object = None, **kwargs: float) -> nn.Module:
        model = DistributedDataParallel(copy(), **kwargs)
        register_ddp_comm_hook(model, ddp_comm_state=state, ddp_comm_hook=hook)
        return model

    def torch_ddp(hook: Callable[..., object] | None, state: object = None, **kwargs: float) -> nn.Module:
        model = nn.parallel.DistributedDataParallel(copy(), **kwargs)
        if hook is not None:
            model.register_comm_hook(state, hook)
        return model

    def powersgd(rank: int) -> PowerSGDState:
        return PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2)

    models: dict[str, tuple[nn.Module, bool]] = {  # (model, whether its bytes are countable)
        "ddpkit no hook": (ddpkit(None), False),
        "ddpkit allreduce": (ddpkit(allreduce_hook), True),
        "ddpkit fp16": (ddpkit(fp16_compress_hook), True),
        "ddpkit bf16": (ddpkit(bf16_compress_hook), True),
        "ddpkit PowerSGD r1": (ddpkit(powerSGD_hook, powersgd(1)), True),
        "ddpkit PowerSGD r4": (ddpkit(powerSGD_hook, powersgd(4)), True),
        "ddpkit noop": (ddpkit(noop_hook), True),
        "torch no hook": (torch_ddp(None), False),
        "torch allreduce": (torch_ddp(torch_hooks.allreduce_hook), True),
        "torch fp16": (torch_ddp(torch_hooks.fp16_compress_hook), True),
        # torch's PowerSGD runs on Gloo only with one bucket: compare both that way.
        "ddpkit PSGD r1 1bucket": (ddpkit(powerSGD_hook, powersgd(1), bucket_cap_mb=64), True),
        "torch PSGD r1 1bucket": (torch_ddp(torch_powersgd.powerSGD_hook, torch_powersgd.PowerSGDState(
            None, matrix_approximation_rank=1, start_powerSGD_iter=2), bucket_cap_mb=64), True),
    }
    x, y = batch(0)
    last_bytes: dict[str, int] = {}

    def step_of(model: nn.Module) -> Callable[[], None]:
        return sgd_step(model, loss_fn, x, y)

    def reset_bytes(name: str) -> None:
        counter.step_bytes = 0

    def record_bytes(name: str) -> None:
        last_bytes[name] = counter.step_bytes

    medians = interleaved_medians({name: step_of(model) for name, (model, _) in models.items()}, steps,
                                  before=reset_bytes, after=record_bytes)
    return {name: (medians[name], last_bytes[name] if countable else None) for name, (_, countable) in models.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description="Communication hook benchmark")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with WorkerPool(2, timeout=1800) as pool:
        results = pool.run(measure, args.steps)[0]
    gradient_bytes = 8 * (1024 * 1024 + 1024) * 4
    print(f"8 x Linear(1024, 1024), batch 64, 2 gloo ranks x 1 thread, medians of {args.steps} steps; "
          f"gradients {gradient_bytes / 2**20:.1f} MiB")
    print(f"  {'':22s} {'step ms':>8s} {'bytes/step':>12s} {'vs full':>8s}")
    for name, (ms, sent) in results.items():
        ratio = f"{sent / gradient_bytes:8.4f}" if sent else f"{'-':>8s}"
        print(f"  {name:22s} {ms:8.2f} {sent if sent is not None else '-':>12} {ratio}")
    for ours, theirs in (("allreduce", "allreduce"), ("fp16", "fp16"), ("no hook", "no hook"),
                         ("PSGD r1 1bucket", "PSGD r1 1bucket")):
        print(f"ddpkit {ours} / torch {theirs} step time: "
              f"{results[f'ddpkit {ours}'][0] / results[f'torch {theirs}'][0]:.2f}")
    fp16_bytes, full_bytes = results["ddpkit fp16"][1], results["ddpkit allreduce"][1]
    print(f"fp16 bytes / allreduce bytes: {fp16_bytes / full_bytes:.3f} (target 0.5)")  # type: ignore[operator]
    r1 = results["ddpkit PowerSGD r1"][1]
    print(f"PowerSGD rank 1: {gradient_bytes / r1:.0f}x fewer gradient bytes (target >= 100)")  # type: ignore[operator]


if __name__ == "__main__":
    main()
