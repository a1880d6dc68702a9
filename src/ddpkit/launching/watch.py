"""Watching one start of a node's workers until it ends (``watch``), and turning how it ended into
the job's outcome across nodes (``agree_across_nodes``). The launcher's restart loop
(``launching.launcher``) calls them once per start.

Each poll, in this order: stack requests (SIGUSR1) are answered; a stop signal ends every
worker; a preemption signal is passed on; a worker that failed is replaced in place when the
recovery policy can (``replacement``), else every worker is ended and the root cause named (and
announced to the other nodes); another node's failure ends this node's workers; a recovery that
does not finish, or the store host's end, fails the start; when every worker has exited, the
start succeeded (0) or was preempted (75).
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ddpkit.control_plane.nodes import FailureCause, NodeContactLostError, NodeCoordination
from ddpkit.diagnostics.records import PEER_LOST
from ddpkit.environments.preemption import PREEMPTED_EXIT_CODE
from ddpkit.health.job_health import JobHealth
from ddpkit.launching.store_host import StoreHost
from ddpkit.logs import get_logger
from ddpkit.workers.processes import WorkerProcess, WorkerProcesses
from ddpkit.workers.replacement import NO_REPLACEMENTS, NoReplacements, Replacements

__all__ = ["Outcome", "Signals", "agree_across_nodes", "failure_of", "watch"]

_log = get_logger("launching")


@dataclass
class Signals:
    """What the launcher's signal handlers noted, for ``watch``."""

    received: list[int]  # SIGINT, SIGTERM and the preemption signal, in the order they came
    stack_requests: list[float]  # SIGUSR1 (when it is not the preemption signal)
    preemption_signal: signal.Signals

    def preemption(self) -> int | None:
        """The signal that asked for a preemption, when the first one received did."""
        first = self.received[0] if self.received else None
        return first if first in (signal.SIGTERM, self.preemption_signal) else None

    def stop(self) -> int | None:
        """The signal that asks to stop at once: SIGINT, or any signal after a preemption's."""
        if not self.received:
            return None
        if self.preemption() is None:
            return self.received[0]
        return self.received[1] if len(self.received) > 1 else None


@dataclass(frozen=True)
class Outcome:
    """How one start of this node's workers ended (``watch``)."""

    code: int  # the launcher's exit code if nothing is restarted
    cause: str | None = None  # the root cause of a failure; None: success, preempted, or stopped by a signal
    recorded_at: float | None = None  # when the root cause's exception was recorded (None: no record)
    elsewhere: bool = False  # another node's launcher ended this attempt (``control_plane.nodes``)
    stopped_elsewhere: bool = False  # another node's launcher was stopped by a signal: nothing is restarted


def watch(workers: WorkerProcesses, signals: Signals, grace: float, poll_interval: float,
          replacements: Replacements | NoReplacements = NO_REPLACEMENTS, nodes: NodeCoordination | None = None,
          store_host: StoreHost | None = None, health: JobHealth | None = None) -> Outcome:
    """Poll the workers until all succeed (0), all saved and stopped after a preemption (75), a stop
    signal comes (128 + its number) or one fails (1, and the description of the root cause,
    after every worker was stopped). Under in-place recovery (``replacements``) a worker that can
    be replaced is, and the watch goes on. With ``nodes``, a failure or stop signal here is
    announced to the other nodes' launchers before the workers are ended, and one announced by
    them ends this node's workers (1). A ``store_host`` that ends fails the job at once (1). ``health``
    reads the workers' step windows as they come (``health.job_health``)."""
    count = len(workers.workers)
    preemption: int | None = None
    while True:
        if signals.stack_requests:
            signals.stack_requests.clear()
            _print_stacks(workers)
        # A signal that comes after every worker ended by itself has nothing left to stop: their end is the outcome.
        ended = None not in workers.exit_codes()
        stop = None if ended else signals.stop()
        if stop is not None:
            _log.warning(f"ddpkit run: received {signal.Signals(stop).name}, stopping all {count} workers")
            if nodes is not None:
                nodes.announce_stop(f"received {signal.Signals(stop).name}")
            # After a preemption the workers had their SIGTERM: asked again, they are killed at once.
            workers.end(grace if preemption is None else 0.0)
            return Outcome(128 + stop)
        if not ended and preemption is None and (preemption := signals.preemption()) is not None:
            _ask_to_save(workers, nodes, preemption)
        # After a preemption SIGTERM ends a script that does not handle it: a stop, not a failure.
        also_fine = (-signal.SIGTERM,) if preemption else ()
        failed = workers.failed(also_fine)
        if failed and preemption is None and replacements.survivors_go_on:
            # Ranks killed together (a node's processes, the out-of-memory killer) are reaped a
            # moment apart: replaced together, or a later one would fail the recovery under way.
            time.sleep(_LOSSES_SETTLE_SECONDS)
            failed = workers.failed(also_fine)
            if replacements.replace(failed):
                continue
        outcome = (_failure(workers, failed, grace, poll_interval, also_fine, replacements, nodes)
                   or _problem(workers, grace, replacements, store_host) or _all_ended(workers, grace, preemption))
        if outcome is not None:
            return outcome
        if health is not None:
            health.poll([worker.metrics_file for worker in workers.workers], len(workers.workers))
        if nodes is not None:
            nodes.tidy()
        time.sleep(poll_interval)


