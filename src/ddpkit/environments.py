"""Cluster environments: where the processes of a job come from and how they find each other.

Each class reads the variables its scheduler sets from a mapping (``os.environ`` by default),
validates them once, in ``__init__``, and then only returns what it read: no getter touches
the environment. A malformed or inconsistent value raises ``ValueError`` naming the variable,
its value and the fix, before any process tries to connect.

``detect_environment()`` checks, in this order, and returns the first that matches:

1. ``LocalEnvironment`` when the process was started by ddpkit's launcher
   (``DDPKIT_LAUNCHED`` is set): ddpkit's own variables then win over any scheduler's that the
   launcher inherited, e.g. ``srun ddpkit run --nproc-per-node 4``.
2. ``TorchElasticEnvironment`` (torchrun sets per-process variables; it may run inside SLURM).
3. ``MPIEnvironment`` (mpirun sets per-process variables; it may run inside SLURM or LSF).
4. ``SLURMEnvironment`` (``srun``; not an interactive ``salloc`` shell named ``bash``/``interactive``).
5. ``LSFEnvironment`` (``jsrun`` on LSF clusters).
6. ``KubeflowEnvironment`` (a PyTorchJob pod).
7. ``LocalEnvironment`` (the default: one node, processes started by ddpkit or by hand).

The more specific launcher comes first because it runs inside the broader allocation and
sets the variables that describe this very process.
"""

from __future__ import annotations

import os
import re
import socket
import zlib
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

__all__ = [
    "DDPKIT_LAUNCHED",
    "ClusterEnvironment",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "LocalEnvironment",
    "MPIEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "detect_environment",
    "environment_variables",
    "expand_slurm_nodelist",
    "find_free_port",
]

#: Set by ddpkit's launcher in every worker it starts.
DDPKIT_LAUNCHED = "DDPKIT_LAUNCHED"

# Lightning's defaults, kept so that jobs move between the two without new ports.
_DEFAULT_PORT = 12910
_SLURM_PORT_BASE = 15000
_LSF_PORT_BASE = 10000
_MPI_PORT_BASE = 20000


@runtime_checkable
class ClusterEnvironment(Protocol):
    """What ddpkit needs to know about the job this process belongs to (Lightning's shape)."""

    @property
    def main_address(self) -> str:
        """Host name or address of the process with global rank 0."""
        ...

    @property
    def main_port(self) -> int:
        """TCP port on ``main_address`` where the rendezvous store listens."""
        ...

    @property
    def creates_processes_externally(self) -> bool:
        """True when something other than ddpkit already started every process."""
        ...

    def world_size(self) -> int: ...

    def global_rank(self) -> int: ...

    def local_rank(self) -> int: ...

    def node_rank(self) -> int: ...

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> bool:
        """Whether the variables of this environment are present."""
        ...


class _ResolvedEnvironment:
    """The values every environment ends up with; subclasses only parse their variables."""

    _main_address: str
    _main_port: int
    _world_size: int
    _global_rank: int
    _local_rank: int
    _node_rank: int
    _external: bool

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        raise NotImplementedError  # each environment parses its own variables

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> bool:
        raise NotImplementedError

    @property
    def main_address(self) -> str:
        return self._main_address

    @property
    def main_port(self) -> int:
        return self._main_port

    @property
    def creates_processes_externally(self) -> bool:
        return self._external

    def world_size(self) -> int:
        return self._world_size

    def global_rank(self) -> int:
        return self._global_rank

    def local_rank(self) -> int:
        return self._local_rank

    def node_rank(self) -> int:
        return self._node_rank

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(main_address={self._main_address!r}, main_port={self._main_port}, "
            f"world_size={self._world_size}, global_rank={self._global_rank}, "
            f"local_rank={self._local_rank}, node_rank={self._node_rank})"
        )


# ---------------------------------------------------------------------------------------------
# Parsing helpers: every error names the variable, its value and what to do about it.


def _int_var(env: Mapping[str, str], name: str, fix: str, default: int | None = None, minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise ValueError(f"{name} is not set. {fix}")
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer. {fix}") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}. {fix}")
    return value


def _port_var(env: Mapping[str, str], name: str, default: int) -> int:
    fix = f"Set {name} to a free TCP port between 1 and 65535, e.g. {name}=29500."
    port = _int_var(env, name, fix, default=default, minimum=1)
    if port > 65535:
        raise ValueError(f"{name}={port} is not a TCP port (1..65535). {fix}")
    return port


