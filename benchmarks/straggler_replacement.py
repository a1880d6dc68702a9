"""What ``ddpkit run --stragglers replace`` saves (issue 49, item 4): a job whose node 1 runs at half
speed for the whole run, with a spare node waiting, against the same job never slowed and the same
job slowed without replacement.

    python benchmarks/straggler_replacement.py [--rounds N] [--steps STEPS] [--report-every S]

Each run is three launchers on this machine (``--nnodes 2:3 --rdzv-backend c10d --recovery in-place``,
one rank a node, the store outside the nodes: ``ddpkit store``), running ``tests/slow_node_job.py``;
the rendezvous closes with two nodes and the third waits as a spare. Node 1 is made slow by its
data loader, which waits once a batch (a slow disk; the spare node's is not slow). The wait is the
clean run's median step, so that node 1 runs at half speed. The three kinds run interleaved, one
round at a time (these machines are noisy), and each run's wall time (first launcher started to
last one ended) is printed with its ratio to the clean run of its round; then the medians.
Also says when the straggler was named and when the spare took its place (seconds from the start).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "slow_node_job.py"
SECRET = {"DDPKIT_JOB_SECRET": "benchmark-secret-0123456789abcdef"}


@dataclass
class Run:
    seconds: float
    step_ms: float | None  # the median of the health lines' step medians
    named_at: float | None  # seconds from the start
    replaced_at: float | None


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def launcher(folder: Path, port: int, name: str, variables: dict[str, str]) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "ddpkit", "run", "--nnodes", "2:3", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
               "--rdzv-conf", "last_call_timeout=1", "--recovery", "in-place", "--max-restarts", "1", str(JOB)]
    with open(folder / f"{name}.err", "wb") as err:
        return subprocess.Popen(command, cwd=folder, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, **SECRET, **variables})


def one_run(steps: int, report_every: float, slow_seconds: float, replace: bool) -> Run:
    common = {"STEPS": str(steps), "DDPKIT_REPORT_EVERY": f"{report_every:g}", "DDPKIT_STRAGGLER_FACTOR": "1.5",
              "DDPKIT_STRAGGLERS": "replace" if replace else "name"}
    world = {**common, "SLOW_NODE_SECONDS": f"{slow_seconds:g}"}
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "ddpkit", "store", "--host", "127.0.0.1", "--port", str(port)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **SECRET})
    assert store.stdout is not None and "serving" in store.stdout.readline()
    try:
        with tempfile.TemporaryDirectory() as name:
            folder = Path(name)
            start = time.monotonic()
            launchers = [launcher(folder, port, f"launcher{n}", world) for n in range(2)]
            while not all("complete: this is node" in (folder / f"launcher{n}.err").read_text() for n in range(2)):
                time.sleep(0.05)
            launchers.append(launcher(folder, port, "launcher2", common))
            named_at = replaced_at = None
            while any(process.poll() is None for process in launchers):
                errors = "".join((folder / f"launcher{n}.err").read_text() for n in range(3))
                if named_at is None and "ddpkit run: straggler:" in errors:
                    named_at = time.monotonic() - start
                if replaced_at is None and "this spare node takes its place" in errors:
                    replaced_at = time.monotonic() - start
                time.sleep(0.05)
            seconds = time.monotonic() - start
            codes = [process.returncode for process in launchers]
            errors = "".join((folder / f"launcher{n}.err").read_text() for n in range(3))
            if codes != [0, 0, 0]:
                raise SystemExit(f"a run failed ({codes}):\n{errors[-4000:]}")
            steps_ms = [float(ms) for ms in re.findall(r"steps/s, step ([0-9.]+) ms", errors)]
            return Run(seconds, statistics.median(steps_ms) if steps_ms else None, named_at, replaced_at)
    finally:
        store.kill()
        store.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12000)
    parser.add_argument("--report-every", type=float, default=1.0)
    args = parser.parse_args()
    calibration = one_run(min(args.steps, 3000), args.report_every, 0.0, replace=False)
    slow = (calibration.step_ms or 2.0) / 1000
    print(f"clean step (median of the health lines): {1000 * slow:.2f} ms; node 1's loader waits that long a batch")
    kinds = {"clean": (0.0, False), "slowed, replaced": (slow, True), "slowed, not replaced": (slow, False)}
    results: dict[str, list[Run]] = {kind: [] for kind in kinds}
    for round_number in range(args.rounds):
        for kind, (seconds, replace) in kinds.items():
            results[kind].append(one_run(args.steps, args.report_every, seconds, replace))
        clean = results["clean"][-1].seconds
        line = ", ".join(f"{kind} {runs[-1].seconds:.1f} s ({runs[-1].seconds / clean:.3f}x)"
                         for kind, runs in results.items())
        replaced = results["slowed, replaced"][-1]
        print(f"round {round_number + 1}: {line}; named at {replaced.named_at or float('nan'):.1f} s, "
              f"replaced at {replaced.replaced_at or float('nan'):.1f} s", flush=True)
    print("medians over rounds (each run against its round's clean run):")
    for kind, runs in results.items():
        ratios = [run.seconds / clean.seconds for run, clean in zip(runs, results["clean"], strict=True)]
        print(f"  {kind}: {statistics.median(run.seconds for run in runs):.1f} s, {statistics.median(ratios):.3f}x clean")


if __name__ == "__main__":
    main()
