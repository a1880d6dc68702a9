"""Every ``DDPKIT_*`` environment variable, named once: what the launcher tells its workers, and
the settings a user gives. Imports nothing (the launcher, the workers, the environments and the
diagnostics all read it); the other modules say what each value means where they use it.
"""

from __future__ import annotations

__all__ = [
    "DDPKIT_BACKEND", "DDPKIT_CHECK_REPLICAS", "DDPKIT_DEBUG", "DDPKIT_ERROR_FILE", "DDPKIT_FORK_WORKERS", "DDPKIT_GENERATION",
    "DDPKIT_HANG_ABORT_SECONDS", "DDPKIT_HANG_SECONDS", "DDPKIT_HOSTED_STORE", "DDPKIT_JOB_SECRET",
    "DDPKIT_JOB_SECRET_FILE", "DDPKIT_LAUNCHED", "DDPKIT_LAUNCHER_PID", "DDPKIT_LOG_LEVEL", "DDPKIT_METRICS_FILE",
    "DDPKIT_METRICS_SECONDS", "DDPKIT_MIN_NODES", "DDPKIT_NCCL_IN_PLACE", "DDPKIT_NEWS_FILE",
    "DDPKIT_PEER_FAILURE_EXIT_SECONDS", "DDPKIT_POOL_CONNECTION", "DDPKIT_PREEMPTION_SIGNAL", "DDPKIT_READY_FILE",
    "DDPKIT_RECOVERY", "DDPKIT_RECOVERY_TIMEOUT_SECONDS", "DDPKIT_RESTART_COUNT", "DDPKIT_STACK_FILE",
    "DDPKIT_STDERR_PREFIXED", "DDPKIT_STORE_BIND", "DDPKIT_TEMPLATE_SOCKET", "launcher_flag_variable",
]

# What ``ddpkit run`` (and in-script launching, and the function pool) tells each worker.

#: Set in every worker ddpkit starts: its variables win over an inherited scheduler's (``detect_environment``).
DDPKIT_LAUNCHED = "DDPKIT_LAUNCHED"
#: Which start of the workers this is, 0 the first (``--max-restarts``; torchrun's ``TORCHELASTIC_RESTART_COUNT`` too).
DDPKIT_RESTART_COUNT = "DDPKIT_RESTART_COUNT"
#: The backend given to ``ddpkit run --backend``.
DDPKIT_BACKEND = "DDPKIT_BACKEND"
#: ``ddpkit run --recovery``: "fail-fast" (the default) or "in-place", where the launcher hosts the
#: store and replaces a lost rank, and the ranks meet again in a new generation of the group.
DDPKIT_RECOVERY = "DDPKIT_RECOVERY"
#: Under in-place recovery: which generation of the group this process joins (0 at the start; a
#: replacement is told the generation it completes).
DDPKIT_GENERATION = "DDPKIT_GENERATION"
#: Under ``--nnodes MIN:MAX``: MIN, the fewest nodes the world may shrink to when a node is lost
#: and no spare node takes its place (unset: the world keeps its size).
DDPKIT_MIN_NODES = "DDPKIT_MIN_NODES"
#: "1" when the launcher hosts the job's store (``launching.store_host``): under in-place recovery,
#: when the launchers of several nodes restart together, and under a c10d rendezvous. The ranks
#: reach it as clients, under a key prefix per attempt, instead of rank 0 hosting one.
DDPKIT_HOSTED_STORE = "DDPKIT_HOSTED_STORE"
#: The pid of the process that started the worker: the worker dies with it.
DDPKIT_LAUNCHER_PID = "DDPKIT_LAUNCHER_PID"
#: Where a worker records its first failure (torchrun's error-file format).
DDPKIT_ERROR_FILE = "DDPKIT_ERROR_FILE"
#: Where a worker writes its threads' stacks on SIGUSR1.
DDPKIT_STACK_FILE = "DDPKIT_STACK_FILE"
#: Where a worker under in-place recovery writes once ``DDPStrategy.setup`` attached it to the
#: recovery: the launcher's sign that the rank can take part in one and, from a process that
#: replaced a lost rank, that it holds the survivors' state (the recovery is over).
DDPKIT_READY_FILE = "DDPKIT_READY_FILE"
#: Across nodes, the file in which the launcher keeps the job's count of news for its workers'
#: watches (``diagnostics.relayed_news``): they read the store when it changed.
DDPKIT_NEWS_FILE = "DDPKIT_NEWS_FILE"
#: Where a worker appends its steps' phases once per window, and the window's length in seconds
#: (``ddpkit run --report-every``/``--metrics``: ``diagnostics.step_windows``).
DDPKIT_METRICS_FILE = "DDPKIT_METRICS_FILE"
DDPKIT_METRICS_SECONDS = "DDPKIT_METRICS_SECONDS"
#: ``1`` when the launcher prefixes the worker's stderr lines itself (``--tee``).
DDPKIT_STDERR_PREFIXED = "DDPKIT_STDERR_PREFIXED"
#: The address of the function pool a worker serves (``launch(fn)``, ``WorkerPool``).
DDPKIT_POOL_CONNECTION = "DDPKIT_POOL_CONNECTION"

