"""Peak resident memory per rank: one process, torch DDP and ddpkit training the same model.

    python benchmarks/memory.py [--rounds 3] [--steps 20]

Each measurement is a set of fresh processes (peak RSS, ``VmHWM`` in /proc/self/status, only
grows, so every method gets processes of its own): ``one process`` trains the 8 x 1024 MLP
(8.4M parameters, 32 MiB of fp32 gradients, batch 64, SGD) alone; ``torch DDP`` and ``ddpkit``
train it on 2 Gloo ranks with their defaults, connected by plain ``init_process_group`` (no
launcher in the figures). Rounds run the methods in a shuffled order. Prints each method's median
per-rank peak, and ddpkit's saving against torch DDP in units of the gradient bytes: issue 16's
goal is a saving of at least 0.8 (gradients kept once: ddpkit's ``.grad`` are views into its
buckets, torch's default keeps them in ``.grad`` and again in its buckets). ``ddpkit, glibc's
malloc`` is ddpkit with its malloc thresholds off (``MALLOC_TOP_PAD_`` at glibc's own default:
any malloc setting in the environment turns them off).

Where the memory goes (2026-11-23, 2 cores, three runs of 3 rounds): one process 375-378 MiB,
torch DDP 414 in each, ddpkit 413-416, ddpkit with glibc's malloc 377-378, i.e. 36-37 MiB
(1.12-1.15x the gradient bytes) below torch DDP. The
gradients are kept once either way; what takes the saving back is the heap: with ddpkit's
thresholds (ddpkit._allocator) every freed gradient and activation stays in the heap, and its
high-water mark settles about 37 MiB above glibc's, where each large block is mapped and unmapped
on its own. That is the price of the step time: glibc's defaults cost this step about 9,500 page
faults (and ~30% of its time, benchmarks/ddp_step.py), the thresholds about 35. ddpkit keeps the
thresholds; a job short of memory turns them off with any ``MALLOC_*`` setting.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys

GRADIENT_BYTES = 8 * (1024 * 1024 + 1024) * 4
METHODS = ("one process", "torch DDP", "ddpkit", "ddpkit, glibc's malloc")
# glibc's own default top pad: any malloc setting in the environment keeps ddpkit's thresholds off.
GLIBC_DEFAULTS = {"MALLOC_TOP_PAD_": str(128 * 1024)}


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
        if method == "torch DDP":
            model = nn.parallel.DistributedDataParallel(model)
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


def measure(method: str, steps: int, port: int) -> list[int]:
    """Per-rank peaks (KiB) of one fresh run of ``method``."""
    ranks = 1 if method == "one process" else 2
    workers = []
    for rank in range(ranks):
        environment = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(ranks), "OMP_NUM_THREADS": "1"}
        worker = method
        if method == "ddpkit, glibc's malloc":
            environment.update(GLIBC_DEFAULTS)
            worker = "ddpkit"
        workers.append(subprocess.Popen([sys.executable, __file__, "--worker", worker, "--steps", str(steps)],
                                        stdout=subprocess.PIPE, text=True, env=environment))
    peaks = []
    for worker in workers:
        output, _ = worker.communicate(timeout=300)
        if worker.returncode != 0:
            raise SystemExit(f"{method}: a worker exited {worker.returncode}")
        peaks.append(int(output.split("peak")[1]))
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description="peak resident memory per rank")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worker", choices=METHODS[:3], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        train(args.worker, args.steps)
        return
    from ddpkit.environments import find_free_port  # here: the workers' own imports are what is measured

    peaks: dict[str, list[float]] = {method: [] for method in METHODS}
    order = list(METHODS)
    shuffler = random.Random(0)
    for _ in range(args.rounds):
        shuffler.shuffle(order)
        for method in order:
            peaks[method] += [kib / 1024 for kib in measure(method, args.steps, find_free_port())]
    medians = {method: statistics.median(values) for method, values in peaks.items()}
    print("per-rank peak resident memory (MiB), medians of", args.rounds, "rounds:",
          ", ".join(f"{method} {value:.0f}" for method, value in medians.items()))
    for method in ("ddpkit", "ddpkit, glibc's malloc"):
        below = medians["torch DDP"] - medians[method]
        print(f"{method}: below torch DDP by {below:.1f} MiB = {below * 2**20 / GRADIENT_BYTES:.2f}x the gradient "
              f"bytes ({GRADIENT_BYTES / 2**20:.1f} MiB); the goal is >= 0.80")


if __name__ == "__main__":
    main()
