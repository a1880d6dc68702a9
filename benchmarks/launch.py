"""Wall time of launching: ``ddpkit run`` against ``torchrun`` for the same script.

    python benchmarks/launch.py [--rounds 8] [--nproc-per-node 2]

The script (the same for both launchers, plain torch.distributed) connects over Gloo, does one
all-reduce and a barrier, and exits: what is timed is the launcher's start, the workers' start
(each imports torch), the rendezvous and the teardown. Each round runs both, in a shuffled order
(noise on a shared machine hits both alike). Prints the medians and the median of the per-round
ratio ddpkit/torchrun. The measured figures, with the command, are in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def timed(command: list[str], folder: str) -> float:
    start = time.perf_counter()
    result = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{command[2]} failed ({result.returncode}):\n{result.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description="launch wall time, ddpkit run vs torchrun")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    args = parser.parse_args()
    nproc = str(args.nproc_per_node)
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "connect.py").write_text(SCRIPT)
        commands = {
            "ddpkit run": [sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", nproc, "connect.py"],
            "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nproc, "connect.py"],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        order = list(commands)
        shuffler = random.Random(0)
        for round_index in range(args.rounds + 1):  # the first round warms the file cache
            shuffler.shuffle(order)
            for name in order:
                elapsed = timed(commands[name], folder)
                if round_index:
                    times[name].append(elapsed)
    ratios = [a / b for a, b in zip(times["ddpkit run"], times["torchrun"])]
    medians = "  ".join(f"{name} {statistics.median(values):.2f} s" for name, values in times.items())
    print(f"{args.nproc_per_node} processes, {args.rounds} rounds: {medians}  | ddpkit/torchrun per round "
          f"{statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
