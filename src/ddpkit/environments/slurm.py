"""SLURM (``srun``): ranks from SLURM_PROCID and friends, the master from the node list."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from ddpkit.environments.base import (
    _DEFAULT_PORT,
    _SLURM_PORT_BASE,
    _first_of,
    _int_var,
    _port_var,
    _ResolvedEnvironment,
    check_place,
)

__all__ = ["SLURMEnvironment", "expand_slurm_nodelist"]


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
        check_place(names, values, fix)

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
