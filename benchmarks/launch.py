"""Wall time of launching: ``ddpkit run`` against ``torchrun`` for the same script.

    python benchmarks/launch.py [--rounds 8] [--nproc-per-node 2] [--nnodes 2 --meeting c10d|static]

The script (the same for both launchers, plain torch.distributed) connects over Gloo, does one
all-reduce and a barrier, and exits: what is timed is the launcher's start, the workers' start
(each imports torch), the rendezvous and the teardown. Each round runs both, in a shuffled order
(noise on a shared machine hits both alike). Prints the medians and the median of the per-round
ratio ddpkit/torchrun. With ``--nnodes 2`` each round starts two launchers at once on this host
(loopback), meeting at a c10d rendezvous or as static nodes with ``--max-restarts 1`` (the ways in
which a launcher hosts the job's store): the time is until both ended. The measured figures, with
the command, are in benchmarks/README.md.
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

from ddpkit.environments import find_free_port

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


def timed(commands: list[list[str]], folder: str) -> float:
    """Seconds from starting ``commands`` at once (one per node) until every one ended."""
    start = time.perf_counter()
    processes = [subprocess.Popen(command, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for command in commands]
    try:
        errors = [process.communicate(timeout=300)[1] for process in processes]
    finally:  # one launcher past the bound (or Ctrl-C): the others are not left running
        for process in processes:
            process.kill()
    elapsed = time.perf_counter() - start
    for command, process, error in zip(commands, processes, errors):
        if process.returncode != 0:
            raise SystemExit(f"{command[2]} failed ({process.returncode}):\n{error[-2000:]}")
    return elapsed


def node_commands(launcher: list[str], nproc: str, nnodes: int, meeting: str) -> list[list[str]]:
    """The command line of each node's launcher (``launcher``: ddpkit run's or torchrun's)."""
    if nnodes == 1:
        return [[*launcher, "--nproc-per-node", nproc, "connect.py"]]
    port = str(find_free_port())
    if meeting == "c10d":
        meet = [["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                 "--rdzv-id", "bench"]] * nnodes
    else:
        meet = [["--nnodes", str(nnodes), "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port,
                 "--max-restarts", "1"] for node in range(nnodes)]
    return [[*launcher, *flags, "--nproc-per-node", nproc, "connect.py"] for flags in meet]


def main() -> None:
    parser = argparse.ArgumentParser(description="launch wall time, ddpkit run vs torchrun")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--nnodes", type=int, default=1, help="launchers started at once on this host")
    parser.add_argument("--meeting", choices=["c10d", "static"], default="c10d",
                        help="with --nnodes above 1: a c10d rendezvous, or static nodes with --max-restarts 1")
    args = parser.parse_args()
    nproc = str(args.nproc_per_node)
    launchers = {"ddpkit run": [sys.executable, "-m", "ddpkit", "run"],
                 "torchrun": [sys.executable, "-m", "torch.distributed.run"]}
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "connect.py").write_text(SCRIPT)
        times: dict[str, list[float]] = {name: [] for name in launchers}
        order = list(launchers)
        shuffler = random.Random(0)
        for round_index in range(args.rounds + 1):  # the first round warms the file cache
            shuffler.shuffle(order)
            for name in order:
                elapsed = timed(node_commands(launchers[name], nproc, args.nnodes, args.meeting), folder)
                if round_index:
                    times[name].append(elapsed)
    ratios = [a / b for a, b in zip(times["ddpkit run"], times["torchrun"])]
    medians = "  ".join(f"{name} {statistics.median(values):.2f} s" for name, values in times.items())
    nodes = "" if args.nnodes == 1 else f" per node, {args.nnodes} nodes ({args.meeting})"
    print(f"{args.nproc_per_node} processes{nodes}, {args.rounds} rounds: {medians}  | ddpkit/torchrun per round "
          f"{statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
