#!/bin/bash
# Train with whichever MPI's mpirun is first on PATH (Open MPI, MPICH, Intel MPI), one process per
# rank; no mpi4py needed, ddpkit reads the ranks mpirun gives each process.
# Run from the repository: NPROC=2 examples/mpi/train.sh [train.py's options]
# On one node nothing else is needed. Across nodes, give every rank rank 0's host (and with MPICH,
# which sets no job id, a port): Open MPI `mpirun -x MASTER_ADDR=host0 ...`, MPICH
# `mpirun -genv MASTER_ADDR host0 -genv MASTER_PORT 29500 ...`.
exec mpirun -np "${NPROC:-2}" python examples/train.py "$@"