# Settings a user gives (the launcher passes them on).

#: The signal that asks the workers to save and stop, besides SIGTERM (``ddpkit run --preemption-signal``).
DDPKIT_PREEMPTION_SIGNAL = "DDPKIT_PREEMPTION_SIGNAL"
#: "0" starts each worker of ``ddpkit run`` (and of a function pool: ``launch(fn)``, ``WorkerPool``)
#: as a fresh interpreter instead of forking it from a template, which has imported torch already
#: (``workers.worker_template``).
DDPKIT_FORK_WORKERS = "DDPKIT_FORK_WORKERS"
#: The socket (an inherited file descriptor) on which a node's template is asked for workers.
DDPKIT_TEMPLATE_SOCKET = "DDPKIT_TEMPLATE_SOCKET"
#: How long the ranks of a new generation wait for each other (a replacement starts its script from
#: the top) before giving up; the launcher waits a little longer for the recovery to finish.
DDPKIT_RECOVERY_TIMEOUT_SECONDS = "DDPKIT_RECOVERY_TIMEOUT_SECONDS"
#: "1" lets ``ddpkit run --recovery in-place`` run over NCCL, which has not yet run on a device
#: (``benchmarks/gpu_check.py`` exercises it); without it the launcher refuses NCCL with in-place.
DDPKIT_NCCL_IN_PLACE = "DDPKIT_NCCL_IN_PLACE"
#: The job secret (``ddpkit.store.job_secret``): its value, or a file that holds it. ``ddpkit run`` on one
#: node makes one when neither is given and passes it to its workers in ``DDPKIT_JOB_SECRET``.
DDPKIT_JOB_SECRET = "DDPKIT_JOB_SECRET"
DDPKIT_JOB_SECRET_FILE = "DDPKIT_JOB_SECRET_FILE"
#: ``all``: the job's stores (the launcher's store host, rank 0's) listen on every interface, not
#: only on the master address's (``ddpkit._network.store_bind_address``).
DDPKIT_STORE_BIND = "DDPKIT_STORE_BIND"
#: ddpkit's log level.
DDPKIT_LOG_LEVEL = "DDPKIT_LOG_LEVEL"
#: The collective mismatch guard.
DDPKIT_DEBUG = "DDPKIT_DEBUG"
#: Hang diagnosis: after how long a wait is reported, and after how much longer the job is ended.
DDPKIT_HANG_SECONDS = "DDPKIT_HANG_SECONDS"
DDPKIT_HANG_ABORT_SECONDS = "DDPKIT_HANG_ABORT_SECONDS"
#: Every how many optimizer steps the ranks compare their replicas (``ddpkit.training.replicas``; 0 or unset:
#: only after an in-place recovery).
DDPKIT_CHECK_REPLICAS = "DDPKIT_CHECK_REPLICAS"
#: How long a rank blocked in a call ddpkit cannot interrupt lives on after a peer's failure.
DDPKIT_PEER_FAILURE_EXIT_SECONDS = "DDPKIT_PEER_FAILURE_EXIT_SECONDS"

_FLAG_PREFIX = "DDPKIT_"


def launcher_flag_variable(flag: str) -> str:
    """The variable that gives ``ddpkit run``'s ``--flag-name``: ``DDPKIT_FLAG_NAME``."""
    return _FLAG_PREFIX + flag.removeprefix("--").replace("-", "_").upper()
