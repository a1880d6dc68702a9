"""Start, watch and reconcile the workers of one node (what ``ddpkit run`` does), and ``launch(fn)``.

The workers are started, ended and blamed by ``launching.processes``: each runs
``python -m ddpkit.launching.worker script.py args`` in a session of its own. The launcher polls
them; at the first failure (non-zero exit or a signal) it asks the others to stop (SIGTERM to their
process groups), kills what is left after ``grace`` seconds, and returns 1 with a summary that
names the root cause: the earliest recorded exception (workers write them to an error file), else
the first rank seen to fail. With ``--max-restarts N`` it then starts every worker again, up to N
times (``DDPKIT_RESTART_COUNT`` and torchrun's ``TORCHELASTIC_RESTART_COUNT`` say which start it
is), and the exit code and summary are the last failure's.

With ``--recovery in-place`` (``launching.replacement``) the launcher also runs the store
(``launching.store_host``) and a warm spare; a worker killed by a signal is replaced by the spare
while the others keep running (they re-form the group with it: ``ddpkit.recovery``), and each
replacement counts against ``--max-restarts``; any other failure goes the way above.

SIGINT to the launcher ends every worker the same way and returns 130, without a restart.
SIGTERM, or the signal chosen with ``--preemption-signal``, is a preemption (``ddpkit.preemption``):
each worker gets SIGTERM on its own process; a script that calls ``DDPStrategy.preempted()``
saves and exits with 75 on every rank, and so does the launcher; a worker that SIGTERM ended (a
script that does not) makes the launcher end the others and return 143 (128 + the signal). A
second signal kills every worker at once. Neither is restarted. SIGUSR1 to the launcher prints
every worker's Python stacks, unless it is the preemption signal. Workers notice a launcher
killed with SIGKILL through PR_SET_PDEATHSIG (see ``ddpkit.launching.worker``).
``launch(fn)`` runs a function instead of a script, on the same kind of workers (``launching.pool``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.machinery
import math
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from ddpkit._allocator import MALLOC_DEFAULTS, malloc_chosen
from ddpkit._network import find_free_port, gloo_interface_towards
from ddpkit.environments import IN_PLACE
from ddpkit.launching.nodes import FailureCause, NodeContactLostError, NodeCoordination
from ddpkit.launching.output import OutputPlan
from ddpkit.launching.pool import RankFailedError, WorkerPool
from ddpkit.launching.processes import SPARE, WorkerProcess, WorkerProcesses
from ddpkit.launching.rendezvous import RendezvousError, RendezvousSettings, claim_endpoint, join
from ddpkit.launching.replacement import Replacements, ready_file, recovery_timeout_seconds
from ddpkit.launching.store_client import GaveUpWaiting, GiveUp
from ddpkit.launching.store_host import StoreHost, StoreHostError
from ddpkit.logs import get_logger
from ddpkit.preemption import PREEMPTED_EXIT_CODE
from ddpkit.variables import (
    DDPKIT_BACKEND,
    DDPKIT_HOSTED_STORE,
    DDPKIT_LAUNCHED,
    DDPKIT_PREEMPTION_SIGNAL,
    DDPKIT_READY_FILE,
    DDPKIT_RECOVERY,
    DDPKIT_RESTART_COUNT,
)

__all__ = ["LaunchConfig", "LaunchError", "RankFailedError", "launch", "performance_defaults", "rank_variables",
           "run_workers", "validate", "worker_command"]

_log = get_logger("launching")


class LaunchError(ValueError):
    """Bad launch arguments, found before anything started."""


@dataclass(frozen=True)
class LaunchConfig:
    """Where this node's workers sit in the job, how they run the script and where their output goes."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (single node only)
    backend: str | None = None
    max_restarts: int = 0  # times the workers are started again after a failure (torchrun's flag)
    preemption_signal: signal.Signals = signal.SIGTERM  # besides SIGTERM: asks the workers to save and stop
    recovery: str = "fail-fast"  # or "in-place": a killed worker is replaced while the others go on
    run_as: str = "script"  # "script" (python script.py), "module" (python -m), "program" (no python)
    output: OutputPlan = field(default_factory=OutputPlan)  # default: the launcher's own streams
    # torchrun's c10d rendezvous (``launching.rendezvous``): the node rank comes from it, and the
    # master address and port are the endpoint's. None: static (``node_rank``, ``master_*``).
    rendezvous: RendezvousSettings | None = None

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
    if config.max_restarts < 0:
        raise LaunchError(f"--max-restarts={config.max_restarts}: give 0 (no restart) or more.")
    if config.recovery == IN_PLACE and config.nnodes > 1:
        raise LaunchError(
            f"--recovery in-place with --nnodes={config.nnodes}: in-place recovery replaces ranks on one node so far. "
            "Across nodes use --recovery fail-fast (the default) with --max-restarts: every node's workers restart "
            "together and resume from the last checkpoint."
        )
    if config.recovery not in ("fail-fast", IN_PLACE):
        raise LaunchError(f"--recovery={config.recovery!r}: use 'fail-fast' (the default) or {IN_PLACE!r}.")
    if config.recovery == IN_PLACE:
        if config.max_restarts < 1:
            raise LaunchError(f"--recovery in-place with --max-restarts={config.max_restarts}: each replacement of a "
                              "lost rank counts against --max-restarts; give --max-restarts 1 or more.")
        try:
            recovery_timeout_seconds()
        except ValueError as error:
            raise LaunchError(str(error)) from None
        if config.backend == "nccl":
            raise LaunchError("--recovery in-place works with Gloo so far (NCCL communicators of the survivors would "
                              "have to be aborted and rebuilt): use --backend gloo, or --recovery fail-fast with "
                              "--max-restarts.")
    _check_script(config.run_as, script)
    if config.run_as == "program" and config.recovery == IN_PLACE:
        raise LaunchError("--recovery in-place with --no-python: a warm spare runs ddpkit's worker bootstrap, in "
                          "python. Run a python script (or -m module), or use --max-restarts without in-place recovery.")
    if config.rendezvous is not None:  # the node rank, address and port come from the rendezvous
        _check_endpoint(config.rendezvous)
        return
    if not 0 <= config.node_rank < config.nnodes:
        raise LaunchError(
            f"--node-rank={config.node_rank} with --nnodes={config.nnodes}: node ranks count from 0, so use "
            f"0..{config.nnodes - 1}."
        )
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


