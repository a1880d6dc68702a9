"""What every cluster environment shares: the protocol, validated reading of variables, the one
consistency check of a process's place (``check_place``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from ddpkit.variables import DDPKIT_RESTART_COUNT

__all__ = ["ChoosesBackend", "ClusterEnvironment", "check_place", "restart_count",
           "environment_variables"]


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


@runtime_checkable
class ChoosesBackend(Protocol):
    """An environment that also names the torch.distributed backend of the job (``ddpkit run
    --backend``); None leaves the choice to the connection (NCCL with CUDA, else Gloo)."""

    @property
    def backend(self) -> str | None: ...


class _ResolvedEnvironment:
    """The values every environment ends up with; subclasses only parse their variables."""

    _main_address: str
    _main_port: int
    _world_size: int
    _global_rank: int
    _local_rank: int
    _node_rank: int
    _external: bool
    _backend: str | None = None

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

    @property
    def backend(self) -> str | None:
        return self._backend

    def world_size(self) -> int:
        return self._world_size

    def global_rank(self) -> int:
        return self._global_rank

    def local_rank(self) -> int:
        return self._local_rank

    def node_rank(self) -> int:
        return self._node_rank

    def _read_torch_variables(self, env: Mapping[str, str], fix: str) -> None:
        """MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK, all required: what an agent that starts
        each process (torchrun, the Kubeflow operator) sets for it."""
        self._main_address = _required_address(env, fix)
        self._main_port = _required_port(env, fix)
        self._world_size = _int_var(env, "WORLD_SIZE", fix, minimum=1)
        self._global_rank = _int_var(env, "RANK", fix)
        self._external = True

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(main_address={self._main_address!r}, main_port={self._main_port}, "
            f"world_size={self._world_size}, global_rank={self._global_rank}, "
            f"local_rank={self._local_rank}, node_rank={self._node_rank})"
        )


# ---------------------------------------------------------------------------------------------
# Parsing helpers: every error names the variable, its value and what to do about it.


def restart_count(env: Mapping[str, str]) -> int:
    """How often the workers were started again before this start (0: the first start):
    ``DDPKIT_RESTART_COUNT`` (``ddpkit run --max-restarts``), else torchrun's
    ``TORCHELASTIC_RESTART_COUNT``. ``ValueError`` naming a malformed one."""
    for variable in (DDPKIT_RESTART_COUNT, "TORCHELASTIC_RESTART_COUNT"):
        value = env.get(variable, "").strip()
        if not value:
            continue
        count = int(value) if value.isdigit() else -1
        if count < 0:
            raise ValueError(f"{variable}={value!r} is not a restart count (0 or more); the launcher sets it, "
                             "so unset it if you set it yourself.")
        return count
    return 0


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


def check_place(names: Mapping[str, str], values: Mapping[str, int], fix: str) -> None:
    """The one consistency check of a process's place in the job (every environment's, and the
    connection's for ranks given by hand): sizes at least 1, ranks from 0 and below their size,
    a node no larger than the job.

    ``names`` maps roles (rank, world, local, local_world, node, nodes) to the variable or
    argument that supplied them, for the message; a role missing from ``values`` is not checked.
    """
    for small, big in _RANK_LIMITS:
        if big in values and values[big] < 1:
            raise ValueError(f"{names[big]}={values[big]} must be at least 1. {fix}")
        if small in values and values[small] < 0:
            raise ValueError(f"{names[small]}={values[small]} is negative: ranks count from 0. {fix}")
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
