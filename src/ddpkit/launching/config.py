"""What ``ddpkit run`` was asked to do on this node (``LaunchConfig``), and the checks that refuse
bad input before any process starts (``validate``), naming the flag, its value and the fix.

torch-free, as the launcher is.
"""

from __future__ import annotations

import enum
import importlib.machinery
import os
import shutil
import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ddpkit.diagnostics.settings import check_worker_seconds_settings, recovery_timeout_seconds
from ddpkit.environments import Recovery, RecoveryPolicy
from ddpkit.launching.rendezvous import RendezvousSettings, StoreWaits
from ddpkit.store.job_secret import JobSecretError, job_secret
from ddpkit.variables import DDPKIT_NCCL_IN_PLACE
from ddpkit.workers.output import OutputPlan

__all__ = ["LaunchConfig", "LaunchError", "RunAs", "validate"]


class RunAs(enum.Enum):
    """How each worker runs the script (torchrun's ``-m`` and ``--no-python``)."""

    SCRIPT = "script"  # python script.py, through ddpkit's worker bootstrap
    MODULE = "module"  # python -m module, through the bootstrap
    PROGRAM = "program"  # the program itself, without python (so without the bootstrap)


class LaunchError(ValueError):
    """Bad launch arguments, found before anything started."""


@dataclass(frozen=True)
class LaunchConfig:
    """Where this node's workers sit in the job, how they run the script and where their output goes."""

    nproc_per_node: int
    nnodes: int = 1  # with ``max_nodes``, the least (MIN of torchrun's MIN:MAX); after a rendezvous, the world's
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (single node only)
    backend: str | None = None
    max_restarts: int = 0  # times the workers are started again after a failure (torchrun's flag)
    preemption_signal: signal.Signals = signal.SIGTERM  # besides SIGTERM: asks the workers to save and stop
    recovery: Recovery = Recovery.FAIL_FAST  # IN_PLACE: a killed worker is replaced while the others go on
    run_as: RunAs = RunAs.SCRIPT
    output: OutputPlan = field(default_factory=OutputPlan)  # default: the launcher's own streams
    # torchrun's c10d rendezvous (``launching.rendezvous``): the node rank comes from it, and the
    # master address and port are the endpoint's. None: static (``node_rank``, ``master_*``).
    rendezvous: RendezvousSettings | None = None
    # How long the launchers of several nodes wait for one another to reach the job's store, and
    # for one answer from it (torchrun's ``--rdzv-conf join_timeout`` and ``read_timeout``, also
    # read for static nodes): a node not heard from by then, or a store that does not answer, ends
    # the others' wait (``control_plane.nodes``).
    store_waits: StoreWaits = field(default_factory=StoreWaits)
    # ``--nnodes MIN:MAX``'s MAX (None: a fixed number): the rendezvous may close with up to MAX
    # nodes, and launchers beyond the world wait as spare nodes (``launching.rendezvous``).
    max_nodes: int | None = None
    # MIN once the rendezvous closed (``nnodes`` is then the world's): the workers are told it, since
    # a world of more nodes may shrink to it when a node is lost and no spare takes its place.
    min_nodes: int | None = None
    # The job's health (``health.job_health``): a line every ``report_every`` seconds (0: none), each
    # window appended to the file ``metrics`` (None: none), and the factor that names a straggler.
    report_every: float = 60.0
    metrics: str | None = None
    straggler_factor: float = 1.2
    # ``--stragglers replace``: node 0's launcher asks a straggler's node to step aside for a spare
    # node (``health.straggler_replacement``); otherwise (``name``) stragglers are named only.
    replace_stragglers: bool = False
    role: str = "default"  # the workers' ROLE_NAME (torchrun's --role)

    @property
    def window_seconds(self) -> float | None:
        """The length of the workers' step windows (``diagnostics.step_windows``); None: none asked for."""
        if self.report_every > 0:
            return self.report_every
        return 60.0 if self.metrics is not None else None

    @property
    def survivors_go_on(self) -> bool:
        """Whether the workers that survive a loss keep their processes (``RecoveryPolicy``)."""
        return RecoveryPolicy(self.recovery).survivors_go_on

    def recovery_policy(self, restart_count: int, generation: int = 0) -> RecoveryPolicy:
        """What the workers of start ``restart_count`` (joining ``generation`` of the group) are told."""
        return RecoveryPolicy(self.recovery, restart_count, generation, self.min_nodes)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def hosts_store(self) -> bool:
        """Whether the job's store is a launcher's rather than rank 0's: under in-place recovery,
        when the launchers of several nodes restart together (``control_plane.nodes``), and under a
        c10d rendezvous (the store at the endpoint)."""
        return self.survivors_go_on or self.rendezvous is not None or self.coordinates_nodes

    @property
    def coordinates_nodes(self) -> bool:
        """Whether the launchers of several nodes agree on the job's end (``control_plane.nodes``): when
        they restart together, and under a c10d rendezvous, where the launcher that hosts the
        store must outlive the others."""
        several = self.nnodes > 1 or self.max_nodes is not None  # spare nodes wait beside one node too
        return several and (self.max_restarts > 0 or self.rendezvous is not None)


