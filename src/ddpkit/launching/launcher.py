"""Start, watch and reconcile the workers of one node (what ``ddpkit run`` does).

Each worker runs ``python -m ddpkit.launching.worker script.py args`` in a session of its own, so that
ending its process group ends its children too. The launcher polls them; at the first failure
(non-zero exit or a signal) it asks the others to stop (SIGTERM to their process groups), kills
what is left after ``grace`` seconds, and returns 1 with a summary that names the root cause: the
earliest recorded exception (workers write them to an error file), else the first rank seen to
fail. SIGINT and SIGTERM to the launcher end every worker the same way and return 130 and 143.
SIGUSR1 to the launcher prints every worker's Python stacks (see ``ddpkit.launching.worker``).
Workers notice a launcher killed with SIGKILL through PR_SET_PDEATHSIG (see ``ddpkit.launching.worker``).
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from ddpkit._network import find_free_port
from ddpkit.environments import DDPKIT_LAUNCHED
from ddpkit.launching.processes import (
    WorkerProcess,
    describe_exit,
    end_process_groups,
    root_cause,
)
from ddpkit.logs import get_logger
from ddpkit.testing import RankFailedError, WorkerPool

# How long the launcher gives workers to write their stacks after SIGUSR1.
_STACK_DUMP_WAIT_SECONDS = 0.5

__all__ = ["LaunchConfig", "LaunchError", "RankFailedError", "launch", "performance_defaults", "rank_variables",
           "run_workers", "validate", "worker_environment"]

_log = get_logger("launching")


class LaunchError(ValueError):
    """Bad launch arguments, found before anything started."""


@dataclass(frozen=True)
class LaunchConfig:
    """Where this node's workers sit in the job."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (single node only)
    backend: str | None = None

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def launch(function: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), backend: str = "gloo",
           threads: int = 1, timeout: float = math.inf) -> list[Any]:
    """Run ``function(*args)`` in ``nprocs`` new processes, connected to each other, and return
    each rank's result, by rank.

    The process group exists when ``function`` starts (``backend`` "gloo", or "nccl" with one GPU
    per process) and is torn down after. ``function`` and ``args`` must be picklable (a
    module-level function), and the calling script needs the ``if __name__ == "__main__":``
    guard, since processes are spawned. When a rank raises or dies, the others are stopped at
    once and ``RankFailedError`` carries that rank and its traceback; ``timeout`` bounds the run.
    """
    if nprocs < 1:
        raise LaunchError(f"nprocs={nprocs}: need at least 1 process.")
    with WorkerPool(nprocs, timeout=timeout, pg_timeout=600, threads=threads, backend=backend) as pool:
        return pool.run(function, *args)


def validate(config: LaunchConfig, script: str) -> None:
    """Refuse bad input before any process starts, naming the flag, its value and the fix."""
    if config.nproc_per_node < 1:
        raise LaunchError(f"--nproc-per-node={config.nproc_per_node}: need at least 1 process per node.")
    if config.nnodes < 1:
        raise LaunchError(f"--nnodes={config.nnodes}: need at least 1 node.")
    if not 0 <= config.node_rank < config.nnodes:
        raise LaunchError(
            f"--node-rank={config.node_rank} with --nnodes={config.nnodes}: node ranks count from 0, so use "
            f"0..{config.nnodes - 1}."
        )
    if not Path(script).is_file():
        raise LaunchError(f"script {script!r} does not exist (looked in {os.getcwd()}). Check the path.")
    try:
        socket.getaddrinfo(config.master_addr, None)
    except socket.gaierror as error:
        raise LaunchError(
            f"--master-addr={config.master_addr!r} does not resolve ({error}). Use the host name or IP address "
            "of the node with --node-rank=0."
        ) from None
    if config.master_port is None:
        if config.nnodes > 1:
            raise LaunchError("--master-port is required with --nnodes > 1: every node must use the same port.")
        return
    if not 1 <= config.master_port <= 65535:
        raise LaunchError(f"--master-port={config.master_port} is not a TCP port (1..65535).")
    if config.node_rank == 0 and not _port_is_free(config.master_addr, config.master_port):
        raise LaunchError(
            f"--master-port={config.master_port} is already in use on {config.master_addr}. Choose another port, "
            "or leave --master-port out on a single node to get a free one."
        )


