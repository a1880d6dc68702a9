"""What a launcher tells its workers beyond their place in the world: the recovery policy (which
start of the workers this is, the generation of the group a process joins, how a lost worker is
recovered, how far the world may shrink), whether the launcher hosts the job's store, and the
backend it chose.

The policy is one type both sides read: ``ddpkit run`` writes ``RecoveryPolicy.variables()`` into
each worker's environment and the worker reads the same type back (``RecoveryPolicy.read``), so a
new fact the launcher tells its workers is one field here. ``ddpkit run``'s environment
(``LocalEnvironment``) and torchrun's say their contract (``TellsLaunchContract``); any other
environment says nothing, and the defaults hold. The connection, the strategy and the loop read
``launch_contract(environment)`` instead of asking each environment's type or attributes.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ddpkit.environments.base import ChoosesBackend, ClusterEnvironment, _int_var, restart_count
from ddpkit.variables import DDPKIT_GENERATION, DDPKIT_MIN_NODES, DDPKIT_RECOVERY, DDPKIT_RESTART_COUNT

__all__ = ["LaunchContract", "Recovery", "RecoveryPolicy", "TellsLaunchContract", "launch_contract"]


class Recovery(enum.Enum):
    """What a lost or failed worker costs: ``ddpkit run --recovery`` (DDPKIT_RECOVERY in the workers,
    its value), ``DDPStrategy(recovery=...)``."""

    #: The job ends, naming the root cause; with ``--max-restarts`` every worker starts again.
    FAIL_FAST = "fail-fast"
    #: A worker killed by a signal is replaced by a spare while the others go on (``ddpkit.training.recovery``).
    IN_PLACE = "in-place"

    @classmethod
    def parse(cls, value: str | Recovery, origin: str, fix: str) -> Recovery:
        """``value`` as a ``Recovery``; ``ValueError`` naming ``origin``, the value and ``fix`` otherwise."""
        try:
            return cls(value)
        except ValueError:
            choices = " or ".join(repr(choice.value) for choice in cls)
            raise ValueError(f"{origin}={value!r}: use {choices} ({fix}).") from None


@dataclass(frozen=True)
class RecoveryPolicy:
    """How this start of the workers recovers from a lost one, as the launcher says it.

    Example::

        >>> from ddpkit.environments import Recovery, RecoveryPolicy
        >>> policy = RecoveryPolicy(Recovery.IN_PLACE, restart_count=1, generation=2, min_nodes=1)
        >>> RecoveryPolicy.read(policy.variables()) == policy
        True
        >>> policy.may_shrink(nodes=2), policy.may_shrink(nodes=1)
        (True, False)
    """

    kind: Recovery = Recovery.FAIL_FAST
    #: Which start of the workers this is, 0 the first (``--max-restarts``): resume when above 0.
    restart_count: int = 0
    #: The generation of the group this process joins (above 0: it replaces a lost rank, in place).
    generation: int = 0
    #: ``--nnodes MIN:MAX``'s MIN: the fewest nodes the world may shrink to (None: it keeps its size).
    min_nodes: int | None = None

    @property
    def survivors_go_on(self) -> bool:
        """Whether the ranks that survive a loss keep their processes and form the group's next
        generation (else the job ends, or every worker starts again)."""
        return self.kind is Recovery.IN_PLACE

    @property
    def replaces_a_lost_rank(self) -> bool:
        """Whether this process takes a lost rank's place in a running world."""
        return self.survivors_go_on and self.generation > 0

    def may_shrink(self, nodes: int) -> bool:
        """Whether a world of ``nodes`` nodes may go on with fewer when one is lost."""
        return self.survivors_go_on and self.min_nodes is not None and nodes > self.min_nodes

    def variables(self) -> dict[str, str]:
        """The workers' environment variables that say it (torchrun's restart count too)."""
        variables = {DDPKIT_RECOVERY: self.kind.value, DDPKIT_RESTART_COUNT: str(self.restart_count),
                     "TORCHELASTIC_RESTART_COUNT": str(self.restart_count), DDPKIT_GENERATION: str(self.generation)}
        if self.min_nodes is not None:
            variables[DDPKIT_MIN_NODES] = str(self.min_nodes)
        return variables

    @classmethod
    def read(cls, env: Mapping[str, str]) -> RecoveryPolicy:
        """The policy ``variables()`` wrote into ``env`` (a default for each one missing);
        ``ValueError`` naming a malformed one."""
        fix = "ddpkit run sets it; unset it if you set it yourself"
        kind = Recovery.parse(env.get(DDPKIT_RECOVERY, "").strip() or Recovery.FAIL_FAST, DDPKIT_RECOVERY, fix)
        min_nodes = _int_var(env, DDPKIT_MIN_NODES, fix, minimum=1) if env.get(DDPKIT_MIN_NODES, "").strip() else None
        return cls(kind, restart_count(env), _int_var(env, DDPKIT_GENERATION, fix, default=0), min_nodes)


@dataclass(frozen=True)
class LaunchContract:
    """The launcher's facts for this process (the defaults: no launcher of ddpkit's)."""

    recovery: RecoveryPolicy = field(default_factory=RecoveryPolicy)
    # The attempt the job's records are bound to: the restart count where one launcher counts the
    # job's starts (``ddpkit run``; torchrun on one node); 0 where each node counts its own.
    attempt: int = 0
    hosted_store: bool = False  # the launcher keeps the job's store (it outlives every rank and attempt)
    backend: str | None = None  # ``ddpkit run --backend``; None: the connection chooses
    # torchrun's static rendezvous: the attempt whose keys of its own the ranks meet under; None otherwise
    torchrun_store_attempt: int | None = None

    @property
    def generation(self) -> int:
        return self.recovery.generation


@runtime_checkable
class TellsLaunchContract(Protocol):
    """An environment whose launcher is ddpkit's or torchrun's: it read the contract."""

    @property
    def launch_contract(self) -> LaunchContract: ...


def launch_contract(environment: ClusterEnvironment) -> LaunchContract:
    """The facts ``environment``'s launcher gave this process. An environment that does not say
    them (Slurm's, Lightning's own) gets the defaults, with the restart count that ddpkit run or
    torchrun put in this process's variables."""
    if isinstance(environment, TellsLaunchContract):
        return environment.launch_contract
    backend = environment.backend if isinstance(environment, ChoosesBackend) else None
    return LaunchContract(recovery=RecoveryPolicy(restart_count=restart_count(os.environ)), backend=backend)
