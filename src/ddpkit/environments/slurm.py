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
        tasks_per_node, tasks_per_node_var = _tasks_per_node(env, self._world_size, fix)
        self._global_rank = _int_var(env, "SLURM_PROCID", fix)
        self._local_rank = _int_var(env, "SLURM_LOCALID", fix)
        self._node_rank = _int_var(env, "SLURM_NODEID", fix, default=0)
        values = {"rank": self._global_rank, "world": self._world_size, "local": self._local_rank,
                  "node": self._node_rank}
        names = {"rank": "SLURM_PROCID", "world": "SLURM_NTASKS", "local": "SLURM_LOCALID",
                 "local_world": tasks_per_node_var, "node": "SLURM_NODEID", "nodes": "SLURM_NNODES"}
        if tasks_per_node is not None:
            values["local_world"] = tasks_per_node
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
        """A task of a job step that ``srun`` started: SLURM_NTASKS, SLURM_PROCID and the step's id
        (SLURM_STEP_ID) are set. The shell of ``salloc`` has no SLURM_PROCID, and the batch script of
        ``sbatch`` runs outside any step (no SLURM_STEP_ID) although SLURM_NTASKS counts the tasks
        srun would start: a process there is one process, not a rank of SLURM_NTASKS. The job's
        name says nothing (``srun bash -c "python ..."`` names it ``bash``)."""
        env = os.environ if env is None else env
        return ("SLURM_NTASKS" in env and "SLURM_PROCID" in env
                and _first_of(env, "SLURM_STEP_ID", "SLURM_STEPID") is not None)


def _tasks_per_node(env: Mapping[str, str], world_size: int, fix: str) -> tuple[int | None, str]:
    """The tasks on each node (the local world size; None when it cannot be known, for one task)
    and the variable it came from.

    From SLURM_NTASKS_PER_NODE (``--ntasks-per-node``), else from SLURM_TASKS_PER_NODE, which srun
    always sets (``2(x3)``: 2 on each of 3 nodes; ``2,1``: uneven). Uneven placement is refused:
    DDP's local ranks need the same count everywhere.
    """
    if env.get("SLURM_NTASKS_PER_NODE", "").strip().isdigit():  # it can also read like "2(x3)"
        return _int_var(env, "SLURM_NTASKS_PER_NODE", fix, minimum=1), "SLURM_NTASKS_PER_NODE"
    placed = env.get("SLURM_TASKS_PER_NODE", "").strip()
    counts = _expand_tasks_per_node(placed) if placed else None
    if counts and len(set(counts)) == 1:
        return counts[0], "SLURM_TASKS_PER_NODE"
    if world_size == 1:
        return None, "SLURM_TASKS_PER_NODE"
    where = f"SLURM_TASKS_PER_NODE={placed!r}" if placed else "SLURM_TASKS_PER_NODE is not set"
    raise ValueError(
        f"SLURM_NTASKS={world_size} tasks are not placed evenly on the nodes ({where}): you asked for "
        f"`--ntasks={world_size}`, which lets SLURM place tasks unevenly across nodes, and every node needs the "
        f"same number of processes. HINT: use `--ntasks-per-node=N` (with `--nodes=M`) instead of `--ntasks`."
    )


def _expand_tasks_per_node(value: str) -> list[int] | None:
    """``2(x3),1`` -> [2, 2, 2, 1]; None when it does not read that way."""
    counts: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts
