"""ddpkit: data-parallel PyTorch training over many processes, GPUs and nodes.

The engine underneath is ``torch.distributed`` (Gloo on CPU, NCCL on GPU). Public pieces:
``ddpkit.DistributedDataParallel``, ``ddpkit.SyncBatchNorm``, ``ddpkit.distributed`` (connection and collectives),
``ddpkit.environments`` (SLURM, LSF, MPI, torchrun, Kubeflow, local), ``ddpkit.failures``
(``guard``: one rank's failure named on every rank) and ``ddpkit.testing`` (a multi-rank pool
for tests).
"""

from ddpkit.batchnorm import SyncBatchNorm
from ddpkit.data import even_batches
from ddpkit.ddp import DistributedDataParallel
from ddpkit.distributed import (
    AllGatherGrad,
    all_gather_ddp_if_available,
    all_gather_object,
    barrier,
    broadcast,
    broadcast_object,
    destroy_dist_connection,
    gather_all_tensors,
    get_rank,
    get_world_size,
    init_dist_connection,
    register_ddp_comm_hook,
    sync_ddp,
    sync_ddp_if_available,
)
from ddpkit.environments import ClusterEnvironment, LocalEnvironment, detect_environment
from ddpkit.failures import CollectiveFailedError, PeerFailedError, guard
from ddpkit.launcher import launch
from ddpkit.strategy import DDPStrategy

__version__ = "0.1.0"

__all__ = [
    "AllGatherGrad",
    "ClusterEnvironment",
    "CollectiveFailedError",
    "DDPStrategy",
    "DistributedDataParallel",
    "LocalEnvironment",
    "PeerFailedError",
    "SyncBatchNorm",
    "all_gather_ddp_if_available",
    "all_gather_object",
    "barrier",
    "broadcast",
    "broadcast_object",
    "destroy_dist_connection",
    "detect_environment",
    "even_batches",
    "gather_all_tensors",
    "get_rank",
    "get_world_size",
    "guard",
    "init_dist_connection",
    "launch",
    "register_ddp_comm_hook",
    "sync_ddp",
    "sync_ddp_if_available",
]
