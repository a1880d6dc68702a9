"""Connecting this process to the others: the default process group, from a cluster environment.

``init_dist_connection`` exports what ``torch.distributed`` reads (MASTER_ADDR, MASTER_PORT,
WORLD_SIZE, RANK), picks Gloo's network interface (``ddpkit._network``) and initialises the
group; ``destroy_dist_connection`` tears it down without the exit-time abort of torch 2.13 +
Gloo. ``get_rank``/``get_world_size`` answer 0/1 when not distributed, so the same code runs in
one process and in many.

Under in-place recovery (``ddpkit run --recovery in-place``), and when the launchers of several
nodes restart together, the store is not rank 0's: the launcher hosts it
(``launching/store_host.py``), so it outlives any rank, and each attempt and each generation of
the group keeps its keys under a prefix of its own. Each connection makes a ``ddpkit.membership.group.Group``
(``current_group()``), which owns that store, the membership and its changes
(``Group.reconfigure``), and starts the diagnostics that follow the group.

With a job secret (``ddpkit.store.job_secret``; ``ddpkit run`` on one node makes one), the group's
members prove it to each other as the group forms, and ddpkit's records in the store are signed.
A multi-process job without one runs as before, and rank 0 says so once.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch._dynamo  # noqa: F401  (imported before any process group exists; see below)
import torch.distributed as dist

from ddpkit._network import gloo_interface_towards, listen_on, store_bind_address
from ddpkit.diagnostics.waits import run_collective
from ddpkit.environments import (
    ClusterEnvironment,
    LaunchContract,
    SLURMEnvironment,
    check_place,
    launch_contract,
)
from ddpkit.logs import get_logger
from ddpkit.membership.group import Group, Membership, current_group, set_current_group
from ddpkit.store import keys as store_keys
from ddpkit.store.job_secret import job_secret
from ddpkit.variables import DDPKIT_BACKEND, DDPKIT_JOB_SECRET, DDPKIT_LAUNCHED

__all__ = [
    "DEFAULT_TIMEOUT",
    "destroy_dist_connection",
    "distributed_available",
    "get_rank",
    "get_world_size",
    "init_dist_connection",
]

_log = get_logger("connection")

#: Process-group timeout when the caller gives none. torch's 30 minutes leaves a job stuck for
#: half an hour when one rank dies; 10 minutes still covers a slow checkpoint on rank 0 while
#: the others wait in a barrier.
DEFAULT_TIMEOUT = timedelta(minutes=10)

ProcessGroup = Any  # torch.distributed.ProcessGroup, or None for the default group

# torch._dynamo is imported above, before init_dist_connection can create a group: imported
# later (by torch.compile, the first optimizer step, or the DDP module), it keeps a reference to
# the group that exists then, and destroy_process_group() after a rank's failure (ddpkit's
# guard) no longer frees the peers blocked in a collective; they wait for the group's timeout.


def init_dist_connection(
    cluster_environment: ClusterEnvironment,
    torch_distributed_backend: str | None = None,
    global_rank: int | None = None,
    world_size: int | None = None,
    **kwargs: Any,
) -> None:
    """Export MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK from ``cluster_environment`` and initialise
    the default process group.

    ``torch_distributed_backend`` (or ``backend``, torch's name for it) defaults to the launcher's
    (``ddpkit run --backend``), else ``"nccl"`` when CUDA is available, ``"gloo"`` otherwise.
    ``global_rank``/``world_size`` override the environment's. ``kwargs`` go to ``torch.distributed.init_process_group``;
    ``timeout`` defaults to ``DEFAULT_TIMEOUT`` and may also be given in seconds. With world size 1
    no network is used (an in-memory store).

    If a process group already exists and agrees with the environment this does nothing; if
    it disagrees, ``RuntimeError`` says which values differ.

    Example::

        >>> import ddpkit
        >>> ddpkit.init_dist_connection(ddpkit.detect_environment())  # the launcher's or scheduler's place
        >>> ddpkit.get_rank(), ddpkit.get_world_size()
        (0, 1)
        >>> ddpkit.destroy_dist_connection()
    """
    _require_distributed()
    torch_distributed_backend = _backend_argument(torch_distributed_backend, kwargs)
    rank = cluster_environment.global_rank() if global_rank is None else global_rank
    size = cluster_environment.world_size() if world_size is None else world_size
    if global_rank is not None or world_size is not None:  # the environment checked its own values
        check_place({"rank": "global_rank", "world": "world_size"}, {"rank": rank, "world": size},
                    "Check the values passed to init_dist_connection.")
    contract = launch_contract(cluster_environment)
    backend = _backend(contract, torch_distributed_backend)
    if dist.is_initialized():
        _check_existing_group(rank, size, torch_distributed_backend)
        return
    secret = job_secret()  # a malformed one is refused here, before anything connects
    _export_place(cluster_environment, rank, size, backend)
    timeout = _as_timedelta(kwargs.pop("timeout", DEFAULT_TIMEOUT))
    if size == 1:
        _warn_if_slurm_expected_more()
    store_given = "init_method" in kwargs or "store" in kwargs
    if size == 1 and not store_given:
        kwargs["store"] = dist.HashStore()  # type: ignore[attr-defined]  # one process: nothing to meet, no port to open
    launcher_store = _launchers_store(cluster_environment, contract, timeout) if size > 1 and not store_given else None
    survivors_go_on = launcher_store is not None and contract.recovery.survivors_go_on
    generation = contract.generation if survivors_go_on else 0
    group = Group(Membership(generation, rank, size), backend, timeout, launcher_store, contract.attempt, survivors_go_on,
                  secret)
    if survivors_go_on:  # the first generation, a replacement's (its place from the layout), or the next one
        set_current_group(group)
        group.form(generation, **kwargs)
        return
    if launcher_store is not None:
        kwargs["store"] = group.store_of(generation)
    elif size > 1 and not store_given:
        store = _job_store(cluster_environment, contract, rank, size, timeout)
        if store is not None:
            kwargs["store"] = group.signed(store)
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout, **kwargs)
    set_current_group(group)
    group.prove_members()  # before anything (a model's state) is sent to a member
    group.install_diagnostics()  # e.g. with hang diagnosis on, every rank can answer for its stack from the start
    if secret is None and size > 1 and rank == 0:
        _say_unauthenticated()


def _backend_argument(torch_distributed_backend: str | None, kwargs: dict[str, Any]) -> str | None:
    """The backend asked for: ``torch_distributed_backend`` (Lightning's name), or ``backend``
    (``init_process_group``'s, which a torch user writes), taken out of ``kwargs``; both, different:
    ``ValueError``."""
    backend = kwargs.pop("backend", None)
    if backend is not None and torch_distributed_backend is not None and backend != torch_distributed_backend:
        raise ValueError(f"init_dist_connection was given backend={backend!r} and torch_distributed_backend="
                         f"{torch_distributed_backend!r}: they name the same setting. Give one of them.")
    return torch_distributed_backend if torch_distributed_backend is not None else backend


def _launchers_store(environment: ClusterEnvironment, contract: LaunchContract,
                     timeout: timedelta) -> Any:
    """A client of the store ``ddpkit run`` hosts (it outlives any rank and any attempt; each attempt
    and each generation of the group has its own keys); None when the launcher hosts no store."""
    if not contract.hosted_store:
        return None
    return dist.TCPStore(  # type: ignore[attr-defined]
        environment.main_address, environment.main_port, is_master=False, timeout=timeout)


def _require_distributed() -> None:
    if not dist.is_available():
        raise RuntimeError(
            "torch.distributed is not available in this build of PyTorch, so ddpkit cannot connect "
            "processes. Install a build with distributed support, e.g. `pip install torch==2.13.0`."
        )


def _as_timedelta(timeout: timedelta | float) -> timedelta:
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))


def _backend(contract: LaunchContract, given: str | None) -> str:
    """``given``, else the launcher's (``ddpkit run --backend``), else NCCL with CUDA and Gloo without;
    NCCL without CUDA is refused, naming where it came from."""
    backend = given or contract.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        source = ("torch_distributed_backend='nccl'" if given else
                  f"Backend 'nccl' ({DDPKIT_BACKEND}, from `ddpkit run --backend`)")
        raise ValueError(f"{source} needs CUDA GPUs, and none is available to this process. Use 'gloo' on CPU.")
    return backend


def _export_place(environment: ClusterEnvironment, rank: int, size: int, backend: str) -> None:
    """MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK as torch's ``env://`` reads them, and Gloo's
    interface towards the main address across nodes."""
    if size > 1 and environment.main_port == 0:
        raise ValueError(
            f"No port to meet on: {type(environment).__name__} has no main port (MASTER_PORT is not set), "
            f"and the {size} processes of the job must all connect to one. Set MASTER_PORT to the same free port "
            "for every process, or start them with `ddpkit run`, which chooses one."
        )
    if environment.main_port:  # 0: one process, which meets no one (no port chosen, none exported)
        os.environ["MASTER_ADDR"] = environment.main_address
        os.environ["MASTER_PORT"] = str(environment.main_port)
    os.environ["WORLD_SIZE"] = str(size)
    os.environ["RANK"] = str(rank)
    if backend == "gloo" and size > 1 and not os.environ.get("GLOO_SOCKET_IFNAME"):
        # Gloo's default address is often a loopback one across nodes; see ddpkit._network.
        interface = gloo_interface_towards(environment.main_address, environment.main_port)
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface


def _job_store(environment: ClusterEnvironment, contract: LaunchContract, rank: int, size: int,
               timeout: timedelta) -> Any:
    """The store the ranks meet in when neither a launcher's nor the caller's is given: under
    torchrun's static rendezvous its store with keys of this attempt's own, under torchrun's agent
    store None (torch's ``env://`` connects to it), else rank 0's."""
    if contract.torchrun_store_attempt is not None:
        # torchrun's static rendezvous creates its store once and hands it to every attempt, and
        # torch's env:// keeps no keys per attempt: after --max-restarts started the workers again,
        # a rank could read a peer's address from the attempt before and fail to connect. Each
        # attempt gets keys of its own (pytorch#135712 is the same flaw with the c10d
        # rendezvous's shared store).
        store = dist.TCPStore(  # type: ignore[attr-defined]
            environment.main_address, environment.main_port, is_master=False, timeout=timeout)
        return dist.PrefixStore(store_keys.torchrun_attempt_prefix(contract.torchrun_store_attempt), store)  # type: ignore[attr-defined]
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return None
    return _rank_zeros_store(environment, rank, size, timeout)


def _rank_zeros_store(environment: ClusterEnvironment, rank: int, size: int, timeout: timedelta) -> Any:
    """The job's store as torch's ``env://`` makes it (rank 0 hosts it, the others connect), except
    that rank 0's listens only on the main address (``_network.store_bind_address``; torch's listens
    on every interface): a single-node job's store on 127.0.0.1 is out of reach of other machines.
    When that address cannot be bound here, rank 0 listens where torch would."""
    address, port = environment.main_address, environment.main_port
    listener = None
    if rank == 0:
        # Which nodes take part is not known here: only a loopback address given as such says "one machine".
        bind = store_bind_address(address, across_nodes=not (address in ("localhost", "::1") or address.startswith("127.")))
        try:
            listener = listen_on(bind, port)
        except OSError as error:
            _log.debug(f"ddpkit: the store cannot listen on {bind or 'every interface'} port {port} ({error}); "
                       "it listens where torch's own would")
    store = dist.TCPStore(  # type: ignore[attr-defined]
        address, port, world_size=size, is_master=rank == 0, timeout=timeout, wait_for_workers=False,
        master_listen_fd=None if listener is None else listener.fileno())
    if listener is not None:
        listener.detach()  # the store listens on that very descriptor now: closing it would end its server
    return store


def _say_unauthenticated() -> None:
    """Once, on rank 0 of a job without a job secret. ``ddpkit run`` says it itself for its jobs
    (it makes a secret on one node, and across nodes it asks for one)."""
    if os.environ.get(DDPKIT_LAUNCHED):
        return
    _log.warning(
        f"ddpkit: this job has no secret ({DDPKIT_JOB_SECRET}), so its records in the store are not authenticated: any "
        "process that reaches the store's port can end the job and name a rank as its cause. Set "
        f"{DDPKIT_JOB_SECRET} to the same random value for every process (e.g. `python -c 'import secrets; "
        "print(secrets.token_hex(32))'`), or start the job with `ddpkit run`, which makes one on one node.")


def _warn_if_slurm_expected_more() -> None:
    """One process alone in a Slurm allocation of several tasks was most likely meant to be one of
    them: started in ``sbatch``'s script or ``salloc``'s shell rather than by srun."""
    tasks = os.environ.get("SLURM_NTASKS", "").strip()
    if tasks.isdigit() and int(tasks) > 1 and not SLURMEnvironment.detect():
        _log.warning(
            f"ddpkit: this process trains alone (world size 1) inside a Slurm allocation of SLURM_NTASKS={tasks} "
            "tasks, because srun did not start it (it runs in sbatch's script or salloc's shell, outside any job "
            f"step). To train on all {tasks}: `srun python script.py`, or `ddpkit run --nproc-per-node N script.py` "
            "to start the processes of this node from here."
        )


def _check_existing_group(rank: int, size: int, backend: str | None) -> None:
    existing: dict[str, Any] = {"global_rank": dist.get_rank(), "world_size": dist.get_world_size()}
    wanted: dict[str, Any] = {"global_rank": rank, "world_size": size}
    if backend is not None:
        existing["backend"] = str(dist.get_backend())
        wanted["backend"] = backend
    differences = [f"{key}: existing {existing[key]!r}, requested {wanted[key]!r}"
                   for key in wanted if existing[key] != wanted[key]]
    if differences:
        raise RuntimeError(
            "A torch.distributed process group already exists and disagrees with the requested connection ("
            + "; ".join(differences)
            + "). Call torch.distributed.destroy_process_group() first, or connect with the same values."
        )


#: How long teardown releases the GIL so that Gloo's worker threads can finish freeing their
#: last work objects (see destroy_dist_connection).
_TEARDOWN_GIL_RELEASE_S = 0.1


def destroy_dist_connection() -> None:
    """Wait for every rank, destroy the default process group, and let Gloo's threads settle.

    Why each step (torch 2.13, Gloo; measured with core dumps of aborted runs): a Gloo worker
    thread frees each finished collective's tensors after completing it; when Python has
    already dropped those tensors, the free needs the GIL. If the interpreter is finalizing by
    then, CPython ends that thread with a forced unwind through C++ ``noexcept`` code and the
    process aborts ("terminate called without an active exception", SIGABRT). The process
    group often outlives ``destroy_process_group`` (``torch._dynamo``, imported by every
    optimizer, and torch's DDP keep references), so its threads live on to finalization.
    The barrier finishes all collectives; the short sleep releases the GIL so that pending
    frees complete before the interpreter exits. Does nothing when no process group exists.
    """
    if not distributed_available():
        return
    if dist.get_world_size() > 1:
        try:
            run_collective(dist.barrier)
        except RuntimeError:
            pass  # a rank failed (and said so: PeerFailedError) or was lost: there is no clean exit to wait for
    if (group := current_group()) is not None:
        group.finish()  # a node waiting to join finds no step left: it is told so
    dist.destroy_process_group()
    set_current_group(None)
    time.sleep(_TEARDOWN_GIL_RELEASE_S)


def distributed_available() -> bool:
    """Whether collectives will communicate (torch.distributed present and initialised)."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: ProcessGroup = None) -> int:
    """This process's rank within ``group`` (the world by default); 0 when not distributed."""
    return dist.get_rank(group) if distributed_available() else 0


def get_world_size(group: ProcessGroup = None) -> int:
    """Number of processes in ``group`` (the world by default); 1 when not distributed."""
    return dist.get_world_size(group) if distributed_available() else 1
