"""torchrun (torch elastic): per-process variables set by the agent."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ddpkit.environments.base import _int_var, _ResolvedEnvironment, check_place, restart_count
from ddpkit.environments.contract import LaunchContract, RecoveryPolicy

__all__ = ["TorchElasticEnvironment"]


class TorchElasticEnvironment(_ResolvedEnvironment):
    """Processes started by ``torchrun`` (torch.distributed.elastic)."""

    _REQUIRED = ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        fix = "These are set by torchrun: start the script with `torchrun --nproc-per-node N script.py`."
        self._read_torch_variables(env, fix)
        self._local_rank = _int_var(env, "LOCAL_RANK", fix)
        self._node_rank = _int_var(env, "GROUP_RANK", fix, default=0)
        values = {"rank": self._global_rank, "world": self._world_size, "local": self._local_rank}
        if env.get("LOCAL_WORLD_SIZE"):
            values["local_world"] = _int_var(env, "LOCAL_WORLD_SIZE", fix, minimum=1)
        names = {"rank": "RANK", "world": "WORLD_SIZE", "local": "LOCAL_RANK", "local_world": "LOCAL_WORLD_SIZE"}
        check_place(names, values, fix)
        #: torchrun's restart count when its agent's one store serves every attempt of a one-node
        #: job (the keys of the attempts before are still in it): init_dist_connection gives each
        #: attempt keys of its own. None otherwise: across nodes each agent counts its own
        #: restarts, and the counts can differ.
        self.store_attempt: int | None = None
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == str(True) and env.get("GROUP_WORLD_SIZE", "").strip() == "1":
            self.store_attempt = _int_var(env, "TORCHELASTIC_RESTART_COUNT", fix, default=0)
        #: What torchrun told this process: its restart count (and under its static rendezvous on one
        #: node, the attempt the job's records and store keys are bound to).
        self.launch_contract = LaunchContract(recovery=RecoveryPolicy(restart_count=restart_count(env)),
                                              attempt=self.store_attempt or 0, torchrun_store_attempt=self.store_attempt)

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> bool:
        env = os.environ if env is None else env
        return "TORCHELASTIC_RUN_ID" in env or all(name in env for name in cls._REQUIRED)


# ---------------------------------------------------------------------------------------------
# SLURM
