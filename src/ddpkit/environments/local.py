"""One node, or nodes joined by hand: processes started by ddpkit or by the user."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ddpkit.environments.base import (
    _first_of,
    _int_var,
    _port_var,
    _ResolvedEnvironment,
    check_place,
)
from ddpkit.environments.contract import LaunchContract, RecoveryPolicy
from ddpkit.variables import DDPKIT_BACKEND, DDPKIT_HOSTED_STORE, DDPKIT_LAUNCHED

__all__ = ["LocalEnvironment"]


class LocalEnvironment(_ResolvedEnvironment):
    """One node (or nodes joined by hand with MASTER_ADDR), processes started by ddpkit or the user.

    Reads the torch.distributed variables when they are set, with single-process defaults:
    ``MASTER_ADDR`` (127.0.0.1), ``MASTER_PORT`` (0: not chosen; one process needs none, and
    processes started together get theirs from whoever starts them: ``ddpkit run``, in-script
    launching), ``WORLD_SIZE`` (1), ``RANK`` (``NODE_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``),
    ``LOCAL_RANK`` (0), ``LOCAL_WORLD_SIZE``, ``NODE_RANK``/``GROUP_RANK`` (0), and ``backend``
    from ``DDPKIT_BACKEND`` (set by ``ddpkit run --backend``), and the rest of what ``ddpkit run``
    tells its workers as ``launch_contract``: the recovery policy (``RecoveryPolicy.read``) and
    whether the launcher hosts the store (``DDPKIT_HOSTED_STORE``: under in-place recovery, or when
    several nodes restart together). Like every environment it only reads: it binds no port.
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        fix = "Set the variable correctly, or unset it to use the single-process default."
        self._main_address = env.get("MASTER_ADDR", "").strip() or "127.0.0.1"
        self._main_port = _port_var(env, "MASTER_PORT", default=0)  # 0 when unset: not chosen
        self._backend = env.get(DDPKIT_BACKEND, "").strip() or None
        self._world_size = _int_var(env, "WORLD_SIZE", fix, default=1, minimum=1)
        self._local_rank = _int_var(env, "LOCAL_RANK", fix, default=0)
        node_var = _first_of(env, "NODE_RANK", "GROUP_RANK") or "NODE_RANK"
        self._node_rank = _int_var(env, node_var, fix, default=0)
        local_world = _int_var(env, "LOCAL_WORLD_SIZE", fix, default=0, minimum=1) if env.get("LOCAL_WORLD_SIZE") else None
        default_rank = self._node_rank * (local_world or 1) + self._local_rank
        self._global_rank = _int_var(env, "RANK", fix, default=default_rank)
        self._external = "LOCAL_RANK" in env or DDPKIT_LAUNCHED in env
        policy = RecoveryPolicy.read(env)
        #: What the launcher told this process (the store at MASTER_ADDR:MASTER_PORT is the launcher's
        #: when it hosts one: the ranks are its clients; generations count anew in each attempt).
        self.launch_contract = LaunchContract(
            recovery=policy, attempt=policy.restart_count, backend=self._backend,
            hosted_store=env.get(DDPKIT_HOSTED_STORE, "").strip() == "1" or policy.survivors_go_on)
        values = {"rank": self._global_rank, "world": self._world_size, "local": self._local_rank}
        if local_world is not None:
            values["local_world"] = local_world
        names = {"rank": "RANK", "world": "WORLD_SIZE", "local": "LOCAL_RANK", "local_world": "LOCAL_WORLD_SIZE"}
        check_place(names, values, fix)

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> bool:
        """Always true: the fallback when no scheduler is found."""
        return True
