"""How one cell of the launch-mode matrix runs: a launch mode (torchrun's flags), a script kind
(``jobs/``), one launcher per node, under ``ddpkit run`` or torchrun, and what it left."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from job_processes import job_marker, processes_of_job

JOBS = Path(__file__).resolve().parent / "jobs"
KINDS = {"plain": "plain", "ddpkit": "with_ddpkit", "lightning": "with_lightning", "accelerate": "with_accelerate"}
LAUNCHERS = {"ddpkit run": [sys.executable, "-m", "ddpkit", "run"], "torchrun": [sys.executable, "-m", "torch.distributed.run"]}
_STATIC = ("--nnodes", "2", "--node-rank", "{node}", "--master-addr", "{address}", "--master-port", "{port}")
_C10D = ("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "{address}:{port}", "--rdzv-id", "matrix")
_RESTART = ("--max-restarts", "1")


@dataclass(frozen=True)
class Mode:
    """A launch mode: the flags every node's launcher gets ({node}, {address}, {port} filled in)."""

    name: str
    flags: tuple[str, ...] = ()
    nnodes: int = 1
    kill_rank: int | None = None  # this rank kills itself (SIGKILL) in the first start
    run_as: str = "script"  # or "module" (-m), "program" (--no-python)
    # Why torchrun is not run beside ddpkit run in this mode (None: it is).
    no_torchrun: str | None = None
    # The store at the endpoint is `ddpkit store`'s, a process outside the nodes: every launcher is its client.
    store_outside: bool = False


_STALE = "torchrun's restarted attempt reads the attempt before's keys in its store (3 of 6 runs failed or hung)"
MODES = {mode.name: mode for mode in [
    Mode("one node"),
    Mode("standalone", ("--standalone",)),
    Mode("static nodes", _STATIC, nnodes=2),
    Mode("static nodes, restarts", (*_STATIC, *_RESTART), nnodes=2),
    Mode("c10d", _C10D, nnodes=2),
    Mode("c10d, restarts", (*_C10D, *_RESTART), nnodes=2),
    Mode("one node, a rank killed", _RESTART, kill_rank=1, no_torchrun=_STALE),
    Mode("static nodes, a rank killed", (*_STATIC, *_RESTART), nnodes=2, kill_rank=1, no_torchrun=_STALE),
    Mode("c10d, a rank killed", (*_C10D, *_RESTART), nnodes=2, kill_rank=1, no_torchrun=_STALE),
    Mode("c10d, store outside", _C10D, nnodes=2, store_outside=True),
    Mode("c10d, store outside, a rank killed", (*_C10D, *_RESTART), nnodes=2, kill_rank=1, no_torchrun=_STALE,
         store_outside=True),
    Mode("module", run_as="module"),
    Mode("no python", run_as="program"),
    Mode("in place", ("--recovery", "in-place", *_RESTART), no_torchrun="torchrun has no in-place recovery"),
    Mode("in place, a rank killed", ("--recovery", "in-place", *_RESTART), kill_rank=1,
         no_torchrun="torchrun has no in-place recovery"),
]}


def _stacks_and_output(launchers: Sequence[subprocess.Popen[str]], marker: dict[str, str]) -> str:
    """SIGABRT to every process of a job that is past its bound (each prints its threads' Python
    stacks: PYTHONFAULTHANDLER), then what each launcher wrote, stacks included."""
    # The workers first: their stacks reach the console through their launcher while it lives.
    own = {process.pid for process in launchers}
    for pids in ([pid for pid in processes_of_job(marker) if pid not in own], own):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        time.sleep(1.0)
    said = []
    for node, process in enumerate(launchers):
        try:
            out, err = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        said.append(f"=== launcher of node {node} (exit code {process.returncode})\n--- stdout\n{(out or '')[-3000:]}\n"
                    f"--- stderr\n{(err or '')[-12000:]}")
    return "\n".join(said)


@dataclass
class Run:
    """What one launcher command did on every node."""

    codes: list[int]
    out: str
    err: str
    final: dict[str, torch.Tensor] | None  # rank 0's parameters (final.pt)
    left: list[int]  # processes of the run still alive after it ended

    def reports(self) -> list[tuple[int, int, int, int]]:
        """(world, sum, rank, attempt) of each ``WORLD.. SUM.. RANK.. ATTEMPT..`` line."""
        return [tuple(map(int, found)) for found in re.findall(r"WORLD(\d+) SUM(\d+) RANK(\d+) ATTEMPT(\d+)", self.out)]  # type: ignore[misc]

    def describe(self) -> str:
        return f"exit codes {self.codes}\n--- stdout\n{self.out[-2000:]}\n--- stderr\n{self.err[-6000:]}"


def run_cell(launcher: str, mode: Mode, kind: str, folder: Path, port: int, nproc: int,
             namespaces: Sequence[tuple[str, str]] | None = None, timeout: float = 150) -> Run:
    """Run ``kind``'s script in ``mode`` under ``launcher`` (a key of LAUNCHERS), one launcher per
    node (each in its network namespace when given), in a folder of its own under ``folder``."""
    cell = folder / launcher.replace(" ", "-")
    shutil.copytree(JOBS, cell / "jobs", ignore=shutil.ignore_patterns("__pycache__"))
    address = namespaces[0][1] if namespaces else "127.0.0.1"
    marker = job_marker("cell")
    # PYTHONFAULTHANDLER: a cell past its bound shows where every process of the job waited (SIGABRT).
    environment = {**os.environ, **marker, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    if mode.kill_rank is not None:
        environment["KILL_RANK"] = str(mode.kill_rank)
    script = {"script": [f"jobs/{KINDS[kind]}.py"], "module": ["-m", f"jobs.{KINDS[kind]}"],
              "program": ["--no-python", sys.executable, f"jobs/{KINDS[kind]}.py"]}[mode.run_as]
    launchers = []
    store = None
    if mode.store_outside:
        store = subprocess.Popen([sys.executable, "-m", "ddpkit", "store", "--host", address, "--port", str(port)],
                                 env=environment, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if store.stdout is None or "serving" not in store.stdout.readline():
            store.kill()
            raise RuntimeError(f"ddpkit store did not start: {store.communicate()[0]}")
    for node in range(mode.nnodes):
        flags = [flag.format(node=node, address=address, port=port) for flag in mode.flags]
        command = [*LAUNCHERS[launcher], "--nproc-per-node", str(nproc), *flags, *script]
        if namespaces:
            command = ["ip", "netns", "exec", namespaces[node][0], *command]
        launchers.append(subprocess.Popen(command, cwd=cell, env=environment, text=True, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE))
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for process in launchers:
            outputs.append(process.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{launcher} did not end within {timeout:g} s; what every launcher said, with the "
                             f"Python stacks of the job's processes:\n{_stacks_and_output(launchers, marker)}") from None
    finally:
        for process in [*launchers, *([store] if store is not None else [])]:
            process.kill()
            process.wait()
    final = torch.load(cell / "final.pt") if (cell / "final.pt").exists() else None
    return Run([process.returncode for process in launchers], "".join(out for out, _ in outputs),
               "".join(err for _, err in outputs), final, processes_of_job(marker, wait_seconds=5.0))


def largest_difference(one: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    return max((one[name] - other[name]).abs().max().item() for name in one)
