"""Peak resident memory per rank: one process, torch DDP and ddpkit training the same model.

    python benchmarks/memory.py [--rounds 3] [--steps 20]

Each measurement is a set of fresh processes (peak RSS, ``VmHWM`` in /proc/self/status, only
grows, so every method gets processes of its own): ``one process`` trains the 8 x 1024 MLP
(8.4M parameters, 32 MiB of fp32 gradients, batch 64, SGD) alone; ``torch DDP``, ``torch DDP
views`` (torch's ``gradient_as_bucket_view=True``, its own gradients-once layout) and ``ddpkit``
train it on 2 Gloo ranks with their defaults otherwise, connected by plain
``init_process_group`` (no launcher in the figures). When jemalloc or tcmalloc is installed
(Debian: ``libjemalloc2``, ``libtcmalloc-minimal4``), the three DDPs are measured again with it
preloaded (``LD_PRELOAD``, as PyTorch's CPU performance guide suggests). Rounds run the methods
in a shuffled order. Prints each method's median per-rank peak and, per allocator, ddpkit's
saving against torch DDP in units of the gradient bytes (issue 16's goal: at least 0.8; ddpkit's
``.grad`` are views into its buckets, torch's default keeps them in ``.grad`` and again in its
buckets) and ddpkit's difference to torch's view mode.

Measured (2026-11-23, 2 cores, Debian 12's glibc 2.36, three runs of 3 rounds), medians per run:

- glibc's malloc: one process 376-380 MiB, torch DDP 412-417, torch DDP views 401-409, ddpkit
  406 in each: the saving is 0.32, 0.28, 0.20 of the gradient bytes; ddpkit minus torch's view
  mode +3.2, +5.5, -3.6 MiB.
- jemalloc: torch DDP 411, torch DDP views 384-386, ddpkit 385-387: saving 0.75, 0.80, 0.81;
  ddpkit minus torch's view mode +0.3, +1.1, +1.2 MiB.
- tcmalloc: torch DDP 414-415, torch DDP views 412-413, ddpkit 391-392: saving 0.69, 0.82, 0.72.

Before small gradients stopped waiting for their bucket's launch beside large ones (see
``ddpkit.parallel.buckets``), ddpkit peaked at 413-416 MiB under glibc (saving -0.05 to 0.05).

Where the memory goes. Gradients are kept once under every allocator (glibc's bytes in use
after backward, mallinfo2: ddpkit 175 MiB, torch DDP 207). Under jemalloc ddpkit is where torch's
own view mode is; both sit ~6 MiB above "torch DDP minus the gradients": backward hands each
weight a fresh 4 MiB gradient, which a DDP with bucket views copies into its bucket and frees
(torch's default keeps that tensor as ``.grad``), so one layer's gradient is alive beside the
buckets and the allocator keeps freed ones for reuse. Under glibc 2.36 the saving is lost to
holes: torch allocates CPU tensors with ``posix_memalign`` (64-byte alignment), and glibc 2.36
parks the small remainder that memalign cuts off in its tcache or fastbins, where it never
merges (glibc bug 30723, fixed upstream in 2023, not measured here), so each freed gradient
stays a hole of exactly its own size, which the next gradient's memalign (size plus alignment)
cannot use. The heap grows by about one gradient per layer in the first backward (ddpkit: 140
MiB in use, 180 MiB of heap) and keeps that size. Measured by hand before the change below
(mallinfo2 per step, and by tracing posix_memalign/free): the same 407-408 MiB with glibc's own
adaptive thresholds (no mallopt at all), so not ddpkit's malloc thresholds alone; 384 MiB with
those thresholds and ``GLIBC_TUNABLES=glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0``
(nothing parked, the holes merge). tcache can only be turned off when a process starts and
touches every allocation in it, so ddpkit leaves it alone. The small gradients (biases) that
ddpkit kept until their bucket's launch, to copy them in one call, pinned such holes between
the large ones: ~10 MiB (twelve per-rank peaks each, medians 413 and 403.5 MiB); a bucket with a
gradient of a MiB or more now copies every gradient in its hook. A CPU job short of memory
preloads jemalloc, which keeps ddpkit's step at its limit (step/limit 0.97 in one run of
ddp_step.py; tcmalloc 1.04). On GPU the caching allocator reuses freed blocks by size, and none
of this applies.
"""

