"""ddpkit: data-parallel PyTorch training over many processes, GPUs and nodes.

The engine underneath is ``torch.distributed`` (Gloo on CPU, NCCL on GPU). Public pieces:
``ddpkit.DistributedDataParallel``, ``ddpkit.SyncBatchNorm``, ``ddpkit.distributed`` (connection and collectives),
``ddpkit.environments`` (SLURM, LSF, MPI, torchrun, Kubeflow, local), ``ddpkit.diagnostics.failures``
(``guard``: one rank's failure named on every rank) and ``ddpkit.testing`` (a multi-rank pool
for tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddpkit import _moved

# Public names are imported when first used, so that `ddpkit run` and a worker's bootstrap do not
# import the DDP module, the strategy or torch.distributed's collectives before the script runs.
_PUBLIC_NAMES = {
    "AllGatherGrad": "ddpkit.distributed",
    "ClusterEnvironment": "ddpkit.environments",
    "CollectiveFailedError": "ddpkit.diagnostics.failures",
    "DDPStrategy": "ddpkit.strategy",
    "DistributedDataParallel": "ddpkit.parallel.ddp",
    "LocalEnvironment": "ddpkit.environments",
    "PeerFailedError": "ddpkit.diagnostics.failures",
    "PeerLostError": "ddpkit.diagnostics.failures",
    "StoreHostGoneError": "ddpkit.diagnostics.failures",
    "SyncBatchNorm": "ddpkit.parallel.batchnorm",
    "all_gather_ddp_if_available": "ddpkit.distributed",
    "all_gather_object": "ddpkit.distributed",
    "barrier": "ddpkit.distributed",
    "broadcast": "ddpkit.distributed",
    "broadcast_object": "ddpkit.distributed",
    "destroy_dist_connection": "ddpkit.distributed",
    "detect_environment": "ddpkit.environments",
    "even_batches": "ddpkit.data",
    "gather_all_tensors": "ddpkit.distributed",
    "get_rank": "ddpkit.distributed",
    "get_world_size": "ddpkit.distributed",
    "guard": "ddpkit.diagnostics.failures",
    "init_dist_connection": "ddpkit.distributed",
    "launch": "ddpkit.launching.launcher",
    "register_ddp_comm_hook": "ddpkit.distributed",
    "sync_ddp": "ddpkit.distributed",
    "sync_ddp_if_available": "ddpkit.distributed",
}

_moved.install()

if TYPE_CHECKING:
    from ddpkit.data import even_batches
    from ddpkit.diagnostics.failures import (
        CollectiveFailedError,
        PeerFailedError,
        PeerLostError,
        StoreHostGoneError,
        guard,
    )
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
    from ddpkit.environments import (
        ClusterEnvironment,
        LocalEnvironment,
        detect_environment,
    )
    from ddpkit.launching.launcher import launch
    from ddpkit.parallel.batchnorm import SyncBatchNorm
    from ddpkit.parallel.ddp import DistributedDataParallel
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
    "PeerLostError",
    "StoreHostGoneError",
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


def __getattr__(name: str) -> Any:
    import importlib

    module_name = _PUBLIC_NAMES.get(name)
    if module_name is None:
        return _submodule(importlib, name)
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # found directly next time
    return value


def _submodule(importlib: Any, name: str) -> Any:
    """``ddpkit.<part>`` after a plain ``import ddpkit`` (0.1 imported every part with the package)."""
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"ddpkit.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"ddpkit.{name}":
                raise  # the part exists but needs something missing: say that, not "no attribute"
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
