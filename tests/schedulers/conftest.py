"""The fixtures of the real-scheduler tests; what they bring up is in clusters.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .clusters import MPI, SlurmCluster, chosen_mpi, slurm_cluster


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A one-node Slurm cluster of the test session's own, stopped at its end."""
    yield from slurm_cluster(tmp_path_factory)


@pytest.fixture(params=["openmpi", "mpich"])
def mpi(request: pytest.FixtureRequest, tmp_path: Path) -> MPI:
    """Open MPI's and MPICH's mpirun, each first on PATH as ``mpirun``."""
    return chosen_mpi(str(request.param), tmp_path)
