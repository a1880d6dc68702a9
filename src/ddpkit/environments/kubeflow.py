"""Kubeflow PyTorchJob pods."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ddpkit.environments.base import _ResolvedEnvironment, check_place

__all__ = ["KubeflowEnvironment"]


class KubeflowEnvironment(_ResolvedEnvironment):
    """A Kubeflow PyTorchJob: one process per pod, MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK set by the operator."""

    _REQUIRED = ("KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        fix = "These are set by the Kubeflow training operator for each pod of a PyTorchJob."
        self._read_torch_variables(env, fix)
        check_place({"rank": "RANK", "world": "WORLD_SIZE"}, {"rank": self._global_rank, "world": self._world_size}, fix)
        self._local_rank = 0
        self._node_rank = self._global_rank

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> bool:
        env = os.environ if env is None else env
        return all(name in env for name in cls._REQUIRED)
