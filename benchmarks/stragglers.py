"""How well ``ddpkit run`` names a slow rank (issue 49): clean runs name nobody, and a rank made
slow in the middle of a run is named, with the right phase, within a couple of windows.

    python benchmarks/stragglers.py [--clean N] [--slowed N] [--report-every S] [--steps STEPS]
                                    [--slow-after S] [--straggler-factor F] [--nodes 1|2]

Every run is ``tests/stragglers_job.py`` (ddpkit's loop on an MLP) under ``ddpkit run
--nproc-per-node 2 --report-every S``, the clean and slowed runs alternating (these machines are
noisy: each kind sees the same spells). With ``--nodes 2``, two launchers of one rank each on
this machine, as two nodes (``--max-restarts 1``: node 0's launcher reports both, and the nodes'
launchers time their links, ``health.link_probe``). A clean run leaves its ranks unpinned (pinned ranks would
be named, rightly, when one core of a virtual machine runs slower than the other: docs/never-stuck.md).
A slowed run pins each rank to its own core and, ``--slow-after`` seconds after its first health
line, starts a busy process on rank 1's core for the rest of the run: the time from that start to
the launcher's straggler line, in windows, is what is reported (naming takes two slow windows in a
row; the first may be only partly slow). Prints, per kind, the runs that named someone, the rank
and phase named, and the windows to name (median, max).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

JOB = Path(__file__).resolve().parents[1] / "tests" / "stragglers_job.py"


@dataclass
class Run:
    """One run: the straggler lines, and when the slowness began and the first of them came."""

    code: int = 0
    named: list[str] = field(default_factory=list)
    slowed_at: float | None = None
    named_at: float | None = None


def one_run(slowed: bool, report_every: float, steps: int, slow_after: float, factor: float, nodes: int) -> Run:
    run = Run()
    busy: subprocess.Popen[bytes] | None = None
    environment = {**os.environ, "STEPS": str(steps), **({"PIN": "1"} if slowed else {})}
    if nodes == 2:
        # Each "node"'s launcher would give its one worker every core's thread; the idle rank's OpenMP
        # threads then spin while the other computes, 3-4x its compute (docs/hazards.md).
        environment["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "ddpkit", "run", "--report-every", f"{report_every:g}", "--straggler-factor",
               f"{factor:g}"]
    port = str(free_port())
    with tempfile.TemporaryDirectory() as folder:
        others = [subprocess.Popen([*command, "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "1",
                                    "--master-port", port, "--max-restarts", "1", str(JOB)],
                                   cwd=folder, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                  for _ in range(nodes - 1)]
        across = ["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "0", "--master-port", port,
                  "--max-restarts", "1"] if nodes == 2 else ["--nproc-per-node", "2"]
        launcher = subprocess.Popen([*command, *across, str(JOB)], cwd=folder, env=environment, text=True,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        first_health = threading.Event()

        def read() -> None:
            assert launcher.stderr is not None
            for line in launcher.stderr:
                if line.startswith("ddpkit run: health "):
                    first_health.set()
                if line.startswith("ddpkit run: straggler: "):
                    run.named.append(line.strip())
                    if run.named_at is None:
                        run.named_at = time.monotonic()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            if slowed and first_health.wait(timeout=120):
                time.sleep(slow_after)
                busy = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"])
                run.slowed_at = time.monotonic()
            run.code = max(launcher.wait(timeout=600), *(other.wait(timeout=60) for other in others))
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
            for process in others:
                process.kill()
                process.wait()
            launcher.kill()
            launcher.wait()
            reader.join(timeout=5)
    return run


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def summary(kind: str, runs: list[Run], report_every: float) -> str:
    named = [run for run in runs if run.named]
    failed = sum(run.code != 0 for run in runs)
    text = f"{kind}: {len(runs)} runs ({failed} failed), {len(named)} named someone"
    right = [run for run in named if "rank 1 (" in run.named[0] and "compute" in run.named[0]]
    if kind == "slowed":
        text += f", {len(right)} named rank 1 for its compute first"
        delays = [(run.named_at - run.slowed_at) / report_every for run in right
                  if run.named_at is not None and run.slowed_at is not None and run.named_at >= run.slowed_at]
        if delays:
            text += f"; windows from the slowness to the name: median {statistics.median(delays):.1f}, max {max(delays):.1f}"
    wrong = [run.named[0] for run in named if run not in right or kind == "clean"]
    phases = sorted({line.split(": its ")[1].split(" (")[0] for line in wrong if ": its " in line})
    return text + (f" (for: {', '.join(phases)})" if phases else "") + "".join(f"\n    {line}" for line in wrong[:5])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clean", type=int, default=10, help="clean runs (default 10)")
    parser.add_argument("--slowed", type=int, default=5, help="runs with rank 1 slowed (default 5)")
    parser.add_argument("--report-every", type=float, default=1.0, help="the window, seconds (default 1)")
    parser.add_argument("--steps", type=int, default=2000, help="steps a run (default 2000: about 10 s here)")
    parser.add_argument("--slow-after", type=float, default=2.5, help="seconds after the first health line")
    parser.add_argument("--straggler-factor", type=float, default=1.2, help="ddpkit run's (default 1.2, its default)")
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                        help="one launcher of two ranks, or two launchers of one rank each (default 1)")
    args = parser.parse_args()
    if (os.cpu_count() or 1) < 2:
        parser.error("needs two cores: one per rank, the busy process on rank 1's")
    runs: dict[str, list[Run]] = {"clean": [], "slowed": []}
    for index in range(max(args.clean, args.slowed)):
        for kind, count in (("clean", args.clean), ("slowed", args.slowed)):
            if index < count:
                runs[kind].append(one_run(kind == "slowed", args.report_every, args.steps, args.slow_after,
                                          args.straggler_factor, args.nodes))
    shape = "--nproc-per-node 2" if args.nodes == 1 else "--nnodes 2 --nproc-per-node 1 (two launchers)"
    print(f"ddpkit run {shape} --report-every {args.report_every:g} --straggler-factor "
          f"{args.straggler_factor:g}, tests/stragglers_job.py, "
          f"{args.steps} steps a run")
    for kind, done in runs.items():
        if done:
            print(summary(kind, done, args.report_every))


if __name__ == "__main__":
    main()
