"""Waiting for a collective without staying stuck behind a peer that failed and lives on.

A rank that fails publishes its failure in the store (``ddpkit.diagnostics.failures``). Its
connections stay open while anything in its process still holds the process group (an optimizer
imports ``torch._dynamo``, which does), so on Gloo a peer's blocking collective would wait until
the failed process exits or the process-group timeout. ddpkit therefore starts its collectives
asynchronously and waits for them in slices of ``SLICE``; between slices it reads the store and
raises ``PeerFailedError`` naming the failed rank. A Gloo work waited on with a timeout raises
"Operation timed out!" when the slice ends and can be waited on again.

On NCCL a wait with a timeout is not a slice (a timed-out NCCL work is treated as failed and
its communicator aborted), and waiting does not block the CPU anyway: NCCL works are waited on
plainly, and the peer watch (``peer_watch.watch_peers``) aborts the communicators when a peer
fails, which makes their pending kernels end with an error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpkit.diagnostics.failures import StoreHostGoneError, peer_failure, raising

__all__ = ["SLICE", "run_collective", "wait_for"]

# Short enough that a peer's failure is raised well within a second; each slice that ends
# unfinished costs one read of the store.
SLICE = timedelta(seconds=0.1)
# What Gloo's Work.wait(timeout) raises when the time is up and the work goes on.
_SLICE_ENDED = "Operation timed out"


def wait_for(pending: Any, group: Any = None, within: float | None = None) -> Any:
    """Wait for ``pending`` (a ``torch.distributed`` Work or a ``torch.futures.Future``) and return
    what its ``wait()`` returns; raise ``PeerFailedError`` as soon as another rank has published
    its failure. ``within``: seconds after which a Gloo work still pending raises ``TimeoutError``
    (it stays pending: the caller leaves the group)."""
    if _is_nccl(group):
        return pending.wait()
    if not isinstance(pending, dist.Work):  # a future (torch's, or the C++ one that Work.get_future returns)
        return _wait_for_future(pending)
    deadline = None if within is None else time.monotonic() + within
    while True:
        try:
            return pending.wait(timeout=SLICE)
        except RuntimeError as error:
            if _SLICE_ENDED not in str(error):
                raise
        _raise_peer_failure(group)
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"a collective of the group did not complete within {within:g} s")


def run_collective(collective: Callable[..., Any], *args: Any, group: Any = None, **kwargs: Any) -> Any:
    """``collective(*args, group=group, async_op=True, **kwargs)`` (a ``torch.distributed``
    collective), waited for with ``wait_for``."""
    return wait_for(collective(*args, group=group, async_op=True, **kwargs), group)


def _wait_for_future(future: Any) -> Any:
    done = threading.Event()
    future.add_done_callback(lambda _future: done.set())
    while not done.wait(SLICE.total_seconds()):
        _raise_peer_failure(None)
    return future.wait()


def _raise_peer_failure(group: Any) -> None:
    failure = peer_failure()
    if failure is None:
        return
    if isinstance(failure, StoreHostGoneError) and failure.rank == 0 and not _includes_rank_zero(group):
        return  # rank 0 may have finished and left; this group's collective does not need it
    raise raising(failure)


def _includes_rank_zero(group: Any) -> bool:
    try:
        return group is None or 0 in dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        return True


def _is_nccl(group: Any) -> bool:
    try:
        return dist.get_backend(group) == "nccl"
    except (RuntimeError, ValueError):  # no process group (any more): the wait raises torch's own error
        return False