def _first_of(env: Mapping[str, str], *names: str) -> str | None:
    """The name of the first variable in ``names`` that is set, if any."""
    return next((name for name in names if env.get(name, "").strip()), None)


def _check_below(name: str, value: int, limit_name: str, limit: int, fix: str) -> None:
    if value >= limit:
        raise ValueError(
            f"{name}={value} is not smaller than {limit_name}={limit}: ranks count from 0, "
            f"so {name} must be in 0..{limit - 1}. {fix}"
        )


_RANK_LIMITS = (("rank", "world"), ("local", "local_world"), ("node", "nodes"))


def _validate(names: Mapping[str, str], values: Mapping[str, int], fix: str) -> None:
    """Check that every rank is below its size and a node is not larger than the job.

    ``names`` maps roles (rank, world, local, local_world, node, nodes) to the variable that
    supplied them; a role missing from ``values`` is not checked.
    """
    for small, big in _RANK_LIMITS:
        if small in values and big in values:
            _check_below(names[small], values[small], names[big], values[big], fix)
    if "local_world" in values and "world" in values and values["local_world"] > values["world"]:
        raise ValueError(
            f"{names['local_world']}={values['local_world']} is larger than {names['world']}={values['world']}: "
            f"a node cannot hold more processes than the whole job. {fix}"
        )


def _required_address(env: Mapping[str, str], fix: str) -> str:
    address = env.get("MASTER_ADDR", "").strip()
    if not address:
        raise ValueError(f"MASTER_ADDR is not set. {fix}")
    return address


def _required_port(env: Mapping[str, str], fix: str) -> int:
    if not env.get("MASTER_PORT", "").strip():
        raise ValueError(f"MASTER_PORT is not set. {fix}")
    return _port_var(env, "MASTER_PORT", default=0)


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def environment_variables(environment: ClusterEnvironment) -> dict[str, str]:
    """The torch.distributed variables (``env://``) that describe this process in ``environment``."""
    return {
        "MASTER_ADDR": environment.main_address,
        "MASTER_PORT": str(environment.main_port),
        "WORLD_SIZE": str(environment.world_size()),
        "RANK": str(environment.global_rank()),
        "LOCAL_RANK": str(environment.local_rank()),
        "NODE_RANK": str(environment.node_rank()),
    }


# ---------------------------------------------------------------------------------------------


