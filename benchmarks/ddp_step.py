"""Step time of ddpkit's DistributedDataParallel against torch's (and pytorch-pfn-extras').

    python benchmarks/ddp_step.py [--steps N] [--models mlp lenet many many1000] [--device cuda] [--ranks N]
                                  [--backend gloo|nccl] [--variants] [--json FILE]

Two Gloo ranks with one thread each (ddpkit.testing.WorkerPool). ``--device cuda``: models and
batches on the GPU, each step ending with a CUDA synchronise; NCCL with one GPU per rank when
there are as many GPUs as ranks (``--ranks``, default 2), else ``--backend gloo`` lets ranks share
a GPU (Gloo all-reduces CUDA tensors through host memory, so that measures ddpkit's overhead on
GPU compute, not NCCL). A step is zero_grad, forward,
MSE/cross-entropy loss, backward (with gradient synchronisation) and an SGD step. Timed, in
one run with the methods interleaved in a shuffled order each round (noise hits all alike):

- ``one process``: rank 0 alone, no DDP (rank 1 idles);
- ``both, no sync``: both ranks train their own copy, no communication (what the two ranks'
  compute costs when they run side by side: in each round the slower rank's time, as a step
  that synchronises waits for the slower rank);
- ``raw all-reduce``: only an all_reduce of one flat buffer the size of all gradients;
- ``torch DDP``: torch.nn.parallel.DistributedDataParallel, defaults;
- ``ppe DDP``: pytorch_pfn_extras.nn.parallel.DistributedDataParallel, when installed;
- ``ddpkit``: ddpkit.DistributedDataParallel, defaults (negotiate_grads=True).

Models: ``mlp`` 8 x Linear(1024, 1024) (8.4M parameters, batch 64), ``lenet`` (62k
parameters, batch 32), ``many`` 60 x (Linear(64, 64) + Tanh) (120 tensors, batch 64), and, not
run by default, ``many1000`` 500 x (Linear(16, 16) + Tanh) (1000 tensors of a few hundred bytes:
the step is mostly each DDP's work per parameter, the host time that a GPU would not hide).
Prints medians (ms), the ratios ddpkit/torch and ppe/ddpkit of the medians, and the median and
quartiles of ddpkit/torch taken round by round (the two ran moments apart, so a slow spell of
the machine cancels out; that is the number to quote). A second line gives the limit, ``both, no
sync`` + ``raw all-reduce`` of the same round (on two shared cores overlap hides nothing, so a
step cannot beat compute plus one all-reduce of every gradient byte), and each DDP's step over
it, median of the per-round ratios. ``--variants`` adds ddpkit with ``gradient_as_bucket_view=False``
(``ddpkit copies``: torch's default layout, a ``.grad`` of its own copied back each step), to weigh the option,
and ddpkit with its step windows written for ``ddpkit run --report-every 1`` (``ddpkit windows``: each step
handed to a ``WindowRecorder``, a line written every second), whose cost it prints over ``ddpkit`` per round.

A third line gives each DDP's **host time** per step (median): from ``zero_grad`` until
``optimizer.step()`` returns, before the CUDA synchronise. On a GPU that is what the host spends
issuing the step (the backward's hooks and kernel launches, the reducer's work: torch's in C++,
ddpkit's in Python), which the GPU hides only while it is busier; on the CPU it is the step itself.
``--json FILE`` writes every figure (medians, ratios, host times per model) for ``benchmarks/gpu_check.py``.

The measured figures, with the command, are in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from _timing import (  # benchmarks/ is on the path when run as a script
    WARMUP_ROUNDS,
    interleaved_samples,
    paired_ratio,
)
from torch import nn

from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.testing import WorkerPool
from ddpkit.variables import DDPKIT_METRICS_FILE, DDPKIT_METRICS_SECONDS


def build(name: str) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]], Callable[..., torch.Tensor]]:
    torch.manual_seed(0)
    if name == "mlp":
        layers: list[nn.Module] = []
        for _ in range(8):
            layers += [nn.Linear(1024, 1024), nn.ReLU()]
        model = nn.Sequential(*layers)
        return model, lambda step: (torch.randn(64, 1024), torch.randn(64, 1024)), nn.functional.mse_loss
    if name == "lenet":
        model = nn.Sequential(
            nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(256, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10),
        )
        return model, lambda step: (torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))), nn.functional.cross_entropy
    if name == "many":
        layers = []
        for _ in range(60):
            layers += [nn.Linear(64, 64), nn.Tanh()]
        return nn.Sequential(*layers), lambda step: (torch.randn(64, 64), torch.randn(64, 64)), nn.functional.mse_loss
    if name == "many1000":
        layers = []
        for _ in range(500):
            layers += [nn.Linear(16, 16), nn.Tanh()]
        return nn.Sequential(*layers), lambda step: (torch.randn(64, 16), torch.randn(64, 16)), nn.functional.mse_loss
    raise ValueError(f"unknown model {name!r}; choose mlp, lenet, many or many1000")


def _peer_ddp() -> type | None:
    try:
        from pytorch_pfn_extras.nn.parallel import DistributedDataParallel as PPE
    except ImportError:
        return None
    return PPE


def measure(model_name: str, steps: int, device_type: str, variants: bool = False) -> dict[str, dict[str, list[float]]]:
    """``{"step": per-method step times, "host": per-DDP host times}`` in ms, of the counted rounds."""
    rank = dist.get_rank()
    on_gpu = device_type == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    base, batch, loss_fn = build(model_name)
    methods: dict[str, Callable[[], None]] = {}
    x, y = (tensor.to(device) for tensor in batch(0))

    def finish() -> None:
        if on_gpu:  # the step's kernels ran, not only were queued
            torch.cuda.synchronize(device)

    host: dict[str, list[float]] = {}

    def trainer(model: nn.Module, name: str = "") -> Callable[[], None]:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        issued = host.setdefault(name, []) if name else []

        def step() -> None:
            start = time.perf_counter()
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
            issued.append((time.perf_counter() - start) * 1000)
            finish()
        return step

    def copy() -> nn.Module:
        clone, _, _ = build(model_name)
        clone.load_state_dict(base.state_dict())
        return clone.to(device)

    def all_reduce(flat: torch.Tensor) -> None:
        dist.all_reduce(flat)
        finish()

    single = trainer(copy())
    local = trainer(copy())
    flat = torch.zeros(sum(p.numel() for p in base.parameters()), device=device)
    device_ids = [device] if on_gpu else None
    methods["one process"] = lambda: single() if rank == 0 else None
    methods["both, no sync"] = local
    methods["raw all-reduce"] = lambda: all_reduce(flat)
    methods["torch DDP"] = trainer(nn.parallel.DistributedDataParallel(copy(), device_ids=device_ids), "torch DDP")
    peer = _peer_ddp()
    if peer is not None:
        methods["ppe DDP"] = trainer(peer(copy()), "ppe DDP")
    methods["ddpkit"] = trainer(DistributedDataParallel(copy(), device_ids=device_ids), "ddpkit")
    windows_folder = tempfile.mkdtemp()  # where "ddpkit windows" writes, kept until the samples are taken
    if variants:  # the default keeps .grad in the buckets; this is torch's default layout
        methods["ddpkit copies"] = trainer(
            DistributedDataParallel(copy(), device_ids=device_ids, gradient_as_bucket_view=False), "ddpkit copies")
        with _windows_to(os.path.join(windows_folder, f"rank{rank}.windows")):
            methods["ddpkit windows"] = trainer(DistributedDataParallel(copy(), device_ids=device_ids), "ddpkit windows")

    samples = interleaved_samples(methods, steps)
    shutil.rmtree(windows_folder)
    return {"step": samples, "host": {name: times[WARMUP_ROUNDS:] for name, times in host.items()}}


@contextlib.contextmanager
def _windows_to(path: str) -> Iterator[None]:
    """A DDP module made inside writes its step windows to ``path`` every second, as under
    ``ddpkit run --report-every 1`` (the step clock reads the variables when it is made)."""
    os.environ.update({DDPKIT_METRICS_FILE: path, DDPKIT_METRICS_SECONDS: "1"})
    try:
        yield
    finally:
        for name in (DDPKIT_METRICS_FILE, DDPKIT_METRICS_SECONDS):
            os.environ.pop(name, None)


def limit_line(samples: dict[str, list[float]]) -> str:
    """Each DDP's step over the limit, round by round: what the two ranks' compute costs side by
    side plus one all-reduce of every gradient byte, both timed in the same round."""
    limit = [compute + reduce for compute, reduce in zip(samples["both, no sync"], samples["raw all-reduce"])]
    with_limit = {**samples, "limit": limit}
    ratios = [f"{name} {paired_ratio(with_limit, name, 'limit')[0]:.3f}"
              for name in samples if "DDP" in name or name.startswith("ddpkit")]
    return f"limit {statistics.median(limit):7.2f} ms; per-round step/limit: " + ", ".join(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description="DDP step-time benchmark")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per method (default: 40 for the MLP, 600 for the small models)")
    parser.add_argument("--models", nargs="+", default=["mlp", "lenet", "many"])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                        help="default: gloo on cpu, nccl on cuda (needs one GPU per rank)")
    parser.add_argument("--variants", action="store_true",
                        help="also time ddpkit with gradient_as_bucket_view=False")
    parser.add_argument("--json", default=None, help="also write every figure to this file")
    args = parser.parse_args()
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if backend == "nccl" and torch.cuda.device_count() < args.ranks:
        parser.error(f"NCCL needs one GPU per rank: --ranks {args.ranks}, {torch.cuda.device_count()} GPU(s) "
                     "here; pass fewer --ranks, or --backend gloo to let ranks share a GPU")
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {args.ranks} {backend} ranks x 1 thread on {where}, medians per step (ms)")
    report: dict[str, object] = {"torch": torch.__version__, "ranks": args.ranks, "backend": backend, "device": where,
                                 "models": {}}
    with WorkerPool(args.ranks, timeout=1200, backend=backend) as pool:
        for model_name in args.models:
            steps = args.steps or (40 if model_name == "mlp" and args.device == "cpu" else 600)
            every_rank = pool.run(measure, model_name, steps, args.device, args.variants)
            samples, host = every_rank[0]["step"], every_rank[0]["host"]
            # Without sync each rank times only itself; side by side, both are done when the slower is.
            samples["both, no sync"] = [max(times) for times in zip(*(ranks["step"]["both, no sync"]
                                                                      for ranks in every_rank))]
            line = "  ".join(f"{name} {statistics.median(values):7.2f}" for name, values in samples.items())
            ratio = statistics.median(samples["ddpkit"]) / statistics.median(samples["torch DDP"])
            paired, lower, upper = paired_ratio(samples, "ddpkit", "torch DDP")
            peer = ""
            if "ppe DDP" in samples:
                peer = f"  ppe/ddpkit {statistics.median(samples['ppe DDP']) / statistics.median(samples['ddpkit']):.2f}"
            print(f"{model_name:6s} {line}  | ddpkit/torch {ratio:.2f} (per round {paired:.2f}, "
                  f"quartiles {lower:.2f}-{upper:.2f}){peer}", flush=True)
            print(f"{'':6s} {limit_line(samples)}", flush=True)
            if "ddpkit windows" in samples:
                cost, low, high = paired_ratio(samples, "ddpkit windows", "ddpkit")
                print(f"{'':6s} step windows (--report-every 1): ddpkit windows/ddpkit per round {cost:.3f} "
                      f"(quartiles {low:.3f}-{high:.3f})", flush=True)
            host_medians = {name: statistics.median(times) for name, times in host.items()}
            print(f"{'':6s} host per step: " + ", ".join(f"{name} {ms:.2f}" for name, ms in host_medians.items())
                  + f"; ddpkit/torch {host_medians['ddpkit'] / host_medians['torch DDP']:.2f}", flush=True)
            report["models"][model_name] = {  # type: ignore[index]
                "steps": steps, "median_ms": {name: statistics.median(values) for name, values in samples.items()},
                "ddpkit_over_torch": ratio, "ddpkit_over_torch_per_round": paired,
                "quartiles": [lower, upper], "host_ms": host_medians,
                "host_ddpkit_over_torch": host_medians["ddpkit"] / host_medians["torch DDP"]}
    if args.json is not None:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
