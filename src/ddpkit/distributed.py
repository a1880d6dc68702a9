"""Process-group connection and collectives (Lightning's ``utilities.distributed`` API), in one place.

The names live in ``ddpkit.membership.connection`` (connecting), ``ddpkit.comm.collectives`` (the collectives)
and ``ddpkit.hooks.registration`` (``register_ddp_comm_hook``); this module gathers them under
the name Lightning users know.
"""

from ddpkit.comm.collectives import (
    AllGatherGrad,
    ReduceOpLike,
    all_gather_ddp_if_available,
    all_gather_object,
    barrier,
    broadcast,
    broadcast_object,
    gather_all_tensors,
    sync_ddp,
    sync_ddp_if_available,
)
from ddpkit.hooks.registration import register_ddp_comm_hook
from ddpkit.membership.connection import (
    DEFAULT_TIMEOUT,
    destroy_dist_connection,
    distributed_available,
    get_rank,
    get_world_size,
    init_dist_connection,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "AllGatherGrad",
    "ReduceOpLike",
    "all_gather_ddp_if_available",
    "all_gather_object",
    "barrier",
    "broadcast",
    "broadcast_object",
    "destroy_dist_connection",
    "distributed_available",
    "gather_all_tensors",
    "get_rank",
    "get_world_size",
    "init_dist_connection",
    "register_ddp_comm_hook",
    "sync_ddp",
    "sync_ddp_if_available",
]