class LocalEnvironment(_ResolvedEnvironment):
    """One node (or nodes joined by hand with MASTER_ADDR), processes started by ddpkit or the user.

    Reads the torch.distributed variables when they are set, with single-process defaults:
    ``MASTER_ADDR`` (127.0.0.1), ``MASTER_PORT`` (a free port, chosen once when this object is
    made; ``init_dist_connection`` exports it so that child processes share it), ``WORLD_SIZE``
    (1), ``RANK`` (``NODE_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``), ``LOCAL_RANK`` (0),
    ``LOCAL_WORLD_SIZE``, ``NODE_RANK``/``GROUP_RANK`` (0).
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        fix = "Set the variable correctly, or unset it to use the single-process default."
        self._main_address = env.get("MASTER_ADDR", "").strip() or "127.0.0.1"
        self._main_port = _port_var(env, "MASTER_PORT", default=0) if env.get("MASTER_PORT") else find_free_port()
        self._world_size = _int_var(env, "WORLD_SIZE", fix, default=1, minimum=1)
        self._local_rank = _int_var(env, "LOCAL_RANK", fix, default=0)
        node_var = _first_of(env, "NODE_RANK", "GROUP_RANK") or "NODE_RANK"
        self._node_rank = _int_var(env, node_var, fix, default=0)
        local_world = _int_var(env, "LOCAL_WORLD_SIZE", fix, default=0, minimum=1) if env.get("LOCAL_WORLD_SIZE") else None
        default_rank = self._node_rank * (local_world or 1) + self._local_rank
        self._global_rank = _int_var(env, "RANK", fix, default=default_rank)
        self._external = "LOCAL_RANK" in env or DDPKIT_LAUNCHED in env
        values = {"rank": self._global_rank, "world": self._world_size, "local": self._local_rank}
        if local_world is not None:
            values["local_world"] = local_world
        names = {"rank": "RANK", "world": "WORLD_SIZE", "local": "LOCAL_RANK", "local_world": "LOCAL_WORLD_SIZE"}
        _validate(names, values, fix)

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> bool:
        """Always true: the fallback when no scheduler is found."""
        return True


class TorchElasticEnvironment(_ResolvedEnvironment):
    """Processes started by ``torchrun`` (torch.distributed.elastic)."""

    _REQUIRED = ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        fix = "These are set by torchrun: start the script with `torchrun --nproc-per-node N script.py`."
        self._main_address = _required_address(env, fix)
        self._main_port = _required_port(env, fix)
        self._world_size = _int_var(env, "WORLD_SIZE", fix, minimum=1)
        self._global_rank = _int_var(env, "RANK", fix)
        self._local_rank = _int_var(env, "LOCAL_RANK", fix)
        self._node_rank = _int_var(env, "GROUP_RANK", fix, default=0)
        self._external = True
        values = {"rank": self._global_rank, "world": self._world_size, "local": self._local_rank}
        if env.get("LOCAL_WORLD_SIZE"):
            values["local_world"] = _int_var(env, "LOCAL_WORLD_SIZE", fix, minimum=1)
        names = {"rank": "RANK", "world": "WORLD_SIZE", "local": "LOCAL_RANK", "local_world": "LOCAL_WORLD_SIZE"}
        _validate(names, values, fix)

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> bool:
        env = os.environ if env is None else env
        return "TORCHELASTIC_RUN_ID" in env or all(name in env for name in cls._REQUIRED)


# ---------------------------------------------------------------------------------------------
# SLURM


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list such as ``node[01-04,07],gpu5,rack[1-2]-n[1-2]`` into host names.

    Hosts may be separated by commas or by whitespace (``"alpha beta gamma"``).

    Zero padding is kept (``node[01-03]`` gives node01, node02, node03); several bracket groups
    in one name give their product, as ``scontrol show hostnames`` does.
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_host(item, nodelist))
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split at commas and whitespace outside brackets (some sites separate hosts with spaces)."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif (char == "," or char.isspace()) and depth == 0:
            items.append(text[start:index])
            start = index + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_host(item: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", item)
    if match is None:
        if "[" in item or "]" in item:
            raise ValueError(f"SLURM_NODELIST={whole!r} has unbalanced brackets in {item!r}.")
        return [item]
    prefix, rest = item[: match.start()], item[match.end() :]
    names: list[str] = []
    for part in match.group(1).split(","):
        part = part.strip()
        bounds = part.split("-")
        if len(bounds) == 1 and part.isdigit():
            numbers = [part]
        elif len(bounds) == 2 and all(b.isdigit() for b in bounds) and int(bounds[0]) <= int(bounds[1]):
            width = len(bounds[0])
            numbers = [str(n).zfill(width) for n in range(int(bounds[0]), int(bounds[1]) + 1)]
        else:
            raise ValueError(
                f"SLURM_NODELIST={whole!r}: cannot read the range {part!r}; "
                "expected numbers like 3 or 01-04 inside the brackets."
            )
        names.extend(prefix + number for number in numbers)
    return [name + tail for name in names for tail in _expand_host(rest, whole)] if rest else names


class SLURMEnvironment(_ResolvedEnvironment):
    """Processes started by ``srun``: one SLURM task per process.

    ``main_address`` is ``MASTER_ADDR`` if set, otherwise the first host of ``SLURM_NODELIST``;
    ``main_port`` is ``MASTER_PORT`` if set, otherwise 15000 + the last four digits of
    ``SLURM_JOB_ID`` (Lightning's rule, so every task of the job derives the same port).
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        fix = "These are set by srun; run the script with `srun python script.py` inside the allocation."
        self._world_size = _int_var(env, "SLURM_NTASKS", fix, minimum=1)
        if self._world_size > 1 and not env.get("SLURM_NTASKS_PER_NODE"):
            raise ValueError(
                f"SLURM_NTASKS={self._world_size} is set but SLURM_NTASKS_PER_NODE is not: you asked for "
                f"`--ntasks={self._world_size}`, which lets SLURM place tasks unevenly across nodes. "
                f"HINT: use `--ntasks-per-node=N` (with `--nodes=M`) instead of `--ntasks`."
            )
        self._global_rank = _int_var(env, "SLURM_PROCID", fix)
        self._local_rank = _int_var(env, "SLURM_LOCALID", fix)
        self._node_rank = _int_var(env, "SLURM_NODEID", fix, default=0)
        values = {"rank": self._global_rank, "world": self._world_size, "local": self._local_rank,
                  "node": self._node_rank}
        names = {"rank": "SLURM_PROCID", "world": "SLURM_NTASKS", "local": "SLURM_LOCALID",
                 "local_world": "SLURM_NTASKS_PER_NODE", "node": "SLURM_NODEID", "nodes": "SLURM_NNODES"}
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").strip()
        if per_node.isdigit():  # it can also read like "2(x3)" on heterogeneous jobs
            values["local_world"] = _int_var(env, "SLURM_NTASKS_PER_NODE", fix, minimum=1)
        if env.get("SLURM_NNODES"):
            values["nodes"] = _int_var(env, "SLURM_NNODES", fix, minimum=1)
        _validate(names, values, fix)

        nodelist_var = _first_of(env, "SLURM_NODELIST", "SLURM_JOB_NODELIST")
        if env.get("MASTER_ADDR", "").strip():
            self._main_address = env["MASTER_ADDR"].strip()
        elif nodelist_var is not None:
            hosts = expand_slurm_nodelist(env[nodelist_var])
            if not hosts:
                raise ValueError(f"{nodelist_var}={env[nodelist_var]!r} names no host. {fix}")
            self._main_address = hosts[0]
        else:
            self._main_address = "127.0.0.1"
        self._main_port = _port_var(env, "MASTER_PORT", default=self._port_from_job_id(env))
        self._external = True

    @staticmethod
    def _port_from_job_id(env: Mapping[str, str]) -> int:
        job_id = env.get("SLURM_JOB_ID", "").strip()
        if not job_id:
            return _DEFAULT_PORT
        if not job_id.isdigit():
            raise ValueError(f"SLURM_JOB_ID={job_id!r} is not a number; set MASTER_PORT to choose the port.")
        return _SLURM_PORT_BASE + int(job_id[-4:])

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> bool:
        """An ``srun`` task: SLURM_NTASKS is set and the job is not an interactive shell."""
        env = os.environ if env is None else env
        return "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")


