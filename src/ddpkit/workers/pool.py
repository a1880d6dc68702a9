"""Functions run on several connected processes: the engine of ``launch(fn)`` and of
``ddpkit.testing.WorkerPool`` (whose docstring shows it in use).

The workers are started, ended and blamed by ``workers.processes``, like ``ddpkit run``'s: each
runs ``python -m ddpkit.workers.worker --serve-functions`` and talks to the pool over a pipe
of its own. It first receives the pool's setup: the parent's ``sys.path``, working directory and
main module, prepared as ``multiprocessing``'s spawn method prepares them (so a function defined
in the parent's script unpickles in the worker), then joins the process group through a
``FileStore`` in the pool's private folder (no ports, so parallel test runs cannot collide), and
runs each function it is sent until told to stop.

Like ``ddpkit run``'s, the workers are forked from a template that imported torch
(``workers.worker_template``) where they can be, with one template for every pool that this
process starts from its main thread: a pool after the first starts in a fork per rank, not in
an interpreter's start and torch's import per rank (seconds of CPU each; a test suite starts
many pools).
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import multiprocessing.spawn
import os
import pickle
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ddpkit.logs import get_logger
from ddpkit.process_state import PROCESS
from ddpkit.store import keys as store_keys
from ddpkit.variables import DDPKIT_POOL_CONNECTION  # the worker's end of its pipe, a file descriptor it inherits
from ddpkit.workers.processes import SERVE_FUNCTIONS, WorkerProcesses, describe_exit
from ddpkit.workers.worker_template import WorkerTemplate, forking_allowed

__all__ = ["RankFailedError", "RankTimeoutError", "WorkerPool", "serve"]

_log = get_logger("launching")

_STOP = b"stop"
# After a rank fails, how long the others get to answer or die before the root cause is named.
# A loaded 2-core machine can start the dying rank's work a few hundred milliseconds after the
# witness's: half a second was seen to be too short under a full test run.
_DEATH_GRACE_SECONDS = 1.0
# How often a run looks for workers that ended without closing their pipe (a child of theirs
# may hold it open).
_POLL_SECONDS = 0.05
# How long the workers may take to start and meet, whatever the process-group timeout: importing
# torch takes seconds on a loaded machine, and a short process-group timeout is there for the
# collectives of the functions, not for the start.
_MEET_SECONDS = 120.0


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


@dataclass(frozen=True)
class _Setup:
    """What a worker needs before it can run the pool's functions."""

    preparation: dict[str, Any]  # multiprocessing.spawn's description of the parent process
    rank: int
    world_size: int
    store_path: str
    pg_timeout: float
    threads: int
    backend: str


def serve() -> None:
    """Body of one pool worker: join the process group, then run what the parent sends until told to stop."""
    connection = multiprocessing.connection.Connection(int(os.environ.pop(DDPKIT_POOL_CONNECTION)))
    setup: _Setup = pickle.loads(connection.recv_bytes())
    multiprocessing.spawn.prepare(setup.preparation)

    import torch
    import torch.distributed as dist

    from ddpkit.diagnostics.failures import record_exception
    from ddpkit.membership.connection import destroy_dist_connection

    torch.set_num_threads(setup.threads)
    if setup.backend == "nccl":
        torch.cuda.set_device(setup.rank % torch.cuda.device_count())  # one GPU per process
    store = dist.FileStore(setup.store_path, setup.world_size)  # type: ignore[attr-defined]  # not re-exported by the stubs
    store.set_timeout(timedelta(seconds=max(_MEET_SECONDS, setup.pg_timeout)))
    store.set(store_keys.pool_started(setup.rank), "1")
    store.wait([store_keys.pool_started(rank) for rank in range(setup.world_size)])
    dist.init_process_group(setup.backend, store=store, rank=setup.rank, world_size=setup.world_size,
                            timeout=timedelta(seconds=setup.pg_timeout))
    while True:
        try:
            message = connection.recv_bytes()
        except (EOFError, OSError):  # the parent is gone: nobody to answer
            os._exit(1)
        if message == _STOP:
            break
        try:
            function, args, kwargs = pickle.loads(message)
            payload = pickle.dumps(("ok", function(*args, **kwargs)))
        except BaseException as error:  # noqa: BLE001 - everything goes back to the parent
            record_exception(error, publish=False)  # for the parent's choice of the root cause
            payload = pickle.dumps(("error", "".join(traceback.format_exception(error))))
        connection.send_bytes(payload)
    destroy_dist_connection()
    connection.close()