def _ask_to_save(workers: WorkerProcesses, nodes: NodeCoordination | None, preemption: int) -> None:
    _log.warning(f"ddpkit run: received {signal.Signals(preemption).name}: asking all {len(workers.workers)} workers "
                 "to save and stop (preemption); a second signal stops them at once")
    workers.notify(signal.SIGTERM)
    if nodes is not None:
        nodes.announce_preemption(f"received {signal.Signals(preemption).name}")


def _failure(workers: WorkerProcesses, failed: list[WorkerProcess], grace: float, poll_interval: float,
             also_fine: tuple[int, ...], replacements: Replacements | NoReplacements,
             nodes: NodeCoordination | None) -> Outcome | None:
    """The outcome when a worker here failed, or another node's launcher ended the job; else None."""
    if not failed and nodes is not None and nodes.ended_elsewhere():
        told_at = time.time()
        # A worker here killed at the same moment may not have been reaped yet when its peers on
        # other nodes noticed: its own failure, not theirs, is then the root cause.
        failed = _failures_within(workers, _SETTLE_SECONDS, poll_interval, also_fine)
        if not failed:
            # A launcher slow to poll (a loaded machine) can pass that settle without seeing it:
            # a worker that had ended before the launcher signalled it still failed by itself, and
            # so did one that recorded its exception before the news came but was slow to exit
            # (its peers elsewhere failed at once on that exception, published in the store).
            failed = workers.failed(also_fine, among=workers.end(grace)) or workers.recorded_before(told_at)
            if not failed:
                # Said, so that a node that names another node's cause shows it had seen none of its own.
                _log.info(f"ddpkit run: another node's launcher ended the attempt; none of this node's "
                          f"{len(workers.workers)} workers had failed by itself (exit codes when ended: "
                          f"{workers.exit_codes()})")
                return Outcome(1, "another node's launcher ended the workers", elsewhere=True)
    if not failed:
        return None
    if nodes is not None:
        nodes.announce_failure()  # the other nodes end their workers meanwhile
    # Only failures seen at this first poll can be the cause; later ones follow from the shutdown.
    recovering = replacements.recovering()
    workers.end(grace)
    worker, record = workers.root_cause(failed)
    if recovering and record is not None and record["type"] == PEER_LOST:
        replacements.give_back()  # the survivors failed on the loss being recovered: a restart recovers it
    cause, recorded_at = workers.summary_of(worker, record)
    return Outcome(1, f"during the in-place recovery of rank {recovering}: {cause}" if recovering else cause, recorded_at)


def _problem(workers: WorkerProcesses, grace: float, replacements: Replacements | NoReplacements,
             store_host: StoreHost | None) -> Outcome | None:
    """A recovery that did not finish in time, or the store host's end: the job fails."""
    problem = replacements.check()
    if problem is None and store_host is not None:
        problem = store_host.failure()
    if problem is None:
        return None
    workers.end(grace)
    return Outcome(1, problem)