def _check_endpoint(rendezvous: RendezvousSettings) -> None:
    try:
        socket.getaddrinfo(rendezvous.endpoint.host, None)
    except socket.gaierror as error:
        raise LaunchError(f"--rdzv-endpoint={str(rendezvous.endpoint)!r} does not resolve ({error}). Use the host "
                          "name or IP address of one of the job's nodes, the same on every node.") from None
    if not rendezvous.run_id:
        raise LaunchError("--rdzv-backend c10d needs --rdzv-id: a name for the job, the same on every node "
                          "(e.g. the scheduler's job id).")


def _check_script(run_as: str, script: str) -> None:
    """The script, module or program exists (a module's top package is looked up, not imported)."""
    if run_as == "module":
        top = script.split(".")[0]
        if not top or importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is None:
            raise LaunchError(f"module {script!r} was not found (looked for {top!r} in {os.getcwd()} and sys.path). "
                              "Check the name, or run from the folder that holds it.")
    elif run_as == "program":
        if shutil.which(script) is None:
            raise LaunchError(f"program {script!r} was not found or is not executable (looked in {os.getcwd()} and "
                              "PATH). Check the path and its execute permission, or leave out --no-python for a "
                              "python script.")
    elif not Path(script).is_file():
        raise LaunchError(f"script {script!r} does not exist (looked in {os.getcwd()}). Check the path.")


