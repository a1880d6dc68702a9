"""The peer watch: a thread that notices another rank's published failure even while this
rank's main thread is blocked in a call ddpkit cannot interrupt.

ddpkit's own collectives wait in slices and raise ``PeerFailedError`` by themselves
(``ddpkit.diagnostics.waits``). Two cases are left, and the watch handles them. It reads the
store's failure record every ``_READ_SECONDS``; under ``ddpkit run`` across nodes only when the
launcher's count of news changed, and every ``relayed_news.FALLBACK_SECONDS`` besides
(``diagnostics.relayed_news``; under NCCL with in-place recovery always, since a launcher's
record of a lost node is read here too):

- **NCCL.** A kernel waiting for a failed peer never returns until its communicator is
  aborted. When a peer's failure appears, the watch aborts this process's NCCL communicators
  at once (``torch.distributed``'s abort of the process groups), so every pending NCCL
  operation ends with an error, which ddpkit turns into ``PeerFailedError``. Under in-place
  recovery the same happens when a rank's loss is announced (a SIGKILLed peer closes nothing that
  NCCL notices: its launcher says so in the store, ``ddpkit.membership.generations.announce_node_lost``), and
  the error becomes ``PeerLostError``: the survivors form the next generation.
- **The store's host is gone** (rank 0 killed without a word): the read fails, and the watch
  makes ddpkit's waits raise ``StoreHostGoneError`` (and aborts NCCL communicators).
- **A call of the user's own** (``torch.distributed.all_reduce(t)`` without ddpkit) blocks in
  Gloo's C++ code, out of Python's reach. If ddpkit has not handed this process a
  ``PeerFailedError`` within ``DDPKIT_PEER_FAILURE_EXIT_SECONDS`` (default 1) after the failure
  appeared, the watch logs the failure and ends the process with exit code
  ``PEER_FAILED_EXIT_CODE``, as a launcher would end it. ``DDPKIT_PEER_FAILURE_EXIT_SECONDS=0``
  turns this off (the rank then waits for its call to fail, up to the process-group timeout);
  on Gloo the watch then does not run at all.

The watch starts with the process group (``init_dist_connection``, the DDP module, the first
ddpkit collective) and stops when that group is destroyed or replaced.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from typing import Any

import torch.distributed as dist

from ddpkit.diagnostics.exits import leave_on_uncaught_exception
from ddpkit.diagnostics.failures import (
    PeerFailedError,
    announced_loss,
    lost_peers_expected,
    peer_failure_raised,
    read_failure_record,
    record_exception,
    store_host_gone,
)
from ddpkit.diagnostics.relayed_news import FALLBACK_SECONDS, relayed_news
from ddpkit.diagnostics.settings import WORKER_SECONDS_SETTINGS, seconds_setting
from ddpkit.logs import get_logger
from ddpkit.process_state import PROCESS
from ddpkit.variables import DDPKIT_PEER_FAILURE_EXIT_SECONDS

__all__ = ["PEER_FAILED_EXIT_CODE", "abort_nccl_communicators", "watch_peers"]

_log = get_logger("diagnostics")

# The exit code of a rank the watch ended because a peer failed (sysexits' EX_UNAVAILABLE: the
# service, here the group, is gone). Distinct from 1, the code of the rank that failed itself.
PEER_FAILED_EXIT_CODE = 69
# How often the watch reads the store: one small request per rank, four times a second.
_READ_SECONDS = 0.25
_DEFAULT_EXIT_SECONDS = 1.0


class _PeerWatch:
    def __init__(self, group: Any, store: Any) -> None:
        # A weak reference: a strong one would keep the group's connections open after it is destroyed.
        self.group, self.store = weakref.ref(group), store
        self.rank = dist.get_rank()
        self.backend = dist.get_backend()
        self._thread = threading.Thread(target=self._run, name="ddpkit-peer-watch", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        return self._thread.is_alive()

    def _current(self) -> bool:
        group = self.group()
        return group is not None and dist.is_initialized() and dist.distributed_c10d._get_default_group() is group

    def _run(self) -> None:
        news, read_at = relayed_news(), 0.0
        while True:
            time.sleep(_READ_SECONDS)
            if not self._current():
                return
            if (news is not None and not (self.backend == "nccl" and lost_peers_expected()) and not news.changed()
                    and time.monotonic() - read_at < FALLBACK_SECONDS):
                continue  # nothing new, by the launcher's word
            read_at = time.monotonic()
            try:
                record = read_failure_record(self.store, timeout=None)  # see read_failure_record
            except RuntimeError:
                if self._current() and store_host_gone() is not None:
                    self._on_store_host_gone()
                    return
                continue
            if record is not None and int(record["rank"]) != self.rank:
                self._on_peer_failure(record)
                return
            if self.backend == "nccl" and (lost := announced_loss(self.store)) is not None:
                _log.warning(f"ddpkit: {lost}: aborting this rank's NCCL communicators")
                abort_nccl_communicators()  # the pending kernels end with an error: the recovery begins
                return

    def _on_store_host_gone(self) -> None:
        """Rank 0 (the store's host) is gone: ddpkit's waits raise ``StoreHostGoneError`` from now
        on (``failures.store_host_gone`` remembers it). The process is not ended: a rank 0 that
        finished its script and exited looks the same from here, and a call of the user's own
        fails by itself, since rank 0's connections are closed; that exception, uncaught, must not
        wait for the interpreter's finalisation (``exits``)."""
        leave_on_uncaught_exception()
        if self.backend == "nccl":
            abort_nccl_communicators()

    def _on_peer_failure(self, record: dict[str, Any]) -> None:
        failure = PeerFailedError.from_record(record)
        if self.backend == "nccl":
            abort_nccl_communicators()
        seconds = _exit_seconds()
        if seconds <= 0:
            return
        if peer_failure_raised(within=seconds):
            return  # ddpkit raised it in the main thread: the user's code decides what follows
        _log.error(f"{failure}\nddpkit: ending rank {self.rank} (exit code {PEER_FAILED_EXIT_CODE}): it did not "
                   f"get to a ddpkit call that raises this within {seconds:g} s of the failure (it is blocked in a "
                   "call ddpkit cannot interrupt, e.g. torch.distributed's own, or still computing). Set "
                   f"{DDPKIT_PEER_FAILURE_EXIT_SECONDS}=0 to keep it running instead.")
        # For the launcher; the failed rank's own record is earlier, and stays the root cause.
        record_exception(failure, publish=False)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(PEER_FAILED_EXIT_CODE)


def abort_nccl_communicators() -> None:
    """Abort every NCCL communicator of this process, so that kernels waiting for the failed peer
    return with an error (torch documents abort as the way to unblock pending NCCL operations)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort is not None:
            abort()
        else:
            group = dist.group.WORLD
            if group is not None:
                group.abort()
    except Exception as error:  # noqa: BLE001 - a best effort; the exit below still ends the rank
        _log.warning(f"ddpkit: aborting the NCCL communicators after a peer's failure failed: {error}")


def _exit_seconds() -> float:
    """``DDPKIT_PEER_FAILURE_EXIT_SECONDS``: how long a rank whose peer failed may go on without
    ddpkit raising ``PeerFailedError`` in it before the watch ends it (0: never)."""
    return seconds_setting(DDPKIT_PEER_FAILURE_EXIT_SECONDS, _DEFAULT_EXIT_SECONDS,
                           WORKER_SECONDS_SETTINGS[DDPKIT_PEER_FAILURE_EXIT_SECONDS])


def watch_peers() -> None:
    """Start the peer watch for the current default process group, unless it runs already. Cheap
    when it does: called at every ddpkit collective."""
    watch = PROCESS.peer_watch
    if watch is not None and watch.running() and watch.group() is _default_group():
        return
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    if _exit_seconds() <= 0 and dist.get_backend() != "nccl":
        return  # nothing for it to do (and a malformed setting raised here, in the caller's thread)
    with PROCESS.peer_watch_lock:
        group = _default_group()
        watch = PROCESS.peer_watch
        if watch is None or not watch.running() or watch.group() is not group:
            PROCESS.peer_watch = _PeerWatch(group, dist.distributed_c10d._get_default_store())


def _default_group() -> Any:
    try:
        return dist.distributed_c10d._get_default_group()
    except (RuntimeError, ValueError):
        return None
