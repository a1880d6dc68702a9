"""What each worker of a node is told when ``ddpkit run`` (or in-script launching) starts it: its
variables (torch.distributed's, torchrun's, ddpkit's), the node's performance defaults, the job's
secret, the interface Gloo should use across nodes, and its command line. The launcher, in-script
launching, the in-place replacements and Lightning's strategy read it; it starts nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from ddpkit._allocator import MALLOC_DEFAULTS, malloc_chosen
from ddpkit._network import gloo_interface_towards
from ddpkit.launching.config import LaunchConfig, RunAs
from ddpkit.logs import get_logger
from ddpkit.store.job_secret import job_secret, new_job_secret
from ddpkit.variables import (
    DDPKIT_BACKEND,
    DDPKIT_HOSTED_STORE,
    DDPKIT_JOB_SECRET,
    DDPKIT_JOB_SECRET_FILE,
    DDPKIT_LAUNCHED,
    DDPKIT_PREEMPTION_SIGNAL,
)

__all__ = ["gloo_interface", "job_secret_for_workers", "performance_defaults", "rank_variables", "worker_command"]

_log = get_logger("launching")


def rank_variables(config: LaunchConfig, port: int, local_rank: int, restart_count: int = 0,
                   generation: int = 0) -> dict[str, str]:
    """What a worker of this node needs to find its place in the job: torch.distributed's
    variables, ddpkit's marker, the backend, and the recovery policy (``RecoveryPolicy``: which start
    of the workers this is, 0 the first, and the generation of the group it joins).

    torchrun's per-worker variables come too, with torchrun's meanings, so that scripts and
    frameworks written for it (Lightning's ``TorchElasticEnvironment``, ``GROUP_RANK`` readers) find
    theirs. ``TORCHELASTIC_USE_AGENT_STORE`` is ``True`` where the launchers host the store
    (``LaunchConfig.hosts_store``): torch's ``env://`` then connects to it as a client instead of making
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
        "ROLE_NAME": config.role,
        "ROLE_RANK": rank,
        "ROLE_WORLD_SIZE": str(config.world_size),
        DDPKIT_LAUNCHED: "1",
        **config.recovery_policy(restart_count, generation).variables(),
        "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
        "TORCHELASTIC_RUN_ID": config.rendezvous.run_id if config.rendezvous is not None else "none",
        "TORCHELASTIC_USE_AGENT_STORE": str(config.hosts_store),
        DDPKIT_PREEMPTION_SIGNAL: config.preemption_signal.name,
    }
    if config.hosts_store:
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


def job_secret_for_workers(across_nodes: bool, environment: Mapping[str, str]) -> dict[str, str]:
    """``DDPKIT_JOB_SECRET`` for the workers of a job whose user gave none in ``environment``: a new
    random one when the job is this node's alone (the workers inherit the user's otherwise). Across
    nodes every launcher needs the same one, which only the user can give them: without it the job
    runs unauthenticated, as before, and the launcher says so."""
    secret = job_secret(environment)
    if secret is not None:
        _log.info(f"ddpkit: the job's secret comes from {secret.source}.")
        return {}
    if not across_nodes:
        return {DDPKIT_JOB_SECRET: new_job_secret()}
    _log.warning(
        f"ddpkit: no job secret ({DDPKIT_JOB_SECRET} or {DDPKIT_JOB_SECRET_FILE}): the records in this job's store are "
        "not authenticated, so any process that reaches its port can end the job and name a rank as its cause. Give "
        f"every node the same secret: `export {DDPKIT_JOB_SECRET}=$(python -c 'import secrets; "
        "print(secrets.token_hex(32))')` where the job is submitted (the scheduler passes it on), or a file readable "
        f"only by you in {DDPKIT_JOB_SECRET_FILE}.")
    return {}


def gloo_interface(config: LaunchConfig, port: int, base: Mapping[str, str]) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` for the workers of a multi-node job, unless ``base`` (the user's
    environment) has it: the interface that routes to the master address (``ddpkit._network``
    says why Gloo's own choice fails across nodes). ddpkit's connection chooses the same; this is
    for scripts that connect with torch.distributed directly."""
    if config.nnodes < 2 or "GLOO_SOCKET_IFNAME" in base:
        return {}
    interface = gloo_interface_towards(config.master_addr, port)
    return {} if interface is None else {"GLOO_SOCKET_IFNAME": interface}


def worker_command(run_as: RunAs, script: str, script_args: Sequence[str]) -> list[str]:
    """The command line of each worker: ddpkit's bootstrap running the script (or module), or the program itself."""
    if run_as is RunAs.PROGRAM:
        return [script, *script_args]
    return [sys.executable, "-m", "ddpkit.workers.worker", *(["-m"] if run_as is RunAs.MODULE else []), script,
            *script_args]
