"""IBM LSF (``jsrun``): ranks from JSM_NAMESPACE_*, hosts from LSB_DJOB_RANKFILE."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from ddpkit.environments.base import (
    _LSF_PORT_BASE,
    _int_var,
    _port_var,
    _ResolvedEnvironment,
    check_place,
)

__all__ = ["LSFEnvironment"]


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
        check_place(names, values, fix)
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