def _port_is_free(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError:
            return False
    return True


def rank_variables(config: LaunchConfig, port: int, local_rank: int, restart_count: int = 0) -> dict[str, str]:
    """What a worker of this node needs to find its place in the job: torch.distributed's
    variables, ddpkit's marker, the backend, and which start of the workers this is (0 the first).

    torchrun's per-worker variables come too, with torchrun's meanings, so that scripts and
    frameworks written for it (Lightning's ``TorchElasticEnvironment``, ``GROUP_RANK`` readers) find
    theirs. ``TORCHELASTIC_USE_AGENT_STORE`` is ``True`` where the launchers host the store
    (``_hosts_store``): torch's ``env://`` then connects to it as a client instead of making
    rank 0 serve one on the same port."""
    rank = str(config.node_rank * config.nproc_per_node + local_rank)
    variables = {
        "MASTER_ADDR": config.master_addr,
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(config.world_size),
        "RANK": rank,
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
        "NODE_RANK": str(config.node_rank),
        "GROUP_RANK": str(config.node_rank),
        "GROUP_WORLD_SIZE": str(config.nnodes),
        "ROLE_NAME": "default",
        "ROLE_RANK": rank,
        "ROLE_WORLD_SIZE": str(config.world_size),
        DDPKIT_LAUNCHED: "1",
        DDPKIT_RESTART_COUNT: str(restart_count),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
        "TORCHELASTIC_RUN_ID": config.rendezvous.run_id if config.rendezvous is not None else "none",
        "TORCHELASTIC_USE_AGENT_STORE": str(_hosts_store(config)),
        DDPKIT_PREEMPTION_SIGNAL: config.preemption_signal.name,
        DDPKIT_RECOVERY: config.recovery,
    }
    if _hosts_store(config):
        variables[DDPKIT_HOSTED_STORE] = "1"
    if config.backend:
        variables[DDPKIT_BACKEND] = config.backend
    return variables


def performance_defaults(nproc_per_node: int, base: Mapping[str, str]) -> dict[str, str]:
    """Environment variables that keep one node's workers from slowing each other down, each only
    where ``base`` (the user's environment) has not chosen already:

    - ``OMP_NUM_THREADS``: the cores this process may use, shared out among the workers (torchrun
      sets 1): workers that each use every core take turns on them (benchmarks/README.md).
    - glibc's malloc thresholds (Linux; see ``ddpkit._allocator``), unless any malloc setting is given.
    """
    defaults: dict[str, str] = {}
    if "OMP_NUM_THREADS" not in base:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        defaults["OMP_NUM_THREADS"] = str(max(1, cores // nproc_per_node))
    if sys.platform.startswith("linux") and not malloc_chosen(base):
        defaults.update(MALLOC_DEFAULTS)
    return defaults


def _gloo_interface(config: LaunchConfig, port: int, base: Mapping[str, str]) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` for the workers of a multi-node job, unless ``base`` (the user's
    environment) has it: the interface that routes to the master address (``ddpkit._network``
    says why Gloo's own choice fails across nodes). ddpkit's connection chooses the same; this is
    for scripts that connect with torch.distributed directly."""
    if config.nnodes < 2 or "GLOO_SOCKET_IFNAME" in base:
        return {}
    interface = gloo_interface_towards(config.master_addr, port)
    return {} if interface is None else {"GLOO_SOCKET_IFNAME": interface}


def _hosts_store(config: LaunchConfig) -> bool:
    """Whether the job's store is a launcher's rather than rank 0's: under in-place recovery, when
    the launchers of several nodes restart together (``launching.nodes``), and under a c10d
    rendezvous (the store at the endpoint)."""
    return config.recovery == IN_PLACE or config.rendezvous is not None or _coordinates_nodes(config)


def _coordinates_nodes(config: LaunchConfig) -> bool:
    """Whether the launchers of several nodes agree on the job's end (``launching.nodes``): when they
    restart together, and under a c10d rendezvous, where the launcher that hosts the store must
    outlive the others."""
    return config.nnodes > 1 and (config.max_restarts > 0 or config.rendezvous is not None)


def run_workers(script: str, script_args: Sequence[str], config: LaunchConfig, grace: float = 3.0,
                poll_interval: float = 0.05) -> int:
    """Run ``script`` on this node's workers until all succeed or one fails; return the exit code.

    After a failure the workers are started again, up to ``config.max_restarts`` times, each time
    meeting on a new port (unless ``master_port`` is given, or the launchers host the store, whose
    workers' keys are cleared instead); a stop signal is never retried, and ends every wait on the
    store (rendezvous, restart) within seconds.
    """
    validate(config, script)
    received: list[int] = []  # the stop and preemption signals, in order
    stack_requests: list[float] = []

    def note_signal(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)

    def request_stacks(_signum: int, _frame: FrameType | None) -> None:
        stack_requests.append(time.monotonic())

    defaults = performance_defaults(config.nproc_per_node, os.environ)
    if "OMP_NUM_THREADS" in defaults:
        _log.info(f"ddpkit run: OMP_NUM_THREADS={defaults['OMP_NUM_THREADS']} for each of this node's "
                  f"{config.nproc_per_node} workers (set it yourself to choose).")
    previous = {sig: signal.signal(sig, note_signal)
                for sig in {signal.SIGINT, signal.SIGTERM, config.preemption_signal}}
    if config.preemption_signal != signal.SIGUSR1:
        previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, request_stacks)
    signals = _Signals(received, stack_requests, config.preemption_signal)
    store_host: StoreHost | None = None
    nodes: NodeCoordination | None = None

    def stop_waiting() -> str | None:
        """Why a wait on the job's store ends early: a signal to the launcher, or its store host's end."""
        if received:
            return f"received {signal.Signals(received[0]).name}"
        return store_host.failure() if store_host is not None else None

    try:
        restart_count = 0
        if config.rendezvous is not None:
            try:
                config, store_host, nodes = _join_rendezvous(config, config.rendezvous, {**defaults, **os.environ},
                                                             stop_waiting)
            except RendezvousError as error:
                _log.error(f"ddpkit run: {error}")
                return 1
        # A store the launchers host keeps one port for the whole run (attempts and generations have prefixes).
        port = config.master_port if config.master_port is not None else find_free_port(config.master_addr)
        defaults.update(_gloo_interface(config, port, os.environ))
        if _hosts_store(config) and config.node_rank == 0 and config.rendezvous is None:
            store_host = StoreHost(config.master_addr, port, {**defaults, **os.environ})
        output = config.output.with_log_dir()
        command = worker_command(config.run_as, script, script_args)
        while True:
            if not _hosts_store(config) and restart_count and config.master_port is None:
                port = find_free_port(config.master_addr)
            log_folder = output.attempt_folder(config.node_rank, restart_count) if output.writes_files() else None
            if log_folder is not None:
                shutil.rmtree(log_folder, ignore_errors=True)  # a former run's logs of this attempt, replaced
            workers = WorkerProcesses("run", None if output.is_default() else output, log_folder)
            try:
                for local_rank in range(config.nproc_per_node):
                    variables = rank_variables(config, port, local_rank, restart_count)
                    if config.recovery == IN_PLACE:
                        variables[DDPKIT_READY_FILE] = ready_file(workers.folder, 0, int(variables["RANK"]))
                    workers.start(command, {**defaults, **os.environ, **variables}, int(variables["RANK"]), local_rank)
                replacements = None
                if config.recovery == IN_PLACE:
                    replacements = Replacements(
                        workers, [*command[:3], SPARE, *command[3:]], {**defaults, **os.environ},
                        functools.partial(rank_variables, config, port, restart_count=restart_count),
                        budget=config.max_restarts - restart_count)
                if _coordinates_nodes(config) and nodes is None:
                    nodes = _connect_nodes(config, port, workers, stop_waiting)
                outcome = _watch(workers, signals, grace, poll_interval, replacements, nodes, store_host)
                if nodes is not None:
                    outcome = _agree_across_nodes(nodes, outcome, grace)
            except NodeContactLostError as error:
                _log.error(f"ddpkit run: {error}\nddpkit run: all {config.nproc_per_node} workers of node "
                           f"{config.node_rank} were stopped.")
                return 1
            except GaveUpWaiting as stopped:  # waiting for the other nodes' workers to finish too
                return _gave_up(stopped, received, "the other nodes were not waited for", nodes)
            finally:
                workers.close(grace)
            if replacements is not None:
                restart_count += replacements.used  # replacements spend the same budget
            if outcome.cause is None:  # success, preempted, or stopped by a signal
                return outcome.code
            count = config.nproc_per_node
            these = f"all {count} workers" + (f" of node {config.node_rank}" if config.nnodes > 1 else "")
            print(f"ddpkit run: {outcome.cause}\nddpkit run: {these} were stopped.", file=sys.stderr, flush=True)
            if outcome.stopped_elsewhere:
                _log.error("ddpkit run: no restart after a stop signal on another node: ending the job.")
                return outcome.code
            store_gone = store_host is not None and store_host.failure() is not None
            if restart_count >= config.max_restarts or received or store_gone:
                if config.max_restarts:
                    why = ("after a stop signal" if received else "without the job's store" if store_gone else
                           f"left (--max-restarts={config.max_restarts})")
                    _log.error(f"ddpkit run: no restart {why}: ending the job.")
                return outcome.code
            restart_count += 1
            try:
                _open_next_attempt(nodes, store_host, restart_count)
            except GaveUpWaiting as stopped:
                return _gave_up(stopped, received, "no restart", nodes)
            except (TimeoutError, NodeContactLostError, StoreHostError) as error:
                _log.error(f"ddpkit run: {error}")
                return outcome.code
            _log.warning(f"ddpkit run: restarting {these} (restart {restart_count} of "
                         f"{config.max_restarts}); {DDPKIT_RESTART_COUNT}={restart_count}")
    except GaveUpWaiting as stopped:  # in the rendezvous: no worker started yet
        return _gave_up(stopped, received, "no worker was started")
    finally:
        if nodes is not None:
            # After a stop signal here the others only need a moment to read it (announced at once).
            nodes.leave(wait_seconds=_LEAVE_AFTER_SIGNAL_SECONDS if received else grace + 5.0)
        if store_host is not None:
            store_host.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _gave_up(stopped: GaveUpWaiting, received: Sequence[int], consequence: str,
             nodes: NodeCoordination | None = None) -> int:
    """The exit code after a wait on the job's store was given up, said on stderr (and, after a
    signal, to the other nodes' launchers: none restarts): 128 + the signal that asked the
    launcher to stop, else 1 (the store host ended)."""
    if received:
        _log.warning(f"ddpkit run: {stopped.reason} while waiting on the job's store: stopping ({consequence}).")
        if nodes is not None:
            with contextlib.suppress(NodeContactLostError):
                nodes.announce_stop(stopped.reason)
        return 128 + received[0]
    _log.error(f"ddpkit run: {stopped.reason}\nddpkit run: {consequence}.")
    return 1


def _open_next_attempt(nodes: NodeCoordination | None, store_host: StoreHost | None, attempt: int) -> None:
    """Before the workers start again: every node's launcher meets the others (``launching.nodes``),
    and the store the launchers host forgets the workers' keys of the attempts before."""
    if nodes is not None:
        nodes.meet(attempt, recovery_timeout_seconds(),
                   open_attempt=None if store_host is None else store_host.clear_worker_keys)
    elif store_host is not None:
        store_host.clear_worker_keys()


def _connect_nodes(config: LaunchConfig, port: int, workers: WorkerProcesses,
                   stop_waiting: GiveUp) -> NodeCoordination | None:
    """This launcher's part in the agreement between the nodes (``launching.nodes``), connected
    after its workers started, so that the import of torch's store client overlaps theirs.

    None when it stopped waiting for the store because a signal came (``_watch`` passes it on to
    the workers) or every worker here ended meanwhile (their end is this node's outcome); a
    failure of a worker meanwhile is ``NodeContactLostError``."""
    try:
        return NodeCoordination.connect(config.master_addr, port, config.node_rank, config.nnodes,
                                        functools.partial(_failure_of, workers),
                                        lambda: None not in workers.exit_codes(), stop_waiting)
    except GaveUpWaiting as stopped:
        _log.warning(f"ddpkit run: node {config.node_rank}'s launcher stopped waiting for the job's store at "
                     f"{config.master_addr}:{port} ({stopped.reason}); the other nodes' launchers are not told how "
                     "this node's workers end.")
        return None


def worker_command(run_as: str, script: str, script_args: Sequence[str]) -> list[str]:
    """The command line of each worker: ddpkit's bootstrap running the script (or module), or the program itself."""
    if run_as == "program":
        return [script, *script_args]
    return [sys.executable, "-m", "ddpkit.launching.worker", *(["-m"] if run_as == "module" else []), script,
            *script_args]


def _join_rendezvous(config: LaunchConfig, rendezvous: RendezvousSettings, environment: Mapping[str, str],
                     stop_waiting: GiveUp) -> tuple[LaunchConfig, StoreHost | None, NodeCoordination | None]:
    """Meet the other nodes' launchers at the endpoint (hosting its store when it is this host's):
    the job as a static one with this node's rank, the store host if this launcher runs it, and
    the agreement between the launchers (several nodes). ``stop_waiting`` (and the store host's
    end) end the wait with ``GaveUpWaiting``."""
    endpoint = rendezvous.endpoint
    listener = claim_endpoint(endpoint)
    store_host = None
    if listener is not None:
        store_host = StoreHost(endpoint.host, endpoint.port, environment, listener.fileno())
        listener.close()  # the store host holds its own copy

    def stop_or_store_host_gone() -> str | None:
        return stop_waiting() or (store_host.failure() if store_host is not None else None)

    try:
        node_rank, store = join(endpoint, rendezvous.run_id, config.nnodes, rendezvous.join_timeout,
                                stop_or_store_host_gone)
    except BaseException:
        if store_host is not None:
            store_host.stop()
        raise
    config = dataclasses.replace(config, node_rank=node_rank, master_addr=endpoint.host, master_port=endpoint.port)
    nodes = None
    if _coordinates_nodes(config):
        nodes = NodeCoordination(store, node_rank, config.nnodes, endpoint.host, endpoint.port,
                                 hosts_store=store_host is not None, give_up=stop_or_store_host_gone)
    return config, store_host, nodes


@dataclass
class _Signals:
    """What the launcher's signal handlers noted, for ``_watch``."""

    received: list[int]  # SIGINT, SIGTERM and the preemption signal, in the order they came
    stack_requests: list[float]  # SIGUSR1 (when it is not the preemption signal)
    preemption_signal: signal.Signals

    def preemption(self) -> int | None:
        """The signal that asked for a preemption, when the first one received did."""
        first = self.received[0] if self.received else None
        return first if first in (signal.SIGTERM, self.preemption_signal) else None

    def stop(self) -> int | None:
        """The signal that asks to stop at once: SIGINT, or any signal after a preemption's."""
        if not self.received:
            return None
        if self.preemption() is None:
            return self.received[0]
        return self.received[1] if len(self.received) > 1 else None


@dataclass(frozen=True)
class _Outcome:
    """How one start of this node's workers ended (``_watch``)."""

    code: int  # the launcher's exit code if nothing is restarted
    cause: str | None = None  # the root cause of a failure; None: success, preempted, or stopped by a signal
    recorded_at: float | None = None  # when the root cause's exception was recorded (None: no record)
    elsewhere: bool = False  # another node's launcher ended this attempt (``launching.nodes``)
    stopped_elsewhere: bool = False  # another node's launcher was stopped by a signal: nothing is restarted


def _watch(workers: WorkerProcesses, signals: _Signals, grace: float, poll_interval: float,
           replacements: Replacements | None = None, nodes: NodeCoordination | None = None,
           store_host: StoreHost | None = None) -> _Outcome:
    """Poll the workers until all succeed (0), all saved and stopped after a preemption (75), a stop
    signal comes (128 + its number) or one fails (1, and the description of the root cause,
    after every worker was stopped). With ``replacements`` (in-place recovery), a worker that can
    be replaced is, and the watch goes on. With ``nodes``, a failure or stop signal here is
    announced to the other nodes' launchers before the workers are ended, and one announced by
    them ends this node's workers (1). A ``store_host`` that ends fails the job at once (1)."""
    count = len(workers.workers)
    preemption: int | None = None
    while True:
        if signals.stack_requests:
            signals.stack_requests.clear()
            _print_stacks(workers)
        stop = signals.stop()
        if stop is not None:
            _log.warning(f"ddpkit run: received {signal.Signals(stop).name}, stopping all {count} workers")
            if nodes is not None:
                nodes.announce_stop(f"received {signal.Signals(stop).name}")
            # After a preemption the workers had their SIGTERM: asked again, they are killed at once.
            workers.end(grace if preemption is None else 0.0)
            return _Outcome(128 + stop)
        if preemption is None and (preemption := signals.preemption()) is not None:
            _log.warning(f"ddpkit run: received {signal.Signals(preemption).name}: asking all {count} workers to "
                         "save and stop (preemption); a second signal stops them at once")
            workers.notify(signal.SIGTERM)
        # After a preemption SIGTERM ends a script that does not handle it: a stop, not a failure.
        also_fine = (-signal.SIGTERM,) if preemption else ()
        failed = workers.failed(also_fine)
        if failed and preemption is None and replacements is not None:
            # Ranks killed together (a node's processes, the out-of-memory killer) are reaped a
            # moment apart: replaced together, or a later one would fail the recovery under way.
            time.sleep(_LOSSES_SETTLE_SECONDS)
            failed = workers.failed(also_fine)
            if replacements.replace(failed):
                continue
        if not failed and nodes is not None and nodes.ended_elsewhere():
            # A worker here killed at the same moment may not have been reaped yet when its peers on
            # other nodes noticed: its own failure, not theirs, is then the root cause.
            failed = _failures_within(workers, _SETTLE_SECONDS, poll_interval, also_fine)
            if not failed:
                workers.end(grace)
                return _Outcome(1, "another node's launcher ended the workers", elsewhere=True)
        if failed:
            if nodes is not None:
                nodes.announce_failure()  # the other nodes end their workers meanwhile
            # Only failures seen at this first poll can be the cause; later ones follow from the shutdown.
            recovering = replacements.recovering() if replacements is not None else ""
            workers.end(grace)
            cause, recorded_at = workers.root_cause_summary(failed)
            return _Outcome(1, f"during the in-place recovery of rank {recovering}: {cause}" if recovering else cause,
                            recorded_at)
        problem = replacements.check() if replacements is not None else None
        if problem is None and store_host is not None:
            problem = store_host.failure()
        if problem is not None:
            workers.end(grace)
            return _Outcome(1, problem)
        codes = workers.exit_codes()
        if preemption is not None and -signal.SIGTERM in codes:
            _log.warning(f"ddpkit run: a worker ended on SIGTERM without saving (its script does not call "
                         f"DDPStrategy.preempted()); stopping all {count} workers")
            workers.end(grace)
            return _Outcome(128 + preemption)
        if None not in codes:
            if PREEMPTED_EXIT_CODE not in codes:
                return _Outcome(0)
            _log.warning(f"ddpkit run: preempted: all {count} workers saved and stopped (exit code "
                         f"{PREEMPTED_EXIT_CODE}); run the same command again to resume")
            return _Outcome(PREEMPTED_EXIT_CODE)
        time.sleep(poll_interval)


# How long the launcher that hosts the store keeps it for the others after it was told to stop.
_LEAVE_AFTER_SIGNAL_SECONDS = 2.0
# How long a launcher told that another node's workers failed still looks for a failure of its own.
_SETTLE_SECONDS = 0.5
# How long after a worker is lost the launcher looks for others lost with it (in-place recovery).
_LOSSES_SETTLE_SECONDS = 0.1


def _failure_of(workers: WorkerProcesses) -> str | None:
    """The root cause of this node's failed workers, or None while none failed."""
    failed = workers.failed()
    return workers.describe_root_cause(failed) if failed else None


def _failures_within(workers: WorkerProcesses, seconds: float, poll_interval: float,
                     also_fine: Sequence[int]) -> list[WorkerProcess]:
    deadline = time.monotonic() + seconds
    while not (failed := workers.failed(also_fine)) and time.monotonic() < deadline:
        time.sleep(poll_interval)
    return failed


def _agree_across_nodes(nodes: NodeCoordination, outcome: _Outcome, grace: float) -> _Outcome:
    """Turn this node's outcome into the job's (``launching.nodes``): workers that succeeded wait
    for the other nodes' (whose failure is this attempt's failure too); after a failure every
    launcher names the same root cause, the likeliest of those the nodes published."""
    if outcome.code == 0 and outcome.cause is None:
        try:
            if nodes.finish():
                return outcome
        except NodeContactLostError as error:  # workers that all finished are a finished job
            _log.warning(f"ddpkit run: every worker of node {nodes.node_rank} finished; whether the other nodes' did "
                         f"too cannot be known: {error}")
            return outcome
    own = outcome.cause if not outcome.elsewhere else None  # None: ended because of another node, or a signal
    nodes.publish_cause(None if own is None else FailureCause(nodes.node_rank, own, outcome.recorded_at))
    if outcome.cause is None and outcome.code != 0:
        return outcome  # preempted, or stopped by a signal here: nothing to agree on
    stopped = nodes.stop_reason()
    # Every launcher publishes once its workers have ended (``grace``); one that vanished never does.
    cause = nodes.root_cause(wait_seconds=grace + 5.0)
    if cause is not None:
        text = cause.text if cause.node == nodes.node_rank else f"on node {cause.node}: {cause.text}"
    else:
        text = f"the job was stopped: {stopped}" if stopped else "another node's workers failed (its output says why)"
    return _Outcome(1, text, stopped_elsewhere=stopped is not None)


def _print_stacks(workers: WorkerProcesses) -> None:
    """Print every running worker's Python stacks, rank by rank (SIGUSR1 to the launcher)."""
    stacks = workers.stacks()
    print(f"ddpkit run: Python stacks of {len(stacks)} running workers (SIGUSR1)", file=sys.stderr)
    for worker, written in stacks:
        print(f"=== {worker} ===\n{written}", file=sys.stderr)
    sys.stderr.flush()
