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

Then, under glibc's malloc, where each rank's memory is right after the last backward (where the
peak is reached), by glibc's own count (``mallinfo2``, see ``account``): the tensors Python sees,
the bytes malloc has handed out, the bytes freed into its heap that it keeps (holes), and what
lies outside malloc; and ddpkit's peak less torch DDP's split into those parts. That line is the
answer to "where did the gradients I saved go": the bytes in use fall by about all the gradient
bytes, and the heap keeps a part of them as free holes.

Measured (2026-11-23, 2 cores, Debian 12's glibc 2.36, three runs of 3 rounds), medians per run:

- glibc's malloc: one process 376-380 MiB, torch DDP 412-417, torch DDP views 401-409, ddpkit
  406 in each: the saving is 0.32, 0.28, 0.20 of the gradient bytes; ddpkit minus torch's view
  mode +3.2, +5.5, -3.6 MiB.
- jemalloc: torch DDP 411, torch DDP views 384-386, ddpkit 385-387: saving 0.75, 0.80, 0.81;
  ddpkit minus torch's view mode +0.3, +1.1, +1.2 MiB.
- tcmalloc: torch DDP 414-415, torch DDP views 412-413, ddpkit 391-392: saving 0.69, 0.82, 0.72.

Before small gradients stopped waiting for their bucket's launch beside large ones (see
``ddpkit.parallel.buckets``), ddpkit peaked at 413-416 MiB under glibc (saving -0.05 to 0.05).

Since buckets hold a 16th of the model's bytes (2026-11-27: eight 4 MiB buckets on this MLP, each
all-reduced while backward goes on, where torch's caps made two, the second launched when backward
ends; ``ddpkit.parallel.buckets``), two runs of 3 rounds: under glibc ddpkit 418 and 420 MiB
(saving -0.12 and -0.14; +12 to 14 MiB, all of it free holes in the heap: 49 MiB free after
backward against 25 for torch's view mode); jemalloc 386 (saving 0.83) and tcmalloc 391 (0.73),
as before. The layout is kept for its step (1.6x to 1.3x max(compute, all-reduce) where the two
are of one order, benchmarks/README.md); a CPU job short of memory preloads jemalloc.

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
import json
import os
import random
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

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
    return _status_kib("VmHWM:")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc 2.33 and later): every arena's figures, in bytes."""

    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]


#: What ``account`` reports, in MiB, in the order printed.
ACCOUNT = ("peak", "resident", "tensors", "malloc in use", "other in use", "free in heap", "outside malloc")


def account(tensor_bytes: int) -> dict[str, float]:
    """Where this process's resident memory is now (all of ``ACCOUNT`` but the peak), in MiB, by
    glibc's own count (``mallinfo2``):
    ``tensors``: the bytes of the model's and DDP's tensors that Python can see (parameters,
    gradients, ddpkit's buckets); ``malloc in use``: every byte malloc has handed out and not had
    back (the tensors, torch DDP's own buckets, backward's temporaries still held, Python's objects);
    ``other in use``: that less ``tensors``; ``free in heap``: bytes freed into malloc's heap that it
    keeps (the holes; resident once touched); ``outside malloc``: the rest of the resident memory
    (the libraries' code and data, the stacks). Empty under another allocator (``LD_PRELOAD``):
    glibc's count then misses its blocks."""
    figures = {"resident": _status_kib("VmRSS:") / 1024}  # the peak: ``train`` reads it at the end
    if os.environ.get("LD_PRELOAD"):
        return figures
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    in_use = (info.uordblks + info.hblkhd) / 2**20
    figures.update({"tensors": tensor_bytes / 2**20, "malloc in use": in_use,
                    "other in use": in_use - tensor_bytes / 2**20, "free in heap": info.fordblks / 2**20,
                    "outside malloc": figures["resident"] - in_use - info.fordblks / 2**20})
    return figures


def _tensor_bytes(model: Any) -> int:
    """The bytes of every distinct storage behind the parameters and their gradients (with ddpkit,
    the gradients are views into its buckets: the buckets' bytes)."""
    tensors = [tensor for parameter in model.parameters() for tensor in (parameter, parameter.grad) if tensor is not None]
    return sum({tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in tensors}.values())


