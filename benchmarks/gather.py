"""Uneven gather: ddpkit's ``gather_all_tensors`` against a plain padded all_gather (and Lightning).

    python benchmarks/gather.py [--iterations 60] [--rows 1000 1500] [--cols 256]

Two Gloo ranks with one thread each (ddpkit.testing.WorkerPool). Rank r holds ``rows[r] x cols``
float32. All methods are timed in one run, in a shuffled order each round so that machine noise
hits them alike; a sample is the mean of 5 back-to-back calls after a barrier; medians of rank 0:

- ``plain all_gather``: torch's list all_gather of tensors already padded to the largest shape;
- ``plain all_gather_single``: the same into one flat buffer (what ddpkit uses; faster);
- ``header``: an all_gather of ddpkit's 18-int64 shape header, i.e. one small-message latency;
- ``ddpkit``: ``gather_all_tensors`` of the uneven tensors (header, then one all-to-all of the
  real elements, no padding);
- ``lightning``: ``lightning.fabric.utilities.distributed._gather_all_tensors``, when installed.

Target (foundation issue): ddpkit <= 1.1 x (fastest plain gather + header latency).
What bounds it: moving the payload over loopback (1.0 and 1.5 MB per rank here). ddpkit's
header costs one extra round trip; in exchange its point-to-point exchange sends only real rows
(the padded gather sends 1500 rows from every rank) and copies nothing, which pays for the
header at these sizes.
The measured figures, with the command, are in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.distributed as dist
from _timing import (
    interleaved_medians,  # benchmarks/ is on the path when run as a script
)

from ddpkit.distributed import gather_all_tensors
from ddpkit.testing import WorkerPool

CALLS_PER_SAMPLE = 5


def _lightning_gather() -> Callable[[torch.Tensor], list[torch.Tensor]] | None:
    try:
        from lightning.fabric.utilities.distributed import _gather_all_tensors
    except ImportError:
        return None
    return _gather_all_tensors


def measure(rows: list[int], cols: int, iterations: int) -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    local = torch.randn(rows[rank], cols)
    padded = torch.zeros(max(rows), cols)
    padded[: rows[rank]] = local
    header = torch.zeros(18, dtype=torch.long)
    flat_out = torch.empty(world * padded.numel())
    header_out = torch.empty(world * header.numel(), dtype=torch.long)
    list_out = [torch.empty_like(padded) for _ in range(world)]

    methods: dict[str, Callable[[], object]] = {
        "plain all_gather": lambda: dist.all_gather(list_out, padded),
        "plain all_gather_single": lambda: dist.all_gather_single(flat_out, padded.reshape(-1)),
        "header": lambda: dist.all_gather_single(header_out, header),
        "ddpkit": lambda: gather_all_tensors(local),
    }
    lightning = _lightning_gather()
    if lightning is not None:
        methods["lightning"] = lambda: lightning(local)

    # Check before timing that ddpkit returns what was sent.
    result = gather_all_tensors(local)
    assert [t.shape[0] for t in result] == rows and torch.equal(result[rank], local)

    return interleaved_medians(methods, iterations, calls_per_sample=CALLS_PER_SAMPLE)


def main() -> None:
    parser = argparse.ArgumentParser(description="Uneven gather benchmark")
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--rows", type=int, nargs=2, default=[1000, 1500])
    parser.add_argument("--cols", type=int, default=256)
    args = parser.parse_args()

    with WorkerPool(2, timeout=600) as pool:
        medians = pool.run(measure, list(args.rows), args.cols, args.iterations)[0]

    print(f"uneven gather, 2 gloo ranks x 1 thread, rows {args.rows} x {args.cols} float32, "
          f"medians of {args.iterations} samples of {CALLS_PER_SAMPLE} calls (ms per call):")
    for name, value in medians.items():
        print(f"  {name:<26} {value:8.3f}")
    plain = min(medians["plain all_gather"], medians["plain all_gather_single"])
    bound = plain + medians["header"]
    print(f"ddpkit / (fastest plain gather + header latency) = {medians['ddpkit'] / bound:.2f}  (target <= 1.10)")
    print(f"ddpkit / plain all_gather (list)                 = "
          f"{medians['ddpkit'] / medians['plain all_gather']:.2f}")
    if "lightning" in medians:
        print(f"lightning / ddpkit                               = {medians['lightning'] / medians['ddpkit']:.2f}")
    else:
        print("lightning: not installed (pip install lightning) - skipped")


if __name__ == "__main__":
    main()
