"""ddpkit: data-parallel PyTorch training over many processes, GPUs and nodes.

The engine underneath is ``torch.distributed`` (Gloo on CPU, NCCL on GPU). Public pieces:
``ddpkit.DistributedDataParallel``, ``ddpkit.SyncBatchNorm``, ``ddpkit.distributed`` (connection and collectives),
``ddpkit.environments`` (SLURM, LSF, MPI, torchrun, Kubeflow, local), ``ddpkit.diagnostics.failures``
(``guard``: one rank's failure named on every rank) and ``ddpkit.testing`` (a multi-rank pool
for tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# The public names, by the module that holds them: imported when first used, so that `ddpkit run`
# and a worker's bootstrap do not import the DDP module, the strategy or torch.distributed's
# collectives before the script runs. ``__all__`` is derived from it; the imports for type
# checkers below re-export the same names (tests/test_architecture.py checks that they agree).
_PUBLIC = {
    "ddpkit.training.data": ("even_batches",),
    "ddpkit.diagnostics.failures": ("CollectiveFailedError", "PeerFailedError", "PeerLostError", "StoreHostGoneError",
                                    "guard"),
    "ddpkit.distributed": ("AllGatherGrad", "all_gather_ddp_if_available", "all_gather_object", "barrier", "broadcast",
                           "broadcast_object", "destroy_dist_connection", "gather_all_tensors", "get_rank",
                           "get_world_size", "init_dist_connection", "register_ddp_comm_hook", "sync_ddp",
                           "sync_ddp_if_available"),
    "ddpkit.environments": ("ClusterEnvironment", "LocalEnvironment", "detect_environment"),
    "ddpkit.launching.launcher": ("launch",),
    "ddpkit.parallel.batchnorm": ("SyncBatchNorm",),
    "ddpkit.parallel.ddp": ("DistributedDataParallel",),
    "ddpkit.training.replicas": ("ReplicaMismatchError",),
    "ddpkit.training.strategy": ("DDPStrategy",),
    "ddpkit.training.state": ("Stateful", "UntrackedStateError"),
}
_MODULE_OF = {name: module for module, names in _PUBLIC.items() for name in names}

__version__ = "0.1.0"
__all__ = sorted(_MODULE_OF)  # derived from _PUBLIC

if TYPE_CHECKING:
    from ddpkit.diagnostics.failures import CollectiveFailedError as CollectiveFailedError
    from ddpkit.diagnostics.failures import PeerFailedError as PeerFailedError
    from ddpkit.diagnostics.failures import PeerLostError as PeerLostError
    from ddpkit.diagnostics.failures import StoreHostGoneError as StoreHostGoneError
    from ddpkit.diagnostics.failures import guard as guard
    from ddpkit.distributed import AllGatherGrad as AllGatherGrad
    from ddpkit.distributed import all_gather_ddp_if_available as all_gather_ddp_if_available
    from ddpkit.distributed import all_gather_object as all_gather_object
    from ddpkit.distributed import barrier as barrier
    from ddpkit.distributed import broadcast as broadcast
    from ddpkit.distributed import broadcast_object as broadcast_object
    from ddpkit.distributed import destroy_dist_connection as destroy_dist_connection
    from ddpkit.distributed import gather_all_tensors as gather_all_tensors
    from ddpkit.distributed import get_rank as get_rank
    from ddpkit.distributed import get_world_size as get_world_size
    from ddpkit.distributed import init_dist_connection as init_dist_connection
    from ddpkit.distributed import register_ddp_comm_hook as register_ddp_comm_hook
    from ddpkit.distributed import sync_ddp as sync_ddp
    from ddpkit.distributed import sync_ddp_if_available as sync_ddp_if_available
    from ddpkit.environments import ClusterEnvironment as ClusterEnvironment
    from ddpkit.environments import LocalEnvironment as LocalEnvironment
    from ddpkit.environments import detect_environment as detect_environment
    from ddpkit.launching.launcher import launch as launch
    from ddpkit.parallel.batchnorm import SyncBatchNorm as SyncBatchNorm
    from ddpkit.parallel.ddp import DistributedDataParallel as DistributedDataParallel
    from ddpkit.training.data import even_batches as even_batches
    from ddpkit.training.replicas import ReplicaMismatchError as ReplicaMismatchError
    from ddpkit.training.state import Stateful as Stateful
    from ddpkit.training.state import UntrackedStateError as UntrackedStateError
    from ddpkit.training.strategy import DDPStrategy as DDPStrategy


# Subpackages reachable as attributes after ``import ddpkit`` (``ddpkit.lightning.DDPStrategy()``),
# imported when first used; Lightning's needs Lightning installed.
_SUBPACKAGES = ("diagnostics", "distributed", "environments", "lightning", "testing")


def __getattr__(name: str) -> Any:
    import importlib

    if name in _SUBPACKAGES:
        # ddpkit.lightning without Lightning raises ImportError saying what to install.
        return importlib.import_module(f"ddpkit.{name}")
    module_name = _MODULE_OF.get(name)
    if module_name is None:
        raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # found directly next time
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