from __future__ import annotations

import argparse
import ctypes.util
import os
import random
import statistics
import subprocess
import sys
from dataclasses import dataclass

GRADIENT_BYTES = 8 * (1024 * 1024 + 1024) * 4
WORKERS = ("one process", "torch DDP", "torch DDP views", "ddpkit")
#: Allocators measured when installed: name -> (Debian package, names ctypes.util.find_library takes).
PRELOADABLE = {"jemalloc": ("libjemalloc2", ("jemalloc",)),
               "tcmalloc": ("libtcmalloc-minimal4", ("tcmalloc_minimal", "tcmalloc"))}


@dataclass(frozen=True)
class Method:
    label: str
    worker: str  # one of WORKERS
    allocator: str = "glibc"
    preload: str = ""  # the allocator's library, for LD_PRELOAD


def methods() -> list[Method]:
    """Every worker with glibc's malloc, then the three DDPs under each preloadable allocator found."""
    chosen = [Method(worker, worker) for worker in WORKERS]
    for allocator, (package, names) in PRELOADABLE.items():
        library = next(filter(None, map(ctypes.util.find_library, names)), None)
        if library is None:
            print(f"{allocator} not installed: its rows are left out (Debian: apt-get install {package})")
            continue
        chosen += [Method(f"{worker}, {allocator}", worker, allocator, library)
                   for worker in WORKERS[1:]]
    return chosen


def peak_resident_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def train(method: str, steps: int) -> None:
    """One worker: train, then print this process's peak resident memory."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(*[layer for _ in range(8) for layer in (nn.Linear(1024, 1024), nn.ReLU())])
    if method != "one process":
        dist.init_process_group("gloo")
        if method.startswith("torch DDP"):
            model = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=method == "torch DDP views")
        else:
            import ddpkit

            model = ddpkit.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 1024), torch.randn(64, 1024)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    if method != "one process":
        dist.barrier()
        dist.destroy_process_group()
    print(f"peak {peak_resident_kib()}", flush=True)


def measure(method: Method, steps: int, port: int) -> list[int]:
    """Per-rank peaks (KiB) of one fresh run of ``method``."""
    ranks = 1 if method.worker == "one process" else 2
    workers = []
    for rank in range(ranks):
        environment = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(ranks), "OMP_NUM_THREADS": "1"}
        if method.preload:
            environment["LD_PRELOAD"] = method.preload
        workers.append(subprocess.Popen([sys.executable, __file__, "--worker", method.worker, "--steps", str(steps)],
                                        stdout=subprocess.PIPE, text=True, env=environment))
    peaks = []
    for worker in workers:
        output, _ = worker.communicate(timeout=300)
        if worker.returncode != 0:
            raise SystemExit(f"{method.label}: a worker exited {worker.returncode}")
        peaks.append(int(output.split("peak")[1]))
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description="peak resident memory per rank")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        train(args.worker, args.steps)
        return
    from ddpkit.environments import find_free_port  # here: the workers' own imports are what is measured

    order = methods()
    peaks: dict[Method, list[float]] = {method: [] for method in order}
    shuffler = random.Random(0)
    for _ in range(args.rounds):
        shuffler.shuffle(order)
        for method in order:
            peaks[method] += [kib / 1024 for kib in measure(method, args.steps, find_free_port())]
    medians = {method: statistics.median(values) for method, values in peaks.items()}
    print("per-rank peak resident memory (MiB), medians of", args.rounds, "rounds:",
          ", ".join(f"{method.label} {value:.0f}" for method, value in medians.items()))
    for allocator in dict.fromkeys(method.allocator for method in medians):
        of = {method.worker: value for method, value in medians.items() if method.allocator == allocator}
        below = of["torch DDP"] - of["ddpkit"]
        print(f"{allocator}: ddpkit below torch DDP by {below:.1f} MiB = {below * 2**20 / GRADIENT_BYTES:.2f}x the "
              f"gradient bytes ({GRADIENT_BYTES / 2**20:.1f} MiB; the goal is >= 0.80); ddpkit - torch DDP with "
              f"gradient_as_bucket_view=True {of['ddpkit'] - of['torch DDP views']:+.1f} MiB")

if __name__ == "__main__":
    main()
