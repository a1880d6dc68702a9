"""A pool of Gloo worker processes for testing multi-rank code, public so users can test theirs.

    from ddpkit.testing import WorkerPool

    def allreduce_ones() -> float:          # module level, so workers can import it
        t = torch.ones(1)
        torch.distributed.all_reduce(t)
        return t.item()

    with WorkerPool(2) as pool:
        assert pool.run(allreduce_ones) == [2.0, 2.0]

The workers start once (spawn), meet through a ``FileStore`` in a private temporary folder
(no ports, so parallel test runs cannot collide), run with one thread each and a short
process-group timeout, and stay up between calls. ``run`` is bounded in time: when a rank
raises, dies, or does not answer within ``timeout`` seconds, the whole pool is killed at once
(the other ranks are likely stuck in a collective), ``RankFailedError`` or ``RankTimeoutError``
carries that rank's traceback or the stacks of the ranks that hung, and the next ``run``
starts a fresh pool.
"""

from __future__ import annotations

import faulthandler
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ddpkit.launching.processes import describe_exit
from ddpkit.logs import get_logger

__all__ = ["RankFailedError", "RankTimeoutError", "WorkerPool"]

_log = get_logger("testing")

_STOP = b"stop"
# How long a rank's error waits for a peer's death to be seen before the error is reported. A
# loaded 2-core machine can start the dying rank's work a few hundred milliseconds after the
# witness's: half a second was seen to be too short under a full test run.
_DEATH_GRACE_SECONDS = 1.0


class RankFailedError(RuntimeError):
    """A rank raised or died while running a function of ``WorkerPool.run``."""

    def __init__(self, rank: int, world_size: int, function: str, details: str) -> None:
        super().__init__(f"rank {rank} of {world_size} failed in {function}:\n{details}")
        self.rank = rank
        self.details = details


class RankTimeoutError(TimeoutError):
    """Some ranks did not finish within the time ``WorkerPool.run`` allowed."""

    def __init__(self, ranks: list[int], function: str, timeout: float) -> None:
        super().__init__(
            f"rank(s) {ranks} did not finish {function} within {timeout:g} s; the pool was killed. "
            "Their Python stacks were written to stderr just before."
        )
        self.ranks = ranks


def _worker_main(rank: int, world_size: int, store_path: str, pg_timeout: float, threads: int,
                 conn: multiprocessing.connection.Connection, backend: str = "gloo") -> None:
    """Body of one worker: join the process group, then run what the parent sends until told to stop."""
    import torch
    import torch.distributed as dist

    from ddpkit.connection import destroy_dist_connection

    torch.set_num_threads(threads)
    # On SIGUSR1 the parent asks for this worker's stack (it is about to kill a hung pool).
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # one GPU per process
    store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]  # not re-exported by the stubs
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone: nobody to answer
            os._exit(1)
        if message == _STOP:
            break
        try:
            function, args, kwargs = pickle.loads(message)
            reply = ("ok", function(*args, **kwargs))
            payload = pickle.dumps(reply)
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            payload = pickle.dumps(("error", traceback.format_exc()))
        conn.send_bytes(payload)
    destroy_dist_connection()
    conn.close()


class WorkerPool:
    """``world_size`` Gloo processes that run module-level functions on every rank.

    ``timeout`` is the default bound of one ``run`` call in seconds (``math.inf``: none);
    ``pg_timeout`` the process-group timeout inside the workers; ``threads`` the torch threads of
    each worker; ``backend`` "gloo" (CPU) or "nccl" (one GPU per process).
    """

    def __init__(self, world_size: int, timeout: float = 60.0, pg_timeout: float = 30.0, threads: int = 1,
                 backend: str = "gloo") -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be at least 1.")
        self.world_size = world_size
        self.timeout = timeout
        self.pg_timeout = pg_timeout
        self.threads = threads
        self.backend = backend
        self._processes: list[Any] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._tmpdir: str | None = None

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return bool(self._processes)

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._tmpdir = tempfile.mkdtemp(prefix="ddpkit-pool-")
        store_path = os.path.join(self._tmpdir, "store")
        for rank in range(self.world_size):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=_worker_main,
                args=(rank, self.world_size, store_path, self.pg_timeout, self.threads, child_end, self.backend),
                name=f"ddpkit-pool-rank{rank}", daemon=True,
            )
            process.start()
            child_end.close()
            self._processes.append(process)
            self._conns.append(parent_end)

    def run(self, function: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``function(*args, **kwargs)`` on every rank; return each rank's result, by rank."""
        name = getattr(function, "__qualname__", repr(function))
        try:
            payload = pickle.dumps((function, args, kwargs))
        except Exception as error:
            raise TypeError(
                f"WorkerPool.run cannot send {name} to the workers ({error}). Use a module-level function "
                "and picklable arguments (no lambdas or local functions)."
            ) from error
        if not self.running:
            self._start()
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        for conn in self._conns:
            conn.send_bytes(payload)

        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._dump_stacks(sorted(pending))
                self._kill()
                raise RankTimeoutError(sorted(pending), name, limit)
            waitables: dict[Any, int] = {}
            for rank in pending:
                waitables[self._conns[rank]] = rank
                waitables[self._processes[rank].sentinel] = rank
            bound = None if math.isinf(remaining) else remaining
            for ready in multiprocessing.connection.wait(list(waitables), timeout=bound):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                status, value = self._receive(rank)
                if status != "ok":
                    if status != "died":
                        rank, value = self._dead_peer(rank, pending) or (rank, value)
                    self._kill()
                    raise RankFailedError(rank, self.world_size, name, value)
                results[rank] = value
                pending.discard(rank)
        return results

    def _dead_peer(self, failed: int, pending: set[int]) -> tuple[int, str] | None:
        """A rank whose collective failed is often only the witness of a peer that died (its
        connection was reset): name a pending rank whose process ended instead, if one does
        within a short grace. Its death came first, but the two are seen in either order."""
        sentinels = {self._processes[rank].sentinel: rank for rank in pending if rank != failed}
        for ready in multiprocessing.connection.wait(list(sentinels), timeout=_DEATH_GRACE_SECONDS):
            dead = sentinels[ready]
            status, value = self._receive(dead)
            if status != "ok":  # it did not finish its work first
                return dead, value
        return None

    def _receive(self, rank: int) -> tuple[str, Any]:
        """The reply of ``rank``, or a description of how its process ended."""
        conn, process = self._conns[rank], self._processes[rank]
        try:
            if conn.poll():
                reply: tuple[str, Any] = pickle.loads(conn.recv_bytes())
                return reply
        except (EOFError, OSError):
            pass
        process.join(timeout=5)
        return "died", f"the worker process {describe_exit(process.exitcode)} without answering"

    def _dump_stacks(self, ranks: list[int]) -> None:
        for rank in ranks:
            process = self._processes[rank]
            if process.is_alive() and process.pid is not None:
                _log.warning(f"--- stack of hung rank {rank} (pid {process.pid}) ---")
                os.kill(process.pid, signal.SIGUSR1)
                time.sleep(0.2)  # let faulthandler write before the kill

    def _kill(self) -> None:
        for process in self._processes:
            if process.is_alive():
                process.kill()
        for process in self._processes:
            process.join(timeout=5)
        self._forget()

    def _forget(self) -> None:
        for conn in self._conns:
            conn.close()
        self._processes, self._conns = [], []
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers cleanly (barrier, destroy), killing any that do not stop in ``timeout`` s."""
        if not self.running:
            return
        for conn in self._conns:
            try:
                conn.send_bytes(_STOP)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for process in self._processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()