# ---------------------------------------------------------------------------------------------


class LSFEnvironment(_ResolvedEnvironment):
    """Processes started by ``jsrun`` on an IBM Spectrum LSF cluster (e.g. Summit).

    Hosts come from the rank file ``LSB_DJOB_RANKFILE`` (one line per slot) or, without it,
    ``LSB_HOSTS``; the first entry is the launch node and is skipped, so ``main_address`` is the
    first compute host. ``main_port`` is 10000 + ``LSB_JOBID`` % 1000. ``node_rank`` is the
    position of this host among the distinct compute hosts (``hostname`` overrides the lookup).
    """

    _REQUIRED = ("LSB_JOBID", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_LOCAL_RANK")

    def __init__(self, env: Mapping[str, str] | None = None, hostname: str | None = None) -> None:
        env = os.environ if env is None else env
        fix = "These are set by jsrun; start the script with `jsrun ... python script.py`."
        self._world_size = _int_var(env, "JSM_NAMESPACE_SIZE", fix, minimum=1)
        self._global_rank = _int_var(env, "JSM_NAMESPACE_RANK", fix)
        self._local_rank = _int_var(env, "JSM_NAMESPACE_LOCAL_RANK", fix)
        values = {"rank": self._global_rank, "world": self._world_size, "local": self._local_rank}
        names = {"rank": "JSM_NAMESPACE_RANK", "world": "JSM_NAMESPACE_SIZE", "local": "JSM_NAMESPACE_LOCAL_RANK"}
        _validate(names, values, fix)
        job_id = _int_var(env, "LSB_JOBID", fix)

        hosts = self._compute_hosts(env)
        unique_hosts = list(dict.fromkeys(hosts))
        self._main_address = env.get("MASTER_ADDR", "").strip() or hosts[0]
        self._main_port = _port_var(env, "MASTER_PORT", default=_LSF_PORT_BASE + job_id % 1000)
        me = hostname if hostname is not None else socket.gethostname()
        short_names = [host.split(".")[0] for host in unique_hosts]
        if me in unique_hosts:
            self._node_rank = unique_hosts.index(me)
        elif me.split(".")[0] in short_names:
            self._node_rank = short_names.index(me.split(".")[0])
        else:
            raise ValueError(
                f"This host ({me!r}) is not among the compute hosts of the LSF job {unique_hosts}. "
                "Run the script through jsrun on the allocated hosts."
            )
        self._external = True

    @staticmethod
    def _compute_hosts(env: Mapping[str, str]) -> list[str]:
        rankfile = env.get("LSB_DJOB_RANKFILE", "").strip()
        if rankfile:
            try:
                with open(rankfile, encoding="utf-8") as handle:
                    hosts = [line.strip() for line in handle if line.strip()]
            except OSError as error:
                raise ValueError(
                    f"LSB_DJOB_RANKFILE={rankfile!r} cannot be read ({error}). "
                    "It is written by LSF for the job; run inside the allocation."
                ) from None
            source = f"LSB_DJOB_RANKFILE={rankfile!r}"
        elif env.get("LSB_HOSTS", "").strip():
            hosts = env["LSB_HOSTS"].split()
            source = f"LSB_HOSTS={env['LSB_HOSTS']!r}"
        else:
            raise ValueError("Neither LSB_DJOB_RANKFILE nor LSB_HOSTS is set; LSF sets them in a job's allocation.")
        if not hosts:
            raise ValueError(f"{source} names no host.")
        return hosts[1:] if len(hosts) > 1 else hosts  # the first is the launch node

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> bool:
        env = os.environ if env is None else env
        has_hosts = "LSB_DJOB_RANKFILE" in env or "LSB_HOSTS" in env
        return has_hosts and all(name in env for name in cls._REQUIRED)


# ---------------------------------------------------------------------------------------------


# (rank, size, local rank, local size, node rank or None) per MPI implementation.
_MPI_FLAVOURS: tuple[tuple[str, str, str, str, str | None], ...] = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK"),  # Open MPI
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
    ``MASTER_PORT``, or a port derived from the MPI job id, the same on every rank. Without a
    node-rank variable the node rank is ``global_rank // local_size`` (block placement).
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
        _validate(names, values, fix)

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
        self._main_port = _port_var(env, "MASTER_PORT", default=self._port_from_job_id(env))
        self._external = True

    @staticmethod
    def _flavour(env: Mapping[str, str]) -> tuple[str, str, str, str, str | None] | None:
        return next((f for f in _MPI_FLAVOURS if f[0] in env and f[1] in env), None)

    @staticmethod
    def _port_from_job_id(env: Mapping[str, str]) -> int:
        name = _first_of(env, *_MPI_JOB_ID_VARS)
        if name is None:
            return _DEFAULT_PORT
        return _MPI_PORT_BASE + zlib.crc32(env[name].encode()) % 10000

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> bool:
        return cls._flavour(os.environ if env is None else env) is not None


class KubeflowEnvironment(_ResolvedEnvironment):
    """A Kubeflow PyTorchJob: one process per pod, MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK set by the operator."""

    _REQUIRED = ("KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        fix = "These are set by the Kubeflow training operator for each pod of a PyTorchJob."
        self._main_address = _required_address(env, fix)
        self._main_port = _required_port(env, fix)
        self._world_size = _int_var(env, "WORLD_SIZE", fix, minimum=1)
        self._global_rank = _int_var(env, "RANK", fix)
        _validate({"rank": "RANK", "world": "WORLD_SIZE"}, {"rank": self._global_rank, "world": self._world_size}, fix)
        self._local_rank = 0
        self._node_rank = self._global_rank
        self._external = True

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> bool:
        env = os.environ if env is None else env
        return all(name in env for name in cls._REQUIRED)


_DETECTION_ORDER: tuple[type[_ResolvedEnvironment], ...] = (
    TorchElasticEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    LSFEnvironment,
    KubeflowEnvironment,
)


def detect_environment(env: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """The environment this process runs in, in the order the module docstring gives."""
    env = os.environ if env is None else env
    if DDPKIT_LAUNCHED in env:
        return LocalEnvironment(env)
    for candidate in _DETECTION_ORDER:
        if candidate.detect(env):
            return candidate(env)
    return LocalEnvironment(env)
