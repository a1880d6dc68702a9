"""ddpkit's cluster environments as Lightning sees them: ``DdpkitEnvironment`` answers Lightning's
``ClusterEnvironment`` questions from the environment ddpkit detected (``ddpkit run``, torchrun,
SLURM, LSF, MPI, Kubeflow, or none: Lightning then starts the local ranks itself)."""

from __future__ import annotations

from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment as LightningClusterEnvironment

from ddpkit._network import find_free_port
from ddpkit.environments import ClusterEnvironment, detect_environment

__all__ = ["DdpkitEnvironment"]


class DdpkitEnvironment(LightningClusterEnvironment):
    """Lightning's view of ``environment`` (by default ``ddpkit.detect_environment()``).

    Where the processes come from a launcher or a scheduler, their place is the environment's, and
    a Trainer whose ``devices`` and ``num_nodes`` make another world is refused before anything
    connects. Where they do not (``python train.py`` with ``devices=N``), Lightning starts the
    local ranks and sets each one's place, as with its own environment, at a port chosen here."""

    def __init__(self, environment: ClusterEnvironment | None = None) -> None:
        super().__init__()
        self.environment = environment if environment is not None else detect_environment()
        self._world_size = self.environment.world_size()
        self._global_rank = self.environment.global_rank()
        self._port = self.environment.main_port
        if self._port == 0 and not self.environment.creates_processes_externally:
            # Nobody chose one: Lightning's launcher hands this one to the ranks it starts.
            self._port = find_free_port()

    @property
    def creates_processes_externally(self) -> bool:
        return self.environment.creates_processes_externally

    @property
    def main_address(self) -> str:
        return self.environment.main_address

    @property
    def main_port(self) -> int:
        return self._port

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return self._world_size

    def set_world_size(self, size: int) -> None:
        self._world_size = size

    def global_rank(self) -> int:
        return self._global_rank

    def set_global_rank(self, rank: int) -> None:
        self._global_rank = rank

    def local_rank(self) -> int:
        return self.environment.local_rank()

    def node_rank(self) -> int:
        return self.environment.node_rank()

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """A launcher's or scheduler's world must be the Trainer's: ``devices`` per node times ``num_nodes``."""
        if not self.creates_processes_externally:
            return
        world = self.environment.world_size()
        if num_devices * num_nodes != world:
            raise ValueError(
                f"Trainer(devices={num_devices}, num_nodes={num_nodes}) makes a world of {num_devices * num_nodes} "
                f"processes, but {type(self.environment).__name__} started {world} (WORLD_SIZE). Give the Trainer "
                "the launcher's numbers: devices=--nproc-per-node and num_nodes=--nnodes of `ddpkit run` (or your "
                "scheduler's tasks per node and nodes).")

    def __repr__(self) -> str:
        return f"DdpkitEnvironment({self.environment!r})"
