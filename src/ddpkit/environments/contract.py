"""What a launcher tells its workers beyond their place in the world, read in one place: the
attempt (its count of starts of the workers), the generation of the group a process joins, the
recovery it runs with, whether it hosts the job's store, and the backend it chose.

``ddpkit run`` says all of it (``LocalEnvironment`` reads its variables); torchrun says the attempt
(``TORCHELASTIC_RESTART_COUNT``, under its static rendezvous only, where its store is handed to
every attempt); any other environment says nothing, and the defaults hold. The connection, the
strategy and the loop read ``launch_contract(environment)`` instead of asking each environment's
type or attributes themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.environments.base import ChoosesBackend, ClusterEnvironment, Recovery
from ddpkit.environments.local import LocalEnvironment
from ddpkit.environments.torchelastic import TorchElasticEnvironment

__all__ = ["LaunchContract", "launch_contract"]


@dataclass(frozen=True)
class LaunchContract:
    """The launcher's facts for this process (the defaults: no launcher of ddpkit's)."""

    attempt: int = 0  # which start of the workers this is: records are bound to it
    generation: int = 0  # the generation of the group this process joins (> 0: it replaces a lost rank)
    recovery: Recovery = Recovery.FAIL_FAST  # ``ddpkit run --recovery``
    hosted_store: bool = False  # the launcher keeps the job's store (it outlives every rank and attempt)
    backend: str | None = None  # ``ddpkit run --backend``; None: the connection chooses
    # torchrun's static rendezvous: the attempt whose keys of its own the ranks meet under; None otherwise
    torchrun_store_attempt: int | None = None

    @property
    def in_place(self) -> bool:
        return self.recovery is Recovery.IN_PLACE


def launch_contract(environment: ClusterEnvironment) -> LaunchContract:
    """The facts ``environment``'s launcher gave this process."""
    backend = environment.backend if isinstance(environment, ChoosesBackend) else None
    if isinstance(environment, LocalEnvironment):
        return LaunchContract(attempt=environment.attempt, generation=environment.generation,
                              recovery=environment.recovery, hosted_store=environment.hosted_store, backend=backend)
    if isinstance(environment, TorchElasticEnvironment):
        attempt = environment.store_attempt
        return LaunchContract(attempt=attempt or 0, backend=backend, torchrun_store_attempt=attempt)
    return LaunchContract(backend=backend)