class WorkerPool:
    """``world_size`` processes, connected by a process group, that run module-level functions on every rank.

    ``timeout`` is the default bound of one ``run`` call in seconds (``math.inf``: none);
    ``pg_timeout`` the process-group timeout inside the workers; ``threads`` the torch threads of
    each worker; ``backend`` "gloo" (CPU) or "nccl" (one GPU per process). The workers start at
    the first ``run`` and stay up between calls; when a run fails or times out they are killed,
    and the next ``run`` starts fresh ones.
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
        self._workers: WorkerProcesses | None = None
        self._connections: list[multiprocessing.connection.Connection] = []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self._workers is not None

    def _start(self) -> WorkerProcesses:
        workers = WorkerProcesses("pool", template=_template_of_this_process())
        preparation = multiprocessing.spawn.get_preparation_data("ddpkit-pool")
        preparation["authkey"] = bytes(preparation["authkey"])  # multiprocessing pickles it only while it spawns
        for rank in range(self.world_size):
            parent_end, worker_end = multiprocessing.Pipe()
            workers.start([sys.executable, "-m", "ddpkit.workers.worker", SERVE_FUNCTIONS], dict(os.environ),
                          rank=rank, local_rank=rank, handed={DDPKIT_POOL_CONNECTION: worker_end.fileno()})
            worker_end.close()
            setup = _Setup(preparation, rank, self.world_size, os.path.join(workers.folder, "store"),
                           self.pg_timeout, self.threads, self.backend)
            parent_end.send_bytes(pickle.dumps(setup))
            self._connections.append(parent_end)
        self._workers = workers
        return workers

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
        workers = self._workers or self._start()
        workers.forget_failures()  # a failure an earlier function caught is not this run's
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        for connection in self._connections:
            connection.send_bytes(payload)

        results: list[Any] = [None] * self.world_size
        failures: dict[int, str] = {}
        pending = set(range(self.world_size))
        answer_deadline = deadline
        while pending and time.monotonic() < answer_deadline:
            wait = min(_POLL_SECONDS, max(0.0, answer_deadline - time.monotonic()))
            multiprocessing.connection.wait([self._connections[rank] for rank in pending], timeout=wait)
            for rank in sorted(pending):
                answer = self._answer(workers, rank)
                if answer is None:
                    continue
                pending.discard(rank)
                status, value = answer
                if status == "ok":
                    results[rank] = value
                    continue
                if not failures:  # the others get a moment to show whether they failed first
                    answer_deadline = min(answer_deadline, time.monotonic() + _DEATH_GRACE_SECONDS)
                failures[rank] = value
        if failures:
            failed = [workers.workers[rank] for rank in failures]
            cause, record = workers.root_cause(failed)
            details = str(record["traceback"]) if record is not None else failures[cause.rank]
            self._kill()
            raise RankFailedError(cause.rank, self.world_size, name, details)
        if pending:
            for worker, stacks in workers.stacks(sorted(pending)):
                _log.warning(f"--- stack of hung {worker} ---\n{stacks}")
            self._kill()
            raise RankTimeoutError(sorted(pending), name, limit)
        return results

    def _answer(self, workers: WorkerProcesses, rank: int) -> tuple[str, Any] | None:
        """What ``rank`` answered, a description of how its process ended, or None while it works."""
        connection, process = self._connections[rank], workers.workers[rank].process
        try:
            if connection.poll():
                answer: tuple[str, Any] = pickle.loads(connection.recv_bytes())
                return answer
        except (EOFError, OSError):
            pass
        else:
            if process.poll() is None:
                return None
        try:
            code = process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return "died", f"the worker process {describe_exit(code)} without answering"

    def _kill(self) -> None:
        if self._workers is not None:
            self._workers.close(grace=0.0)
        for connection in self._connections:
            connection.close()
        self._workers, self._connections = None, []

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers cleanly (barrier, destroy), killing any that do not stop in ``timeout`` s."""
        if self._workers is None:
            return
        for connection in self._connections:
            try:
                connection.send_bytes(_STOP)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for worker in self._workers.workers:
            try:
                worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill()



def _template_of_this_process() -> WorkerTemplate | None:
    """The template the pools of this process fork their workers from, started with the first
    (``PROCESS.pool_templates``). None where workers cannot be forked (``forking_allowed``: a CUDA
    build of torch, ``DDPKIT_FORK_WORKERS=0``), and from a thread other than the main one: the
    kernel ends the template with the thread that started it (``PR_SET_PDEATHSIG``), and with it
    the workers of every pool; such a pool's workers start as fresh interpreters, which end with
    that thread."""
    if threading.current_thread() is not threading.main_thread() or forking_allowed(os.environ) is not None:
        return None
    template: WorkerTemplate | None = PROCESS.pool_templates.get(os.getpid())
    if template is None:
        template = PROCESS.pool_templates[os.getpid()] = WorkerTemplate(os.environ)
        atexit.register(template.close)
    return template