def validate(config: LaunchConfig, script: str) -> None:
    """Refuse bad input before any process starts, naming the flag, its value and the fix."""
    _check_counts(config)
    _check_node_range(config)
    if config.recovery is Recovery.IN_PLACE:
        _check_in_place(config)
    if config.replace_stragglers:
        _check_replace_stragglers(config)
    try:
        check_worker_seconds_settings()
        job_secret()
    except (ValueError, JobSecretError) as error:
        raise LaunchError(str(error)) from None
    _check_script(config.run_as, script)
    if config.run_as is RunAs.PROGRAM and config.recovery is Recovery.IN_PLACE:
        raise LaunchError("--recovery in-place with --no-python: a warm spare runs ddpkit's worker bootstrap, in "
                          "python. Run a python script (or -m module), or use --max-restarts without in-place recovery.")
    if config.rendezvous is not None:  # the node rank, address and port come from the rendezvous
        _check_endpoint(config.rendezvous)
    else:
        _check_static_place(config)


def _check_counts(config: LaunchConfig) -> None:
    if config.nproc_per_node < 1:
        raise LaunchError(f"--nproc-per-node={config.nproc_per_node}: need at least 1 process per node.")
    if config.nnodes < 1:
        raise LaunchError(f"--nnodes={config.nnodes}: need at least 1 node.")
    if config.max_restarts < 0:
        raise LaunchError(f"--max-restarts={config.max_restarts}: give 0 (no restart) or more.")


def _check_node_range(config: LaunchConfig) -> None:
    """``--nnodes MIN:MAX`` needs a c10d rendezvous and in-place recovery."""
    if config.max_nodes is None:
        return
    given = f"--nnodes={config.nnodes}:{config.max_nodes}"
    if not 1 <= config.nnodes < config.max_nodes:
        raise LaunchError(f"{given}: MIN:MAX needs 1 <= MIN < MAX (e.g. --nnodes 2:3).")
    if config.rendezvous is None or config.recovery is not Recovery.IN_PLACE:
        raise LaunchError(
            f"{given}: a range of node counts needs --rdzv-backend c10d (nodes get their rank as they arrive, and "
            "launchers beyond the world wait as spare nodes) and --recovery in-place (a spare node takes a lost "
            "node's ranks while the others go on). Otherwise give one number, e.g. --nnodes "
            f"{config.max_nodes}, and --max-restarts for failures.")


