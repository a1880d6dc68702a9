"""The README's example under a shrink, long enough for rounding to grow: does its own check hold?

    python benchmarks/example_shrink.py [--runs 5] [--epochs 30] [--samples 16384] [--ranks-per-node 1]

Each run: ``ddpkit store`` and two ``ddpkit run --nnodes 1:2 --recovery in-place`` launchers (one
or two ranks each) training ``examples/train.py --checkpoint``; node 1 (its launcher and every
process it started) is SIGKILLed at a random time in epoch 3 or 4. The survivor trains node 1's
shares too, one forward over both, which rounds unlike the two ranks, and the training amplifies
that last bit (1e-3 by epoch 16, 0.4 by epoch 30). A run passes when the example exits 0: its
check compares the parameters with one process's at every epoch, against what rounding alone
explains there (``examples/train.py``, ``verdict``). Printed per run: the kill's epoch, the exit
code, the final difference and the largest ratio of an epoch's difference to its allowance; then
how many runs the check passed. One more run without a kill gives the same figures for the
unshrunk job.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _processes import descendants

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train.py"
sys.path.insert(0, str(ROOT / "examples"))
import train  # noqa: E402  (the example's own reference and check)


def free_port() -> int:
    from ddpkit.environments import find_free_port

    return find_free_port("127.0.0.1")


def kill_node(launcher: subprocess.Popen[bytes]) -> None:
    for pid in [launcher.pid, *descendants(launcher.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def one_run(folder: Path, args: argparse.Namespace, kill_epoch: float | None) -> dict[str, object]:
    """Two nodes; node 1 killed ``kill_epoch`` epochs into the run (None: not killed)."""
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "ddpkit", "store", "--host", "127.0.0.1", "--port", str(port)],
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert store.stdout is not None and "serving" in store.stdout.readline()
    train_args = ["--epochs", str(args.epochs), "--samples", str(args.samples), "--checkpoint", str(folder) + os.sep]
    command = [sys.executable, "-m", "ddpkit", "run", "--nnodes", "1:2", "--nproc-per-node", str(args.ranks_per_node),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", folder.name,
               "--rdzv-conf", "last_call_timeout=5", "--recovery", "in-place", "--max-restarts", "1", str(EXAMPLE),
               *train_args]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                   "DDPKIT_JOB_SECRET": "example-shrink-" + folder.name}
    outputs = [open(folder / f"node{n}.out", "w+") for n in range(2)]
    launchers = [subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment) for out in outputs]
    try:
        started = time.monotonic()
        if kill_epoch is not None:
            lost = _node_one(folder, started)
            seconds = _epoch_seconds(folder, started)
            time.sleep(max(0.0, kill_epoch * seconds - (time.monotonic() - started)))
            kill_node(launchers[lost])
            survivors = [launcher for n, launcher in enumerate(launchers) if n != lost]
        else:
            survivors = launchers
        codes = [launcher.wait(timeout=args.bound) for launcher in survivors]
    finally:
        for launcher in launchers:
            kill_node(launcher)
            launcher.wait()
        store.kill()
        store.wait()
    text = "".join((folder / f"node{n}.out").read_text(errors="replace") for n in range(2))
    summary = next((json.loads(line.removeprefix("summary ")) for line in text.splitlines()
                    if line.startswith("summary ")), None)
    ratio = _worst_ratio(folder, args) if (folder / "checkpoint.pt").exists() else None
    return {"codes": codes, "summary": summary, "worst_ratio": ratio, "shrank": "the world shrank" in text,
            "tail": text[-1500:]}


def _node_one(folder: Path, started: float) -> int:
    """Which launcher is node 1 (by its output), once the rendezvous said."""
    while time.monotonic() - started < 120:
        for n in range(2):
            if "this is node 1 of 2" in (folder / f"node{n}.out").read_text(errors="replace"):
                return n
        time.sleep(0.1)
    raise SystemExit("example_shrink: the rendezvous never said which launcher is node 1")


def _epoch_seconds(folder: Path, started: float) -> float:
    """The length of one epoch, timed from the first two epoch lines rank 0 prints."""
    seen: list[float] = []
    while len(seen) < 2 and time.monotonic() - started < 300:
        text = "".join((folder / f"node{n}.out").read_text(errors="replace") for n in range(2))
        count = len(re.findall(r"^epoch \d+/\d+  loss", text, flags=re.M))
        if count > len(seen):
            seen.append(time.monotonic())
        time.sleep(0.02)
    first = seen[0] - started
    return seen[1] - seen[0] if len(seen) > 1 else first


def _worst_ratio(folder: Path, args: argparse.Namespace) -> float:
    """The largest ratio, over the epochs, of the run's difference to one process to what the
    example's check allows there (above 1: the check fails)."""
    state = torch.load(folder / "checkpoint.pt", weights_only=False)
    namespace = argparse.Namespace(samples=args.samples, lr=0.05, warmup_steps=0, epochs=args.epochs, batch_size=64)
    checked = train.verdict(state["trajectory"]["epochs"], namespace, 2 * args.ranks_per_node)
    return checked.difference / checked.allowed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bound", type=float, default=900.0, help="seconds a run may take")
    args = parser.parse_args()
    chooser = random.Random(args.seed)
    base = Path(tempfile.mkdtemp(prefix="ddpkit-example-shrink-"))
    passed = 0
    for index in range(args.runs + 1):
        kill_epoch = None if index == args.runs else chooser.uniform(2.0, 4.0)
        folder = base / f"run{index}"
        folder.mkdir()
        result = one_run(folder, args, kill_epoch)
        summary = result["summary"] or {}
        good = result["codes"] == [0] * len(result["codes"]) and summary.get("within_rounding") is True
        passed += good and kill_epoch is not None
        where = "no kill" if kill_epoch is None else f"node 1 killed in epoch {int(kill_epoch) + 1}"
        print(f"run {index} ({where}): codes {result['codes']}, shrank {result['shrank']}, final difference "
              f"{summary.get('max_difference')}, worst epoch at {result['worst_ratio']:.3f} of its allowance, "
              f"check {'passed' if good else 'FAILED'}", flush=True)
        if not good:
            print("    " + str(result["tail"]).replace("\n", "\n    "), flush=True)
    print(f"example_shrink: the check passed {passed} of {args.runs} shrunk runs ({args.epochs} epochs, "
          f"{args.samples} samples, {args.ranks_per_node} rank(s) per node); folders in {base}")


if __name__ == "__main__":
    main()