def _all_ended(workers: WorkerProcesses, grace: float, preemption: int | None) -> Outcome | None:
    """Every worker ended (0, or 75 after saving), or one ended on the preemption's SIGTERM unsaved; else None.
    The exit codes are read again here: a worker that failed after ``watch`` looked for failures in
    this poll is not a success (a launcher whose one worker raised exited 0, now and then)."""
    codes = workers.exit_codes()
    count = len(codes)
    if preemption is not None and -signal.SIGTERM in codes:
        _log.warning(f"ddpkit run: a worker ended on SIGTERM without saving (its script had not set up its "
                     f"DDPStrategy yet, or does not call DDPStrategy.preempted()); stopping all {count} workers")
        workers.end(grace)
        return Outcome(128 + preemption)
    if None in codes or any(code not in (0, PREEMPTED_EXIT_CODE) for code in codes):
        return None  # running, or one failed since this poll's look for failures: the next poll names it
    if PREEMPTED_EXIT_CODE not in codes:
        return Outcome(0)
    _log.warning(f"ddpkit run: preempted: all {count} workers saved and stopped (exit code "
                 f"{PREEMPTED_EXIT_CODE}); run the same command again to resume")
    return Outcome(PREEMPTED_EXIT_CODE)


# How long a launcher told that another node's workers failed still looks for a failure of its own.
_SETTLE_SECONDS = 0.5
# How long after a worker is lost the launcher looks for others lost with it (in-place recovery).
_LOSSES_SETTLE_SECONDS = 0.1


def failure_of(workers: WorkerProcesses) -> str | None:
    """The root cause of this node's failed workers, or None while none failed."""
    failed = workers.failed()
    return workers.describe_root_cause(failed) if failed else None


def _failures_within(workers: WorkerProcesses, seconds: float, poll_interval: float,
                     also_fine: Sequence[int]) -> list[WorkerProcess]:
    deadline = time.monotonic() + seconds
    while not (failed := workers.failed(also_fine)) and time.monotonic() < deadline:
        time.sleep(poll_interval)
    return failed


def agree_across_nodes(nodes: NodeCoordination, outcome: Outcome, grace: float) -> Outcome:
    """Turn this node's outcome into the job's (``control_plane.nodes``): workers that succeeded wait
    for the other nodes' (whose failure is this attempt's failure too); after a failure every
    launcher names the same root cause, the likeliest of those the nodes published."""
    if outcome.code == 0 and outcome.cause is None:
        try:
            if nodes.finish():
                return outcome
        except NodeContactLostError as error:  # workers that all finished are a finished job
            _log.warning(f"ddpkit run: every worker of node {nodes.node_rank} finished; whether the other nodes' did "
                         f"too cannot be known: {error}")
            return outcome
    own = outcome.cause if not outcome.elsewhere else None  # None: ended because of another node, or a signal
    nodes.publish_cause(None if own is None else FailureCause(nodes.node_rank, own, outcome.recorded_at))
    if outcome.cause is None and outcome.code != 0:
        return outcome  # preempted, or stopped by a signal here: nothing to agree on
    stopped = nodes.stop_reason()
    # Every launcher publishes once its workers have ended (``grace``); one that vanished never does.
    cause = nodes.root_cause(wait_seconds=grace + 5.0)
    failure = None if cause is None else (
        cause.text if cause.node == nodes.node_rank else f"on node {cause.node}: {cause.text}")
    if own is not None and cause is not None and cause.node != nodes.node_rank:
        # Named too, in one line: when the order of two failures was misread, the output still shows both.
        _log.info(f"ddpkit run: this node's workers failed too (taken for a consequence): {own.splitlines()[0]}")
    if stopped is not None:
        # A stop signal elsewhere ends the job whatever failed: a worker here whose collective broke as
        # the stopped node's workers ended may be seen failing before the stop is read.
        text = f"the job was stopped: {stopped}" + (f" (and a worker failed: {failure})" if failure else "")
    else:
        text = failure or nodes.silent_node() or "another node's workers failed (its output says why)"
    return Outcome(1, text, stopped_elsewhere=stopped is not None)


def _print_stacks(workers: WorkerProcesses) -> None:
    """Print every running worker's Python stacks, rank by rank (SIGUSR1 to the launcher)."""
    stacks = workers.stacks()
    print(f"ddpkit run: Python stacks of {len(stacks)} running workers (SIGUSR1)", file=sys.stderr)
    for worker, written in stacks:
        print(f"=== {worker} ===\n{written}", file=sys.stderr)
    sys.stderr.flush()
