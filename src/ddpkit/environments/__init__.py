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
4. ``SLURMEnvironment`` (a task of an ``srun`` step; not ``salloc``'s shell nor ``sbatch``'s script,
   which run outside any step).
5. ``LSFEnvironment`` (``jsrun`` on LSF clusters).
6. ``KubeflowEnvironment`` (a PyTorchJob pod).
7. ``LocalEnvironment`` (the default: one node, processes started by ddpkit or by hand).

The more specific launcher comes first because it runs inside the broader allocation and
sets the variables that describe this very process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ddpkit._network import find_free_port  # here in 0.1; it binds, so it lives with the sockets
from ddpkit.environments.base import (
    ChoosesBackend,
    ClusterEnvironment,
    _ResolvedEnvironment,
    check_place,
    environment_variables,
    restart_count,
)
from ddpkit.environments.contract import LaunchContract, Recovery, RecoveryPolicy, launch_contract
from ddpkit.environments.kubeflow import KubeflowEnvironment
from ddpkit.environments.local import LocalEnvironment
from ddpkit.environments.lsf import LSFEnvironment
from ddpkit.environments.mpi import MPIEnvironment
from ddpkit.environments.slurm import SLURMEnvironment, expand_slurm_nodelist
from ddpkit.environments.torchelastic import TorchElasticEnvironment
from ddpkit.variables import DDPKIT_LAUNCHED

__all__ = [
    "ChoosesBackend",
    "ClusterEnvironment",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "LaunchContract",
    "LocalEnvironment",
    "MPIEnvironment",
    "Recovery",
    "RecoveryPolicy",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "check_place",
    "detect_environment",
    "environment_variables",
    "expand_slurm_nodelist",
    "find_free_port",
    "launch_contract",
    "restart_count",
]


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