def _port_is_free(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError:
            return False
    return True


def rank_variables(config: LaunchConfig, port: int, local_rank: int) -> dict[str, str]:
    """What a worker of this node needs to find its place in the job: torch.distributed's
    variables, ddpkit's marker and the backend."""
    variables = {
        "MASTER_ADDR": config.master_addr,
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(config.world_size),
        "RANK": str(config.node_rank * config.nproc_per_node + local_rank),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
        "NODE_RANK": str(config.node_rank),
        DDPKIT_LAUNCHED: "1",
    }
    if config.backend:
        variables["DDPKIT_BACKEND"] = config.backend
    return variables


def worker_environment(config: LaunchConfig, port: int, local_rank: int, error_file: str,
                       base: Mapping[str, str]) -> dict[str, str]:
    """The whole environment of a worker this process starts and watches (see ``ddpkit.launching.worker``)."""
    return {**base, **rank_variables(config, port, local_rank), "DDPKIT_LAUNCHER_PID": str(os.getpid()),
            "DDPKIT_ERROR_FILE": error_file}


# glibc's malloc hands freed memory of 128 KiB and more back to the kernel and takes it back on the
# next allocation, zero-filled page by page: training frees and reallocates its gradients and
# activations every step; these thresholds keep it in the heap (figures: benchmarks/README.md,
# "Allocator and threads"). Both are set: a trim threshold alone turns glibc's adaptive mmap
# threshold off and faults more. 32 MiB is the largest mmap threshold glibc accepts on 64-bit systems.
_MALLOC_DEFAULTS = {"MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024), "MALLOC_TRIM_THRESHOLD_": str(256 * 1024 * 1024)}
_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def performance_defaults(nproc_per_node: int, base: Mapping[str, str]) -> dict[str, str]:
    """Environment variables that keep one node's workers from slowing each other down, each only
    where ``base`` (the user's environment) has not chosen already:

    - ``OMP_NUM_THREADS``: the cores this process may use, shared out among the workers (torchrun
      sets 1): workers that each use every core take turns on them (benchmarks/README.md).
    - glibc's malloc thresholds (Linux; see ``_MALLOC_DEFAULTS``), unless any malloc setting is given.
    """
    defaults: dict[str, str] = {}
    if "OMP_NUM_THREADS" not in base:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        defaults["OMP_NUM_THREADS"] = str(max(1, cores // nproc_per_node))
    if sys.platform.startswith("linux") and not any(name in base for name in _MALLOC_SETTINGS):
        defaults.update(_MALLOC_DEFAULTS)
    return defaults


def run_workers(script: str, script_args: Sequence[str], config: LaunchConfig, grace: float = 3.0,
                poll_interval: float = 0.05) -> int:
    """Run ``script`` on this node's workers until all succeed or one fails; return the exit code."""
    validate(config, script)
    port = config.master_port if config.master_port is not None else find_free_port(config.master_addr)
    stop_signal: list[int] = []

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        stop_signal.append(signum)

    def request_stacks(_signum: int, _frame: FrameType | None) -> None:
        stack_requests.append(time.monotonic())

    stack_requests: list[float] = []
    defaults = performance_defaults(config.nproc_per_node, os.environ)
    if "OMP_NUM_THREADS" in defaults:
        _log.info(f"ddpkit run: OMP_NUM_THREADS={defaults['OMP_NUM_THREADS']} for each of this node's "
                  f"{config.nproc_per_node} workers (set it yourself to choose).")
    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, request_stacks)
    with tempfile.TemporaryDirectory(prefix="ddpkit-run-") as errors:
        workers = []
        try:
            for local_rank in range(config.nproc_per_node):
                error_file = os.path.join(errors, f"rank{local_rank}.json")
                stack_file = os.path.join(errors, f"rank{local_rank}.stacks")
                environment = worker_environment(config, port, local_rank, error_file, {**defaults, **os.environ})
                environment["DDPKIT_STACK_FILE"] = stack_file
                process = subprocess.Popen([sys.executable, "-m", "ddpkit.launching.worker", script, *script_args],
                                           env=environment, start_new_session=True)
                workers.append(WorkerProcess(local_rank, int(environment["RANK"]), process, error_file, stack_file))
            return _watch(workers, stop_signal, stack_requests, grace, poll_interval)
        finally:
            _end_all(workers, grace)
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _watch(workers: list[WorkerProcess], stop_signal: list[int], stack_requests: list[float], grace: float,
           poll_interval: float) -> int:
    while True:
        if stack_requests:
            stack_requests.clear()
            _print_stacks(workers)
        if stop_signal:
            name = signal.Signals(stop_signal[0]).name
            _log.warning(f"ddpkit run: received {name}, stopping all {len(workers)} workers")
            _end_all(workers, grace)
            return 128 + stop_signal[0]
        codes = [worker.process.poll() for worker in workers]
        failed = [worker for worker, code in zip(workers, codes) if code not in (None, 0)]
        if failed:
            # Only failures seen at this first poll can be the cause; later ones follow from the shutdown.
            _end_all(workers, grace)
            print(_summary(workers, failed), file=sys.stderr, flush=True)
            return 1
        if all(code == 0 for code in codes):
            return 0
        time.sleep(poll_interval)


def _print_stacks(workers: list[WorkerProcess]) -> None:
    """Ask every running worker for its threads' stacks (SIGUSR1, to the worker only: its children
    have no handler) and print what they wrote, rank by rank."""
    sizes = {}
    for worker in workers:
        if worker.process.poll() is None:
            sizes[worker.rank] = _size(worker.stack_file)
            os.kill(worker.process.pid, signal.SIGUSR1)
    time.sleep(_STACK_DUMP_WAIT_SECONDS)
    print(f"ddpkit run: Python stacks of {len(sizes)} running workers (SIGUSR1)", file=sys.stderr)
    for worker in workers:
        if worker.rank in sizes:
            with open(worker.stack_file, encoding="utf-8", errors="replace") as handle:
                handle.seek(sizes[worker.rank])
                stacks = handle.read().rstrip() or "(nothing written)"
            print(f"=== rank {worker.rank} (local rank {worker.local_rank}, pid {worker.process.pid}) ===\n{stacks}",
                  file=sys.stderr)
    sys.stderr.flush()


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _end_all(workers: list[WorkerProcess], grace: float) -> None:
    """SIGTERM to every live worker's process group, SIGKILL after ``grace`` seconds, reap all."""
    pending = [worker for worker in workers if not worker.reaped]
    end_process_groups([worker.process for worker in pending], grace)
    for worker in pending:
        worker.reaped = True


def _summary(workers: list[WorkerProcess], failed: list[WorkerProcess]) -> str:
    """Name the root cause (see ``root_cause``) among the workers found failed at the first poll
    that saw a failure."""
    stopped = f"ddpkit run: all {len(workers)} workers were stopped."
    worker, record = root_cause(failed, workers)
    if record is None:
        return (f"ddpkit run: rank {worker.rank} (local rank {worker.local_rank}, pid {worker.process.pid}) "
                f"{describe_exit(worker.process.returncode)} without recording an exception.\n{stopped}")
    return (f"ddpkit run: rank {worker.rank} (local rank {worker.local_rank}, pid {worker.process.pid}) failed "
            f"first with {record['type']}: {record['message']}\n{record['traceback']}{stopped}")
