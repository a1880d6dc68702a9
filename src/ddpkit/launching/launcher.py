"""Start, watch and reconcile the workers of one node (what ``ddpkit run`` does), and ``launch(fn)``.

The workers are started, ended and blamed by ``workers.processes``: each runs
``python -m ddpkit.workers.worker script.py args`` in a session of its own. The launcher polls
them (``launching.watch``); at the first failure (non-zero exit or a signal) it asks the others to stop (SIGTERM to their
process groups), kills what is left after ``grace`` seconds, and returns 1 with a summary that
names the root cause: the earliest recorded exception (workers write them to an error file), else
the first rank seen to fail. With ``--max-restarts N`` it then starts every worker again, up to N
times (``DDPKIT_RESTART_COUNT`` and torchrun's ``TORCHELASTIC_RESTART_COUNT`` say which start it
is), and the exit code and summary are the last failure's.

With ``--recovery in-place`` (``workers.replacement``) the launcher also runs the store
(``launching.store_host``) and a warm spare; a worker killed by a signal is replaced by the spare
while the others keep running (they re-form the group with it: ``ddpkit.training.recovery``), and each
replacement counts against ``--max-restarts``; any other failure goes the way above.

SIGINT to the launcher ends every worker the same way and returns 130, without a restart.
SIGTERM, or the signal chosen with ``--preemption-signal``, is a preemption (``ddpkit.environments.preemption``):
each worker gets SIGTERM on its own process; a script that calls ``DDPStrategy.preempted()``
saves and exits with 75 on every rank, and so does the launcher; a worker that SIGTERM ended (a
script that does not) makes the launcher end the others and return 143 (128 + the signal). A
second signal kills every worker at once. Neither is restarted. SIGUSR1 to the launcher prints
every worker's Python stacks, unless it is the preemption signal. Workers notice a launcher
killed with SIGKILL through PR_SET_PDEATHSIG (see ``ddpkit.workers.worker``).
``launch(fn)`` runs a function instead of a script, on the same kind of workers (``workers.pool``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ddpkit._network import address_towards, find_free_port
from ddpkit.control_plane.node_world import NodeSteppedAside
from ddpkit.control_plane.nodes import NodeContactLostError, NodeCoordination
from ddpkit.diagnostics.relayed_news import write_news_file
from ddpkit.diagnostics.settings import recovery_timeout_seconds
from ddpkit.environments.preemption import PREEMPTED_EXIT_CODE
from ddpkit.health.job_health import JobHealth, SharedWindows
from ddpkit.health.straggler_replacement import StepAside, one_node_note
from ddpkit.launching.config import LaunchConfig, LaunchError, validate
from ddpkit.launching.joining import announce_loss, connect_nodes, host_rendezvous, host_store, join_rendezvous
from ddpkit.launching.rendezvous import RendezvousError
from ddpkit.launching.spare_node import Takeover, wait_as_spare
from ddpkit.launching.store_host import StoreHost, StoreHostError
from ddpkit.launching.watch import Outcome, Signals, agree_across_nodes, watch
from ddpkit.launching.worker_environment import (
    gloo_interface,
    job_secret_for_workers,
    performance_defaults,
    rank_variables,
    worker_command,
)
from ddpkit.logs import get_logger, line_start
from ddpkit.membership.generations import member_identity
from ddpkit.store.client import GaveUpWaiting, connect, import_distributed
from ddpkit.variables import (
    DDPKIT_NEWS_FILE,
    DDPKIT_READY_FILE,
    DDPKIT_RESTART_COUNT,
)
from ddpkit.workers.pool import RankFailedError, WorkerPool
from ddpkit.workers.processes import SPARE, WorkerProcesses
from ddpkit.workers.replacement import (
    NO_REPLACEMENTS,
    NoReplacements,
    Replacements,
    ready_file,
)
from ddpkit.workers.worker_template import WorkerTemplate

__all__ = ["RankFailedError", "launch", "run_workers", "stop_signals"]

_log = get_logger("launching")


def launch(function: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), backend: str = "gloo",
           threads: int = 1, timeout: float = math.inf) -> list[Any]:
    """Run ``function(*args)`` in ``nprocs`` new processes, connected to each other, and return
    each rank's result, by rank.

    The process group exists when ``function`` starts (``backend`` "gloo", or "nccl" with one GPU
    per process) and is torn down after. ``function`` and ``args`` must be picklable (a
    module-level function), and the calling script needs the ``if __name__ == "__main__":``
    guard, since processes are spawned. When a rank raises or dies, the others are stopped at
    once and ``RankFailedError`` carries that rank and its traceback; ``timeout`` bounds the run.

    Example::

        >>> import torch, ddpkit
        >>> def total(x):  # a script's function, called under its ``if __name__ == "__main__":``
        ...     return ddpkit.sync_ddp(torch.tensor(x)).item()
        >>> ddpkit.launch(total, nprocs=2, args=(1.0,))  # doctest: +SKIP
        [2.0, 2.0]
    """
    if nprocs < 1:
        raise LaunchError(f"nprocs={nprocs}: need at least 1 process.")
    with WorkerPool(nprocs, timeout=timeout, pg_timeout=600, threads=threads, backend=backend) as pool:
        return pool.run(function, *args)


def stop_signals(preemption_signal: signal.Signals) -> set[signal.Signals]:
    """The signals that stop a launcher or preempt its job (``run_workers`` notes them)."""
    return {signal.SIGINT, signal.SIGTERM, preemption_signal}


def run_workers(script: str, script_args: Sequence[str], config: LaunchConfig, grace: float = 3.0,
                poll_interval: float = 0.05) -> int:
    """Run ``script`` on this node's workers until all succeed or one fails; return the exit code.

    After a failure the workers are started again, up to ``config.max_restarts`` times, each time
    meeting on a new port (unless ``master_port`` is given, or the launchers host the store, whose
    workers' keys are cleared instead); a stop signal is never retried, and ends every wait on the
    store (rendezvous, restart) within seconds. The loop's phases: ``_LauncherRun``.
    """
    validate(config, script)
    if config.replace_stragglers and config.nnodes == 1 and config.max_nodes is None:
        _log.warning(one_node_note())
    run = _LauncherRun(script, script_args, config, grace, poll_interval)
    try:
        code = run.join_the_job()
        while code is None:  # one attempt (a spare node's wait for a place first), then its end
            code = run.end_of(run.attempt())
        return code
    except GaveUpWaiting as stopped:  # in the rendezvous: no worker started yet
        return run.gave_up(stopped, "no worker was started")
    finally:
        run.leave()


@dataclasses.dataclass
class _LauncherState:
    """What the launcher's loop knows between attempts (``run_workers``)."""

    config: LaunchConfig  # this node's, once the rendezvous gave it a node rank (or a spare took a place)
    port: int = 0  # where the workers (and the launchers' store) meet
    restart_count: int = 0  # the attempt: starts of the workers so far, replacements in place included
    spare_node: bool = False  # this launcher waits for a lost node's place before it starts workers
    takeover: Takeover | None = None  # the place a spare node took, for the attempt it starts
    nodes: NodeCoordination | None = None  # the agreement with the other nodes' launchers
    store_host: StoreHost | None = None  # the job's store, when this launcher hosts it


class _LauncherRun:
    """One ``ddpkit run``: its signals, the workers' environment and the loop's state."""

    def __init__(self, script: str, script_args: Sequence[str], config: LaunchConfig, grace: float,
                 poll_interval: float) -> None:
        self.grace, self.poll_interval = grace, poll_interval
        self.received: list[int] = []  # the stop and preemption signals, in order
        stack_requests: list[float] = []
        self.state = _LauncherState(config)
        defaults = performance_defaults(config.nproc_per_node, os.environ)
        defaults.update(job_secret_for_workers(config.nnodes > 1 or config.rendezvous is not None, os.environ))
        if config.backend == "nccl" and config.survivors_go_on:
            # On an error the NCCL watchdog aborts the communicator and leaves the process alive (its
            # default tears the process down): a survivor's aborted collective must end in its recovery.
            defaults["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        if "OMP_NUM_THREADS" in defaults:
            _log.info(f"ddpkit run: OMP_NUM_THREADS={defaults['OMP_NUM_THREADS']} for each of this node's "
                      f"{config.nproc_per_node} workers (set it yourself to choose).")
        self.defaults = defaults
        # Not restored at the return: the launcher's exit follows (``cli``), and a stop signal then (a
        # scheduler's SIGTERM to every process of a job that just ended) has nothing left to stop.
        for sig in stop_signals(config.preemption_signal):
            signal.signal(sig, lambda signum, _frame: self.received.append(signum))
        if config.preemption_signal != signal.SIGUSR1:
            signal.signal(signal.SIGUSR1, lambda _signum, _frame: stack_requests.append(time.monotonic()))
        self.signals = Signals(self.received, stack_requests, config.preemption_signal)
        self.command = worker_command(config.run_as, script, script_args)
        self.spare_command = [*self.command[:3], SPARE, *self.command[3:]]
        # The node's workers are forked from one process that imported torch once, across restarts.
        self.template = WorkerTemplate(os.environ)
        if config.output.is_default():  # (the workers of routed streams start as fresh interpreters)
            self.template.prepare(self.command, self.environment())
        self.output = config.output  # with its log folder once the job is joined
        self.replacements: Replacements | NoReplacements = NO_REPLACEMENTS  # the attempt's
        self.news_file: str | None = None  # the attempt's file of news for its workers (across nodes)
        # The job's health line, metrics and stragglers (``health.job_health``), across attempts.
        self.health = None if config.window_seconds is None else JobHealth(
            config.window_seconds, config.report_every > 0, config.metrics, config.straggler_factor,
            recoveries=lambda: self.state.restart_count + self.replacements.used)

    def environment(self) -> dict[str, str]:
        return {**self.defaults, **os.environ}

    def stop_waiting(self) -> str | None:
        """Why a wait on the job's store ends early: a signal to the launcher, or its store host's end."""
        if self.received:
            return f"received {signal.Signals(self.received[0]).name}"
        store_host = self.state.store_host
        return store_host.failure() if store_host is not None else None

    def join_the_job(self) -> int | None:
        """Meet the other nodes at the rendezvous (when there is one), choose the port and host the
        store when this launcher does; an exit code when the rendezvous failed, else None."""
        state, config = self.state, self.state.config
        # The store host is started before this launcher imports the store's client below: the two
        # then import torch at once, and the store serves as soon as the launcher can ask it.
        if config.rendezvous is not None:
            state.store_host = host_rendezvous(config.rendezvous, self.environment())
        else:
            self.choose_port(config)
            if config.hosts_store and config.node_rank == 0:
                state.store_host = host_store(config.master_addr, state.port, config.nnodes > 1, self.environment())
        if config.coordinates_nodes:
            # The client of the launchers' store, imported now (while the node's template imports in
            # its own process), not after the workers started: workers forked from a warm template
            # train within a second, and a launcher still importing then would not watch the others.
            import_distributed()
        if config.rendezvous is not None:
            try:
                if state.store_host is not None:  # join_timeout waits for the other nodes, not for this store
                    state.store_host.wait_serving(_STORE_HOST_START_SECONDS)
                state.config, state.nodes, state.spare_node = join_rendezvous(
                    config, config.rendezvous, state.store_host is not None, self.stop_waiting)
            except (RendezvousError, StoreHostError) as error:
                _log.error(f"ddpkit run: {error}")
                return 1
            config = state.config
            self.choose_port(config)
        self.output = config.output.with_log_dir()
        return None

    def choose_port(self, config: LaunchConfig) -> None:
        """The port of the job's store and the workers' Gloo interface towards it: a store the
        launchers host keeps one port for the whole run (attempts and generations have prefixes)."""
        self.state.port = config.master_port if config.master_port is not None else find_free_port(config.master_addr)
        self.defaults.update(gloo_interface(config, self.state.port, os.environ))

    def attempt(self) -> Outcome | int:
        """Start this node's workers (a spare node: once it took a place) and watch them until this
        attempt ends: its outcome, agreed with the other nodes, or the launcher's exit code."""
        state, config = self.state, self.state.config
        if not config.hosts_store and state.restart_count and config.master_port is None:
            state.port = find_free_port(config.master_addr)
        log_folder = self.output.attempt_folder(config.node_rank, state.restart_count) \
            if self.output.writes_files() else None
        if log_folder is not None and not state.spare_node:
            shutil.rmtree(log_folder, ignore_errors=True)  # a former run's logs of this attempt, replaced
        workers = WorkerProcesses("run", None if self.output.is_default() else self.output, log_folder,
                                  config.window_seconds, self.template)
        self.replacements = NO_REPLACEMENTS
        try:
            if state.spare_node and state.nodes is not None and (code := self._take_a_place(workers)) is not None:
                return code
            self._start(workers)
            if config.coordinates_nodes and state.nodes is None:
                state.nodes = connect_nodes(state.config, state.port, workers, self.stop_waiting)
            if state.nodes is not None and self.news_file is not None:
                state.nodes.looks.relay_news_to(self.news_file)
            if self.health is not None:
                self.health.node = state.config.node_rank  # a spare node took its place's
                if state.nodes is not None:  # node 0's launcher reports every node's ranks
                    self.health.across_nodes(SharedWindows(state.nodes.records, state.nodes.world.nodes),
                                             _probe_address(state.config.master_addr, state.port))
                    if config.replace_stragglers and state.nodes.survivors_go_on:
                        step_aside = StepAside(state.nodes)
                        self.health.on_named, self.health.each_read = step_aside, step_aside.check
            outcome = watch(workers, self.signals, self.grace, self.poll_interval, self.replacements, state.nodes,
                            state.store_host, self.health)
            return agree_across_nodes(state.nodes, outcome, self.grace) if state.nodes is not None else outcome
        except NodeSteppedAside as error:  # a straggler's node, replaced: the job goes on without it
            _log.warning(f"ddpkit run: {error}")
            return 0
        except NodeContactLostError as error:
            _log.error(f"ddpkit run: {error}\nddpkit run: all {config.nproc_per_node} workers of node "
                       f"{state.config.node_rank} were stopped.")
            return 1
        except GaveUpWaiting as stopped:  # waiting for the other nodes' workers to finish too
            return self.gave_up(stopped, "the other nodes were not waited for")
        finally:
            if state.nodes is not None:
                state.nodes.looks.relay_news_to(None)  # the file goes with the workers' folder
            workers.close(self.grace)
            state.restart_count += self.replacements.used  # replacements spend the same budget

    def _take_a_place(self, workers: WorkerProcesses) -> int | None:
        """As a spare node: start warm spares and wait until this launcher takes a lost or removed
        node's place (None: go on, as that node), or the job ends without it (the exit code)."""
        state = self.state
        assert state.nodes is not None  # (the caller's check)
        state.spare_node = False
        try:
            state.takeover = wait_as_spare(
                state.nodes, functools.partial(workers.start_spare, self.spare_command, self.environment()),
                state.config.nproc_per_node, self.stop_waiting, self.template.forks_at_once)
        except GaveUpWaiting as stopped:  # a spare that stops takes nothing from the job
            _log.warning(f"ddpkit run: {stopped.reason} while waiting as a spare node: stopping (the job "
                         "goes on without this spare)")
            return 128 + self.received[0] if self.received else 1
        if state.takeover is None:
            _log.warning("ddpkit run: every node's launcher left the job or was taken for lost: this spare node was not "
                         "needed")
            return 0
        state.config = dataclasses.replace(state.config, node_rank=state.takeover.node_rank)
        state.restart_count = state.takeover.attempt
        state.nodes.beat_through(connect(state.config.master_addr, state.port, state.config.store_waits.read_timeout))
        return None

    def _start(self, workers: WorkerProcesses) -> None:
        """Start this node's workers (or hand a taken place's ranks to the warm spares), and the
        replacement of lost ranks under in-place recovery."""
        state, config = self.state, self.state.config
        takeover, generation = state.takeover, state.takeover.generation if state.takeover is not None else 0
        # Across nodes this launcher relays the job's news to its workers' watches (``diagnostics.relayed_news``).
        self.news_file = os.path.join(workers.folder, "news") if config.coordinates_nodes else None
        if self.news_file is not None:
            write_news_file(self.news_file, 0)
        for local_rank in range(config.nproc_per_node):
            variables = rank_variables(config, state.port, local_rank, state.restart_count, generation)
            if self.news_file is not None:
                variables[DDPKIT_NEWS_FILE] = self.news_file
            rank = int(variables["RANK"])
            if config.survivors_go_on:
                variables[DDPKIT_READY_FILE] = ready_file(workers.folder, generation, rank)
            if takeover is not None:
                workers.assign(takeover.spares[local_rank], variables, rank, local_rank)
            else:
                workers.start(self.command, {**self.environment(), **variables}, rank, local_rank)
        if takeover is not None and state.nodes is not None:
            holders = {worker.rank: member_identity(worker.process.pid) for worker in workers.workers}
            change = state.nodes.world.bring_back if takeover.returns else state.nodes.world.hand_over
            change(state.restart_count, generation, holders, takeover.why)
        state.takeover = None
        if config.survivors_go_on:
            nodes = state.nodes
            self.replacements = Replacements(
                workers, self.spare_command, self.environment(),
                functools.partial(rank_variables, config, state.port, restart_count=state.restart_count),
                budget=config.max_restarts - state.restart_count, generation=generation,
                next_generation=nodes.world.next_generation if nodes is not None and nodes.survivors_go_on else None,
                announce_loss=functools.partial(announce_loss, config, state.port, self.environment(),
                                                state.restart_count) if config.backend == "nccl" else None)

    def end_of(self, outcome: Outcome | int) -> int | None:
        """What follows an attempt: the launcher's exit code, or None once the next attempt is open
        (a restart, within ``--max-restarts``)."""
        if isinstance(outcome, int):
            return outcome
        state, config, nodes = self.state, self.state.config, self.state.nodes
        if outcome.cause is None:  # success, preempted, or stopped by a signal
            if outcome.code == PREEMPTED_EXIT_CODE and nodes is not None and not self.received:
                # Saved and stopped, though no signal came here: say where the preemption came from.
                _log.warning(f"ddpkit run: the preemption came from {nodes.preemption_source()}")
            return outcome.code
        count = config.nproc_per_node
        these = f"all {count} workers" + (f" of node {config.node_rank}" if config.nnodes > 1 else "")
        print(f"{line_start()}ddpkit run: {outcome.cause}\nddpkit run: {these} were stopped.", file=sys.stderr,
              flush=True)
        if outcome.stopped_elsewhere:
            _log.error("ddpkit run: no restart after a stop signal on another node: ending the job.")
            return outcome.code
        store_gone = state.store_host is not None and state.store_host.failure() is not None
        if state.restart_count >= config.max_restarts or self.received or store_gone:
            if config.max_restarts:
                why = ("after a stop signal" if self.received else "without the job's store" if store_gone else
                       f"left (--max-restarts={config.max_restarts})")
                _log.error(f"ddpkit run: no restart {why}: ending the job.")
            return outcome.code
        state.restart_count += 1
        try:
            if nodes is not None:  # every node's launcher meets the others; node 0's clears the workers' keys
                nodes.meet(state.restart_count, recovery_timeout_seconds())
            elif state.store_host is not None:  # on one node, the store this launcher hosts forgets them
                state.store_host.clear_worker_keys()
        except GaveUpWaiting as stopped:
            return self.gave_up(stopped, "no restart")
        except (TimeoutError, NodeContactLostError, StoreHostError) as error:
            _log.error(f"ddpkit run: {error}")
            return outcome.code
        _log.warning(f"ddpkit run: restarting {these} (restart {state.restart_count} of "
                     f"{config.max_restarts}); {DDPKIT_RESTART_COUNT}={state.restart_count}")
        return None

    def gave_up(self, stopped: GaveUpWaiting, consequence: str) -> int:
        """The exit code after a wait on the job's store was given up, said on stderr (and, after a
        signal, to the other nodes' launchers: none restarts): 128 + the signal that asked the
        launcher to stop, else 1 (the store host ended)."""
        if self.received:
            _log.warning(f"ddpkit run: {stopped.reason} while waiting on the job's store: stopping ({consequence}).")
            if self.state.nodes is not None:
                with contextlib.suppress(NodeContactLostError):
                    self.state.nodes.announce_stop(stopped.reason)
            return 128 + self.received[0]
        _log.error(f"ddpkit run: {stopped.reason}\nddpkit run: {consequence}.")
        return 1

    def leave(self) -> None:
        """Count this launcher out of the job (the one that hosts the store waits for the others) and stop the store."""
        nodes, store_host = self.state.nodes, self.state.store_host
        if nodes is not None and nodes.node_rank >= 0:  # (a spare that took no node's place was never in the job)
            # After a stop signal here the others only need a moment to read it (announced at once).
            nodes.leave(wait_seconds=_LEAVE_AFTER_SIGNAL_SECONDS if self.received else self.grace + 5.0)
        self.template.close()
        if store_host is not None:
            store_host.stop()
        if self.health is not None and self.health.probe is not None:
            self.health.probe.stop()


def _probe_address(master_address: str, port: int) -> str | None:
    """Where this node's link probe listens (``health.link_probe``): its address towards the job's
    store; None when no route is known (its link is then not timed)."""
    try:
        return address_towards(master_address, port)
    except OSError:
        return None


# How long the launcher that hosts the store keeps it for the others after it was told to stop.
_LEAVE_AFTER_SIGNAL_SECONDS = 2.0
# How long a launcher waits for the store host it started (a process that imports torch) to serve.
_STORE_HOST_START_SECONDS = 60.0
