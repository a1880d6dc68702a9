"""MPI launchers (``mpirun``: Open MPI, MPICH, Intel MPI) through their per-process variables."""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping

from ddpkit.environments.base import (
    _DEFAULT_PORT,
    _MPI_PORT_BASE,
    _first_of,
    _int_var,
    _port_var,
    _ResolvedEnvironment,
    check_place,
)

__all__ = ["MPIEnvironment", "hydra_proxy_pid"]

_HYDRA_PROXY = "hydra_pmi_proxy"


# (rank, size, local rank, local size, node rank or None) per MPI implementation. Open MPI's
# OMPI_COMM_WORLD_NODE_RANK is not the node's index: it numbers the processes on a node (0 and 1
# for `mpirun -np 2` on one host), so the node rank comes from the placement, as for the others.
_MPI_FLAVOURS: tuple[tuple[str, str, str, str, str | None], ...] = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", None),  # Open MPI
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
     "MV2_COMM_WORLD_LOCAL_SIZE", None),  # MVAPICH2
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", None),  # MPICH / Intel MPI (Hydra)
)
_MPI_JOB_ID_VARS = ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "PMI_KVSNAME", "MPI_JOB_ID")


class MPIEnvironment(_ResolvedEnvironment):
    """Processes started by ``mpirun``/``mpiexec`` (Open MPI, MPICH, Intel MPI, MVAPICH2).

    No mpi4py is needed: ranks come from the launcher's variables. ``main_address`` is
    ``MASTER_ADDR``, or 127.0.0.1 when every process is on one node (for several nodes, export
    ``MASTER_ADDR`` to all ranks, e.g. ``mpirun -x MASTER_ADDR=$(hostname)``). ``main_port`` is
    ``MASTER_PORT``, or a port derived from the MPI job id, the same on every rank. MPICH's Hydra
    sets no job id: on one node the port is derived from the process id of the node's
    ``hydra_pmi_proxy`` (an ancestor of every rank, distinct per job), so two jobs on one host do
    not meet at one port; across nodes, where the proxies differ, ``MASTER_PORT`` is required.
    Without a node-rank variable the node rank is ``global_rank // local_size`` (block placement).
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        flavour = self._flavour(env)
        if flavour is None:
            raise ValueError("No MPI rank variables found (OMPI_COMM_WORLD_RANK, PMI_RANK, MV2_COMM_WORLD_RANK).")
        rank_var, size_var, local_var, local_size_var, node_var = flavour
        fix = "These are set by mpirun; start the script with `mpirun -np N python script.py`."
        self._world_size = _int_var(env, size_var, fix, minimum=1)
        self._global_rank = _int_var(env, rank_var, fix)
        local_name = local_var if env.get(local_var) else "LOCAL_RANK"
        if not env.get(local_name):
            raise ValueError(
                f"{local_var} is not set, so this process's local rank is unknown. "
                f"Export LOCAL_RANK, or use an MPI launcher that sets {local_var}."
            )
        self._local_rank = _int_var(env, local_name, fix)
        local_size = _int_var(env, local_size_var, fix, minimum=1) if env.get(local_size_var) else None
        values = {"rank": self._global_rank, "world": self._world_size, "local": self._local_rank}
        names = {"rank": rank_var, "world": size_var, "local": local_name, "local_world": local_size_var}
        if local_size is not None:
            values["local_world"] = local_size
        check_place(names, values, fix)

        if node_var is not None and env.get(node_var):
            self._node_rank = _int_var(env, node_var, fix)
        else:
            self._node_rank = self._global_rank // local_size if local_size else 0
        single_node = self._world_size == 1 or local_size == self._world_size
        address = env.get("MASTER_ADDR", "").strip()
        if not address and not single_node:
            spread = f"{local_size_var}={local_size}" if local_size else f"{local_size_var} is not set"
            raise ValueError(
                f"MASTER_ADDR is not set and the MPI job may span several nodes ({size_var}={self._world_size}, "
                f"{spread}). Export the host of rank 0 to every rank, e.g. `mpirun -x MASTER_ADDR=$(hostname) ...`."
            )
        self._main_address = address or "127.0.0.1"
        job = self._job_identity(env, under_hydra=rank_var == "PMI_RANK" and single_node)
        if job is None and not env.get("MASTER_PORT", "").strip() and not single_node:
            raise ValueError(
                f"MASTER_PORT is not set and this MPI launcher sets no job id ({', '.join(_MPI_JOB_ID_VARS)} are "
                f"all unset, as under MPICH's Hydra), so the ranks of a job spanning several nodes "
                f"({size_var}={self._world_size}, {local_size_var}={local_size}) cannot derive one port. "
                "Export a free port to every rank, e.g. `mpirun -genv MASTER_PORT 29500 ...`."
            )
        default_port = _DEFAULT_PORT if job is None else _MPI_PORT_BASE + zlib.crc32(job.encode()) % 10000
        self._main_port = _port_var(env, "MASTER_PORT", default=default_port)
        self._external = True

    @staticmethod
    def _flavour(env: Mapping[str, str]) -> tuple[str, str, str, str, str | None] | None:
        return next((f for f in _MPI_FLAVOURS if f[0] in env and f[1] in env), None)

    @staticmethod
    def _job_identity(env: Mapping[str, str], under_hydra: bool) -> str | None:
        """What every rank of this job shares and no other job on the host has, or None.
        ``under_hydra``: MPICH's (or Intel MPI's) variables, on one node, where the node's
        ``hydra_pmi_proxy`` is every rank's ancestor."""
        name = _first_of(env, *_MPI_JOB_ID_VARS)
        if name is not None:
            return env[name]
        proxy = hydra_proxy_pid() if under_hydra else None
        return None if proxy is None else f"hydra_pmi_proxy {proxy}"

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> bool:
        return cls._flavour(os.environ if env is None else env) is not None


def hydra_proxy_pid(pid: int | None = None) -> int | None:
    """The process id of the nearest ``hydra_pmi_proxy`` among ``pid``'s ancestors (default: this
    process's), or None when there is none or ``/proc`` cannot be read (not Linux)."""
    current = os.getpid() if pid is None else pid
    while current > 1:
        try:
            with open(f"/proc/{current}/stat", encoding="utf-8", errors="replace") as stat:
                text = stat.read()
        except OSError:
            return None
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split at the last ")".
        command = text[text.find("(") + 1 : text.rfind(")")]
        if command == _HYDRA_PROXY:
            return current
        current = int(text[text.rfind(")") + 2 :].split()[1])
    return None