def train(method: str, steps: int) -> None:
    """One worker: train, then print this process's peak resident memory, and where its memory
    is right after the last backward (``account``), where the peak is reached."""
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
    figures: dict[str, float] = {}
    for step in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if step == steps - 1:
            figures = account(_tensor_bytes(model))
        optimizer.step()
    if method != "one process":
        dist.barrier()
        dist.destroy_process_group()
    figures["peak"] = peak_resident_kib() / 1024
    print("account " + json.dumps(figures), flush=True)


def measure(method: Method, steps: int, port: int) -> list[dict[str, float]]:
    """Each rank's ``account`` (MiB) of one fresh run of ``method``."""
    ranks = 1 if method.worker == "one process" else 2
    workers = []
    for rank in range(ranks):
        environment = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(ranks), "OMP_NUM_THREADS": "1"}
        if method.preload:
            environment["LD_PRELOAD"] = method.preload
        workers.append(subprocess.Popen([sys.executable, __file__, "--worker", method.worker, "--steps", str(steps)],
                                        stdout=subprocess.PIPE, text=True, env=environment))
    accounts = []
    for worker in workers:
        output, _ = worker.communicate(timeout=300)
        if worker.returncode != 0:
            raise SystemExit(f"{method.label}: a worker exited {worker.returncode}")
        accounts.append(json.loads(output.split("account ", 1)[1]))
    return accounts


def print_accounts(accounts: dict[Method, list[dict[str, float]]]) -> None:
    """Per method, the median of each ``account`` figure; then, for glibc's malloc, how ddpkit's peak
    differs from torch DDP's: the bytes in use (what ddpkit keeps once) and the heap's free bytes
    (the allocator's holes)."""
    glibc = {method: ranks for method, ranks in accounts.items() if method.allocator == "glibc"}
    print("\nwhere each rank's memory is after the last backward, glibc's malloc (MiB, medians; mallinfo2):")
    print(f"{'':18}" + "".join(f"{name:>16}" for name in ACCOUNT))
    medians: dict[str, dict[str, float]] = {}
    for method, ranks in glibc.items():
        medians[method.worker] = {name: statistics.median(rank[name] for rank in ranks) for name in ACCOUNT}
        print(f"{method.label:18}" + "".join(f"{medians[method.worker][name]:16.1f}" for name in ACCOUNT))
    ddpkit, torch_ddp = medians["ddpkit"], medians["torch DDP"]
    print(f"ddpkit - torch DDP: peak {ddpkit['peak'] - torch_ddp['peak']:+.1f} MiB = malloc in use "
          f"{ddpkit['malloc in use'] - torch_ddp['malloc in use']:+.1f} (gradients kept once: "
          f"-{GRADIENT_BYTES / 2**20:.1f} would be all of them) + free in heap "
          f"{ddpkit['free in heap'] - torch_ddp['free in heap']:+.1f} (holes the allocator keeps) + outside malloc "
          f"{ddpkit['outside malloc'] - torch_ddp['outside malloc']:+.1f} + the peak's distance from this moment "
          f"{(ddpkit['peak'] - ddpkit['resident']) - (torch_ddp['peak'] - torch_ddp['resident']):+.1f}")


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
    accounts: dict[Method, list[dict[str, float]]] = {method: [] for method in order}
    shuffler = random.Random(0)
    for _ in range(args.rounds):
        shuffler.shuffle(order)
        for method in order:
            accounts[method] += measure(method, args.steps, find_free_port())
    medians = {method: statistics.median(rank["peak"] for rank in ranks) for method, ranks in accounts.items()}
    print("per-rank peak resident memory (MiB), medians of", args.rounds, "rounds:",
          ", ".join(f"{method.label} {value:.0f}" for method, value in medians.items()))
    for allocator in dict.fromkeys(method.allocator for method in medians):
        of = {method.worker: value for method, value in medians.items() if method.allocator == allocator}
        below = of["torch DDP"] - of["ddpkit"]
        print(f"{allocator}: ddpkit below torch DDP by {below:.1f} MiB = {below * 2**20 / GRADIENT_BYTES:.2f}x the "
              f"gradient bytes ({GRADIENT_BYTES / 2**20:.1f} MiB; the goal is >= 0.80); ddpkit - torch DDP with "
              f"gradient_as_bucket_view=True {of['ddpkit'] - of['torch DDP views']:+.1f} MiB")
    print_accounts(accounts)


if __name__ == "__main__":
    main()