def _check_in_place(config: LaunchConfig) -> None:
    if config.nnodes > 1 and config.rendezvous is None:
        raise LaunchError(
            f"--recovery in-place with --nnodes={config.nnodes} and static node ranks: across nodes in-place recovery "
            "needs --rdzv-backend c10d (a spare node takes a lost node's rank at the rendezvous). Use c10d, or "
            "--recovery fail-fast (the default) with --max-restarts: every node's workers restart together."
        )
    if config.max_restarts < 1:
        raise LaunchError(f"--recovery in-place with --max-restarts={config.max_restarts}: each replacement of a "
                          "lost rank counts against --max-restarts; give --max-restarts 1 or more.")
    try:
        recovery_timeout_seconds()
    except ValueError as error:
        raise LaunchError(str(error)) from None
    if config.backend == "nccl" and os.environ.get(DDPKIT_NCCL_IN_PLACE, "") != "1":
        raise LaunchError(
            f"--recovery in-place with --backend nccl is off until it has run on GPUs ({DDPKIT_NCCL_IN_PLACE}="
            f"{os.environ.get(DDPKIT_NCCL_IN_PLACE, '')!r}): the survivors' NCCL communicators are aborted and the "
            "next generation's formed as torch documents, but that path has run on CPUs only. Set "
            f"{DDPKIT_NCCL_IN_PLACE}=1 to use it (benchmarks/gpu_check.py checks it on a machine with two GPUs), or "
            "use --backend gloo, or --recovery fail-fast with --max-restarts.")


def _check_replace_stragglers(config: LaunchConfig) -> None:
    """``--stragglers replace`` hands a node to a spare node in place, and needs the windows that name it."""
    one_node = config.nnodes == 1 and config.max_nodes is None  # (stragglers are named only: the launcher says so)
    if config.recovery is not Recovery.IN_PLACE and not one_node:
        raise LaunchError(
            f"--stragglers replace with --recovery {config.recovery.value}: a straggling node is handed to a spare "
            "node while the others' workers go on, which is in-place recovery. Add --recovery in-place (with "
            "--nnodes MIN:MAX --rdzv-backend c10d and a spare node), or use --stragglers name.")
    if config.window_seconds is None:
        raise LaunchError(
            f"--stragglers replace with --report-every {config.report_every:g} and no --metrics: stragglers are "
            "named from the ranks' step windows, which neither asks for. Give --report-every S (e.g. 60) or "
            "--metrics FILE.")


def _check_static_place(config: LaunchConfig) -> None:
    """Static node ranks: the node rank, the master's address and its port."""
    if not 0 <= config.node_rank < config.nnodes:
        raise LaunchError(
            f"--node-rank={config.node_rank} with --nnodes={config.nnodes}: node ranks count from 0, so use "
            f"0..{config.nnodes - 1}."
        )
    try:
        socket.getaddrinfo(config.master_addr, None)
    except (socket.gaierror, UnicodeError) as error:
        raise LaunchError(
            f"--master-addr={config.master_addr!r} does not resolve ({error}). Use the host name or IP address "
            "of the node with --node-rank=0."
        ) from None
    if config.master_port is None:
        if config.nnodes > 1:
            raise LaunchError("--master-port is required with --nnodes > 1: every node must use the same port.")
        if not _port_is_free(config.master_addr, 0):
            raise LaunchError(f"--master-addr={config.master_addr!r} is not an address of this machine: on one node the "
                              "workers meet at one of its addresses (127.0.0.1 by default). Leave --master-addr out, or "
                              "give an address of this machine.")
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
    except (socket.gaierror, UnicodeError) as error:
        raise LaunchError(f"--rdzv-endpoint={str(rendezvous.endpoint)!r} does not resolve ({error}). Use the host "
                          "name or IP address of one of the job's nodes, the same on every node.") from None
    if not rendezvous.run_id:
        raise LaunchError("--rdzv-backend c10d needs --rdzv-id: a name for the job, the same on every node "
                          "(e.g. the scheduler's job id).")


def _check_script(run_as: RunAs, script: str) -> None:
    """The script, module or program exists (a module's top package is looked up, not imported)."""
    if run_as is RunAs.MODULE:
        top = script.split(".")[0]
        if not top or importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is None:
            raise LaunchError(f"module {script!r} was not found (looked for {top!r} in {os.getcwd()} and sys.path). "
                              "Check the name, or run from the folder that holds it.")
    elif run_as is RunAs.PROGRAM:
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
