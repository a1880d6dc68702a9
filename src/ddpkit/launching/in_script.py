"""In-script launching: the process running the script becomes local rank 0 and re-executes the
same command for local ranks 1..N-1 (Lightning's ``DDPPlugin`` launcher), so that

    python train.py          # with DDPStrategy(parallel_devices=[torch.device("cpu")] * 2)

trains on two processes without ``ddpkit run``.

Children run through ``python -m ddpkit.workers.worker`` with the torch.distributed variables and
ddpkit's marker set, each in a session of its own (so ending its process group ends its own
children, e.g. DataLoader workers). They die with the script's process (``PR_SET_PDEATHSIG``),
and record an uncaught exception in an error file. A watcher thread in the script's process
polls them: when one fails, it prints which rank and why, ends the others and ends this
process too (its collectives would otherwise wait for the dead rank until the timeout).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType

import torch

from ddpkit._network import find_free_port
from ddpkit.environments import ClusterEnvironment, LocalEnvironment
from ddpkit.environments.preemption import PREEMPTED_EXIT_CODE
from ddpkit.launching.config import LaunchConfig, RunAs
from ddpkit.launching.worker_environment import (
    job_secret_for_workers,
    performance_defaults,
    rank_variables,
    worker_command,
)
from ddpkit.logs import get_logger
from ddpkit.workers.processes import WorkerProcess, WorkerProcesses, describe_exit

__all__: list[str] = []

_log = get_logger("launching")

_POLL_SECONDS = 0.1
_GRACE_SECONDS = 3.0
# How long an exception in this process waits for a child's failure that may have caused it.
_CHILD_FAILURE_SECONDS = 1.0


def command_of_this_script(argv: list[str] | None = None) -> list[str]:
    """The arguments that re-run this process's script through ddpkit's worker bootstrap."""
    argv = sys.argv if argv is None else argv
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":  # started as `python -m package.module`
        module = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return worker_command(RunAs.MODULE, module, argv[1:])
    script = argv[0] if argv else ""
    if not script or script == "-c" or not os.path.isfile(script):
        raise RuntimeError(
            f"DDPStrategy would start the other local ranks by running this script again, but this process "
            f"has no script to run (sys.argv[0] = {script!r}: an interactive session, a notebook or `python -c`). "
            "Put the training code in a file and run that, start it with `ddpkit run`, or run a function on "
            "several processes with ddpkit.launch(fn, nprocs=N)."
        )
    return worker_command(RunAs.SCRIPT, os.path.abspath(script), argv[1:])


@dataclass
class LocalRanks:
    """The children this process started, and the thread that watches them."""

    children: WorkerProcesses
    finished: threading.Event = field(default_factory=threading.Event)
    # Held by whoever reports: the watcher must not end the process while the main thread prints.
    _report_lock: threading.Lock = field(default_factory=threading.Lock)

    def watch(self) -> None:
        """Watch the children from a thread; and when this process dies of an exception, name a child
        that failed first (this process's own error is then only "connection closed")."""
        threading.Thread(target=self._watch, name="ddpkit-local-ranks", daemon=True).start()
        previous = sys.excepthook

        def on_uncaught_exception(kind: type[BaseException], value: BaseException, trace: TracebackType | None) -> None:
            with self._report_lock:
                previous(kind, value, trace)
                sys.stderr.flush()
                deadline = time.monotonic() + _CHILD_FAILURE_SECONDS
                while not self.children.failed() and time.monotonic() < deadline:
                    time.sleep(_POLL_SECONDS)
                if not self.finished.is_set():
                    self._write_report(self.children.failed())
                    self.terminate()

        sys.excepthook = on_uncaught_exception

    def _watch(self) -> None:
        while not self.finished.is_set():
            failed = self.children.failed()
            if failed and self._report_lock.acquire(blocking=False):
                if self.finished.is_set():  # the main thread reported and ended them already
                    return
                self._write_report(failed)
                self.terminate()
                os._exit(1)  # the main thread may be blocked in a collective that would wait for the dead rank
            time.sleep(_POLL_SECONDS)

    def _write_report(self, failed: list[WorkerProcess]) -> None:
        """Say which child failed first and why. With os.write: sys.stderr may be half-way through
        another thread's write, and the process may end right after."""
        if not failed:
            return
        message = f"\nddpkit: {self.children.describe_root_cause(failed)}\nddpkit: ending the job.\n"
        os.write(2, message.encode(errors="replace"))

    def terminate(self) -> None:
        """End every child that is still running (SIGTERM to its process group, SIGKILL after a grace)."""
        self.finished.set()
        self.children.end(_GRACE_SECONDS)

    def join(self, timeout: float) -> None:
        """Wait for the children to end by themselves; ``RuntimeError`` naming those that failed.

        Children still running after ``timeout`` are ended and count as failed; one that exited
        with ``PREEMPTED_EXIT_CODE`` saved and stopped with this process, and did not fail.
        """
        deadline = time.monotonic() + timeout
        failed = []
        for child in self.children.workers:
            try:
                code = child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = -signal.SIGTERM
            if code not in (0, PREEMPTED_EXIT_CODE):
                failed.append(f"local rank {child.local_rank} {describe_exit(code)}")
        self.finished.set()
        self.children.close(_GRACE_SECONDS)
        if failed:
            raise RuntimeError("local ranks that this process started did not end cleanly: " + ", ".join(failed))


def processes_to_start(environment: ClusterEnvironment, devices: int, num_nodes: int) -> int:
    """How many processes in-script launching must make on this node (this one included) for a
    strategy with ``devices`` parallel devices on ``num_nodes`` nodes; 0: none (a launcher or
    scheduler started them, or the user set WORLD_SIZE, or one device on one node)."""
    if environment.creates_processes_externally:
        return 0
    if not isinstance(environment, LocalEnvironment) or environment.world_size() > 1:
        return 0  # a user-made environment, or WORLD_SIZE set by hand: the processes exist already
    if num_nodes > 1 and devices == 0:
        raise ValueError(f"num_nodes={num_nodes} needs parallel_devices (the devices of each node), e.g. "
                         "parallel_devices=[torch.device('cpu')] * 2, or start the job with `ddpkit run`.")
    return devices if devices > 1 or num_nodes > 1 else 0


def start_local_ranks(nproc_per_node: int, num_nodes: int, env: Mapping[str, str] | None = None) -> LocalRanks:
    """Start local ranks 1..N-1 of this node and set this process up as local rank 0.

    ``MASTER_ADDR`` (default 127.0.0.1), ``MASTER_PORT`` (default a free port, one node only)
    and ``NODE_RANK`` (default 0) come from the environment.
    """
    env = os.environ if env is None else env
    node_rank = _integer(env, "NODE_RANK", 0)
    if not 0 <= node_rank < num_nodes:
        raise ValueError(f"NODE_RANK={node_rank} with num_nodes={num_nodes}: node ranks count from 0, so set "
                         f"NODE_RANK to 0..{num_nodes - 1} on each node.")
    address = env.get("MASTER_ADDR", "").strip() or "127.0.0.1"
    if env.get("MASTER_PORT"):
        port = _integer(env, "MASTER_PORT", 0)
    elif num_nodes > 1:
        raise ValueError(f"num_nodes={num_nodes} needs MASTER_ADDR and MASTER_PORT set to the same values on every "
                         "node (the address of node 0 and a free port there).")
    else:
        port = find_free_port(address)
    command = command_of_this_script()
    config = LaunchConfig(nproc_per_node, num_nodes, node_rank, address, port)
    # Only the thread share, not ddpkit run's malloc thresholds: this process is rank 0 and
    # started with glibc's defaults, and ranks in lockstep should not differ in speed.
    threads = performance_defaults(nproc_per_node, env).get("OMP_NUM_THREADS")
    if threads is not None:
        env = {**env, "OMP_NUM_THREADS": threads}
        os.environ["OMP_NUM_THREADS"] = threads
        torch.set_num_threads(int(threads))
        _log.info(f"ddpkit: OMP_NUM_THREADS={threads} for each of this node's {nproc_per_node} processes "
                  "(set it yourself to choose).")
    secret = job_secret_for_workers(num_nodes > 1, env)  # this process is rank 0: it takes the secret too
    if secret:
        env = {**env, **secret}
        os.environ.update(secret)
    children = WorkerProcesses("ranks")
    for local_rank in range(1, nproc_per_node):
        variables = rank_variables(config, port, local_rank)
        children.start(command, {**env, **variables}, int(variables["RANK"]), local_rank)
    os.environ.update(rank_variables(config, port, local_rank=0))  # this process is local rank 0
    ranks = LocalRanks(children)
    ranks.watch()
    return ranks


def _integer(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer. Set it to a whole number, or unset it.") from None
