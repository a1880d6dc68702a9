"""What a rank killed with SIGKILL costs: in-place recovery beside a full restart and torchrun.

    python benchmarks/recovery.py [--ranks 2 4] [--runs 3] [--modes in-place restart torchrun] [--steps 40]

The 8x1024 MLP of ``ddp_step.py`` (batch 64 per rank, one thread per rank), trained with
``DDPStrategy``'s loop (``epochs``/``batches``/``step``) by a script this benchmark writes to a
temporary folder. Each rank appends (step, wall time) to a file after every step and saves
nothing else but a checkpoint every 10 steps, rank 0 the final parameters. Per run, one rank
(chosen at random) is killed with SIGKILL right after a random step between 5 and steps - 10, so
that the kill lands in the next step, or in the checkpoint save after steps 10, 20, ... (between
steps: in place covers a save too):

- ``in-place``: ``ddpkit run --recovery in-place --max-restarts 1`` (a warm spare takes the rank);
- ``restart``: ``ddpkit run --max-restarts 1``: every worker starts again and resumes from the checkpoint;
- ``torchrun``: ``torchrun --max-restarts 1``, the same script resuming from the checkpoint.

Printed per mode: the seconds from the kill to the next step the killed rank's successor
completed (a step completes on every rank together: it has an all-reduce), the steps trained
twice (since the checkpoint), runs that finished, and the largest difference of the final
parameters to a run without the fault (the same command, nothing killed). Figures, with the
command, in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

from ddpkit.environments import find_free_port

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from torch import nn
    import ddpkit

    steps = int(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(8) for layer in (nn.Linear(1024, 1024), nn.ReLU())])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    strategy = ddpkit.DDPStrategy()
    model, optimizer = strategy.setup(model, optimizer)
    rank = strategy.global_rank
    with open(f"pid.{rank}", "w") as handle:
        handle.write(str(os.getpid()))
    first = 0
    state = strategy.load_checkpoint("checkpoint.pt") if strategy.restart_count > 0 else None
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first = state["batch"]
    batches = [(torch.randn(64, 1024, generator=torch.Generator().manual_seed(1000 * step + rank)),)
               for step in range(steps)]
    log = open(f"steps.{rank}", "a", buffering=1)
    for epoch in strategy.epochs(1):
        for (x,) in strategy.batches(batches, skip=first):
            with strategy.step():
                optimizer.zero_grad()
                strategy.backward(model(x).square().mean())
                optimizer.step()
                done = strategy.progress.batch + 1
            log.write(f"{done} {time.time()}\\n")
            if done % 10 == 0 and done < steps:
                strategy.save_checkpoint("checkpoint.pt", {"model": model.state_dict(),
                                                           "optimizer": optimizer.state_dict(), "batch": done})
    if strategy.is_global_zero:
        torch.save(model.state_dict(), "final.pt")
    strategy.teardown()
    """
)


def command(mode: str, ranks: int, steps: int) -> list[str]:
    if mode == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--max-restarts", "1",
                "--master-port", str(find_free_port()), "train.py", str(steps)]
    recovery = ["--recovery", "in-place"] if mode in ("in-place", "fault-free") else []
    return [sys.executable, "-m", "ddpkit", "run", *recovery, "--max-restarts", "1", "--nproc-per-node", str(ranks),
            "train.py", str(steps)]


def completed(folder: Path, rank: int) -> list[tuple[int, float]]:
    path = folder / f"steps.{rank}"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            rows.append((int(parts[0]), float(parts[1])))
    return rows


def run(mode: str, ranks: int, steps: int, kill: bool, seed: int) -> dict[str, Any] | None:
    """One run; None when it did not finish."""
    folder = Path(tempfile.mkdtemp(prefix=f"ddpkit-recovery-{mode}-"))
    (folder / "train.py").write_text(SCRIPT)
    chooser = random.Random(seed)
    # After a step that a checkpoint save follows, the kill lands in the save (between steps).
    kill_after = chooser.randrange(5, steps - 9)
    victim = chooser.randrange(ranks)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    process = subprocess.Popen(command(mode, ranks, steps), cwd=folder, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    result: dict[str, Any] = {}
    try:
        if kill:
            while not any(step >= kill_after for step, _ in completed(folder, victim)):
                if process.poll() is not None:
                    return None
                time.sleep(0.002)
            killed_at_step = max(step for step, _ in completed(folder, victim))
            os.kill(int((folder / f"pid.{victim}").read_text()), signal.SIGKILL)
            killed = time.time()
        _, stderr = process.communicate(timeout=600)
        if process.returncode != 0 or not (folder / "final.pt").exists():
            print(f"  {mode}: exit {process.returncode}\n{stderr[-1500:]}", file=sys.stderr)
            return None
        if kill:
            after = [(step, moment) for step, moment in completed(folder, victim) if moment > killed]
            result["seconds"] = after[0][1] - killed
            result["trained_twice"] = killed_at_step + 1 - after[0][0]
        kept = folder.parent / f"{folder.name}.final.pt"
        shutil.copy(folder / "final.pt", kept)
        result["final_file"] = str(kept)
        return result
    finally:
        if process.poll() is None:
            process.kill()
        shutil.rmtree(folder, ignore_errors=True)


def difference(path: str, reference: dict[str, torch.Tensor]) -> float:
    final = torch.load(path, weights_only=True)
    os.remove(path)
    return max((final[name] - reference[name]).abs().max().item() for name in reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--modes", nargs="+", default=["in-place", "restart", "torchrun"],
                        choices=["in-place", "restart", "torchrun"])
    args = parser.parse_args()
    for ranks in args.ranks:
        clean = run("fault-free", ranks, args.steps, kill=False, seed=0)
        if clean is None:
            raise SystemExit(f"the fault-free run on {ranks} ranks did not finish")
        reference = torch.load(str(clean["final_file"]), weights_only=True)
        os.remove(str(clean["final_file"]))
        print(f"{ranks} ranks, {args.steps} steps, kill -9 of a random rank after a random step, {args.runs} runs per "
              "mode (interleaved)")
        outcomes: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
        failures = dict.fromkeys(args.modes, 0)
        for index in range(args.runs):
            for mode in random.Random(index).sample(args.modes, len(args.modes)):
                outcome = run(mode, ranks, args.steps, kill=True, seed=1000 * ranks + index)
                if outcome is None:
                    failures[mode] += 1
                    continue
                outcome["difference"] = difference(str(outcome.pop("final_file")), reference)
                outcomes[mode].append(outcome)
        for mode in args.modes:
            done = outcomes[mode]
            if not done:
                print(f"  {mode:9s} no run finished ({failures[mode]} failed)")
                continue
            seconds = [o["seconds"] for o in done]
            twice = statistics.median(o["trained_twice"] for o in done)
            print(f"  {mode:9s} kill -> next step: median {statistics.median(seconds):.2f} s (min {min(seconds):.2f}, "
                  f"max {max(seconds):.2f}); steps trained twice: median {twice:g}; "
                  f"finished {len(done)}/{len(done) + failures[mode]}; max |difference| to the fault-free run "
                  f"{max(o['difference'] for o in done):.2e}", flush=True)


if __name__ == "__main__":
    main()
