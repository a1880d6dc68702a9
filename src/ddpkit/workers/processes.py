"""The one process manager: start worker processes, watch them, end them, name the root cause.

``ddpkit run`` (``launching.launcher``), in-script launching (``launching.in_script``) and the
function pool behind ``launch(fn)`` and ``ddpkit.testing.WorkerPool`` (``workers.pool``) start
their workers here, so every worker is started, ended and blamed the same way:

- it runs ``python -m ddpkit.workers.worker ...`` in a session of its own, so that ending its
  process group also ends its children (DataLoader workers, say);
- it is told ``DDPKIT_LAUNCHER_PID`` (it dies with the process that started it),
  ``DDPKIT_ERROR_FILE`` (where it records its first failure: ``diagnostics.failures.record_failure``)
  ``DDPKIT_STACK_FILE`` (where it writes its threads' stacks on SIGUSR1) and, when the launcher
  reports the job's health, ``DDPKIT_METRICS_FILE`` (its step windows: ``health.job_health``);
- when several fail, ``root_cause`` picks the one whose failure caused the others', from those records.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddpkit.diagnostics.records import read_error_record, record_time
from ddpkit.environments.preemption import PREEMPTED_EXIT_CODE
from ddpkit.variables import (
    DDPKIT_ERROR_FILE,
    DDPKIT_LAUNCHER_PID,
    DDPKIT_METRICS_FILE,
    DDPKIT_METRICS_SECONDS,
    DDPKIT_STACK_FILE,
)
from ddpkit.workers.output import OutputPlan, WorkerOutput
from ddpkit.workers.worker_template import SERVE_FUNCTIONS, SPARE, ForkedProcess, WorkerTemplate

__all__ = ["SERVE_FUNCTIONS", "SPARE", "WorkerProcess", "WorkerProcesses", "describe_exit"]

# How long workers get to write their stacks after SIGUSR1.
_STACK_DUMP_WAIT_SECONDS = 0.5


def describe_exit(code: int | None) -> str:
    """'exited with code N' or 'was killed by signal NAME', for a process's return code."""
    if code is not None and code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


@dataclass(eq=False)
class WorkerProcess:
    """One worker that this process started and watches."""

    local_rank: int
    rank: int
    process: subprocess.Popen[bytes] | ForkedProcess  # forked: by the node's template (workers.worker_template)
    error_file: str  # where it records its first failure (DDPKIT_ERROR_FILE)
    stack_file: str  # where it appends its stacks on SIGUSR1 (DDPKIT_STACK_FILE)
    metrics_file: str = ""  # where it appends its step windows (DDPKIT_METRICS_FILE), when asked for
    reaped: bool = False  # its process group has been killed and the process waited for
    output: WorkerOutput | None = None  # where its streams go, unless to the launcher's own

    def __str__(self) -> str:
        return f"rank {self.rank} (local rank {self.local_rank}, pid {self.process.pid})"


class WorkerProcesses:
    """The workers this process started, and a private folder for their records and stacks.

    ``close`` (or leaving the ``with`` block) ends the workers still running and removes the folder.
    """

    def __init__(self, purpose: str, output: OutputPlan | None = None, log_folder: str | None = None,
                 window_seconds: float | None = None, template: WorkerTemplate | None = None) -> None:
        self.folder = tempfile.mkdtemp(prefix=f"ddpkit-{purpose}-")
        # Where workers are forked from, when they can be (``workers.worker_template``); the
        # caller's to close.
        self._template = template
        self._window_seconds = window_seconds  # the workers' step windows (``health.job_health``); None: none
        # Where the workers' streams go (``workers.output``; None: the launcher's own), and the
        # folder of this start's log files, one subfolder per local rank (or spare).
        self._output, self._log_folder = output, log_folder
        self.workers: list[WorkerProcess] = []
        self.spares: list[WorkerProcess] = []  # warm spares (in-place recovery), rank -1 until they take one
        self.retired: list[WorkerProcess] = []  # lost workers whose rank a spare took

    def __enter__(self) -> WorkerProcesses:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close(grace=0.0)

    def start(self, command: Sequence[str], environment: Mapping[str, str], rank: int, local_rank: int,
              handed: Mapping[str, int] | None = None) -> WorkerProcess:
        """Start ``command`` (a ``ddpkit.workers.worker`` command line) as the worker of ``rank``,
        with each descriptor of ``handed`` open in it, its number in the variable it is given under."""
        worker = self._launch(command, environment, f"rank{rank}", rank, local_rank, handed=handed)
        self.workers.append(worker)
        return worker

    def start_spare(self, command: Sequence[str], environment: Mapping[str, str]) -> WorkerProcess:
        """Start a warm spare (``python -m ddpkit.workers.worker --spare ...``): a worker without a
        rank yet, whose standard input is a pipe from here (``replace`` writes its rank there);
        forked from the node's template where the workers are."""
        spare = self._launch(command, environment, f"spare{len(self.spares) + len(self.retired)}", -1, -1,
                             spare=True)
        self.spares.append(spare)
        return spare

    def _launch(self, command: Sequence[str], environment: Mapping[str, str], name: str, rank: int, local_rank: int,
                spare: bool = False, handed: Mapping[str, int] | None = None) -> WorkerProcess:
        """One worker process in a session of its own, told its launcher, error file and stack file
        (a ``spare``: with its standard input a pipe from here; ``handed``: ``start``'s)."""
        handed = handed or {}
        popen: dict[str, Any] = {}
        error_file, stack_file = (os.path.join(self.folder, f"{name}.{kind}") for kind in ("json", "stacks"))
        variables = {DDPKIT_LAUNCHER_PID: str(os.getpid()), DDPKIT_ERROR_FILE: error_file,
                     DDPKIT_STACK_FILE: stack_file}
        metrics_file = ""
        if self._window_seconds is not None:
            metrics_file = os.path.join(self.folder, f"{name}.windows")
            variables.update({DDPKIT_METRICS_FILE: metrics_file, DDPKIT_METRICS_SECONDS: f"{self._window_seconds:g}"})
        output = None
        if self._output is not None:
            folder = None if self._log_folder is None else os.path.join(self._log_folder,
                                                                        name if spare else str(local_rank))
            routing = None if spare else self._output.routing(local_rank)
            output = WorkerOutput(folder, routing, name)
            popen.update(output.popen_arguments())
            if routing is not None:
                variables.update(routing.variables())
        process: subprocess.Popen[bytes] | ForkedProcess | None = None
        if self._template is not None and output is None:  # its streams are this process's, as the template's
            process = self._template.fork(command, {**environment, **variables}, with_input=spare, handed=handed)
        if process is None:
            started = subprocess.Popen(list(command), env={**environment, **variables,
                                                           **{variable: str(fd) for variable, fd in handed.items()}},
                                       start_new_session=True, stdin=subprocess.PIPE if spare else None,
                                       pass_fds=tuple(handed.values()), **popen)
            if output is not None:
                output.started(started)
            process = started
        return WorkerProcess(local_rank, rank, process, error_file, stack_file, metrics_file, output=output)

    def replace(self, lost: WorkerProcess, spare: WorkerProcess, variables: Mapping[str, str]) -> None:
        """Give ``lost``'s rank to ``spare``, which then runs the script with ``variables`` added to its
        environment; what is left of ``lost`` (its children) is killed."""
        self.assign(spare, variables, lost.rank, lost.local_rank, instead_of=lost)
        _signal_group(lost.process, signal.SIGKILL)
        lost.process.wait()
        lost.reaped = True
        self.retired.append(lost)

    def assign(self, spare: WorkerProcess, variables: Mapping[str, str], rank: int, local_rank: int,
               instead_of: WorkerProcess | None = None) -> None:
        """Make ``spare`` the worker of ``rank`` (in ``instead_of``'s place when given): it runs the
        script with ``variables`` added to its environment."""
        assert spare.process.stdin is not None  # start_spare made the pipe
        routing = None if self._output is None else self._output.routing(local_rank)
        if routing is not None:
            variables = {**variables, **routing.variables()}
        spare.process.stdin.write(json.dumps(dict(variables)).encode() + b"\n")
        spare.process.stdin.close()
        spare.rank, spare.local_rank = rank, local_rank
        if spare.output is not None and routing is not None:
            spare.output.assign(routing, f"rank{rank}")
        self.spares.remove(spare)
        if instead_of is None:
            self.workers.append(spare)
        else:
            self.workers[self.workers.index(instead_of)] = spare

    def failed(self, also_fine: Sequence[int] = (), among: Sequence[WorkerProcess] | None = None) -> list[WorkerProcess]:
        """The workers (of ``among``, when given) that have ended with a non-zero code or a signal,
        other than ``PREEMPTED_EXIT_CODE`` (it saved and stopped with the others) and ``also_fine``."""
        return [worker for worker in (self.workers if among is None else among)
                if worker.process.poll() not in (None, 0, PREEMPTED_EXIT_CODE, *also_fine)]

    def recorded_before(self, moment: float) -> list[WorkerProcess]:
        """The workers that recorded an exception before ``moment`` (as ``time.time()``): failures of
        their own, whether they then exited by themselves or were ended by the launcher."""
        return [worker for worker in self.workers
                if (record := read_error_record(worker.error_file)) is not None and record_time(record) < moment]

    def exit_codes(self) -> list[int | None]:
        """Each worker's exit code (minus the signal that ended it), None while it runs."""
        return [worker.process.poll() for worker in self.workers]

    def notify(self, sig: int) -> None:
        """Send ``sig`` to each running worker's own process, not its group: its children (DataLoader
        workers) are the worker's to end."""
        for worker in self.workers:
            if worker.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.process.pid, sig)

    def root_cause(self, failed: Sequence[WorkerProcess]) -> tuple[WorkerProcess, dict[str, object] | None]:
        """The worker whose failure caused the others', and its record.

        One of ``failed`` that ended without recording an exception (killed by a signal, or a
        deliberate ``sys.exit``) comes first: its peers' errors ("connection closed") are its
        consequences. Otherwise the earliest recorded exception of any worker, whether or not it
        had exited yet: a worker records its exception first, then tells its peers
        (``ddpkit.diagnostics.failures``), which may fail and exit before it does.
        """
        records = {worker.rank: read_error_record(worker.error_file) for worker in self.workers}
        for worker in failed:
            if records[worker.rank] is None and worker.process.poll() is not None:
                return worker, None
        recorded = [(record, worker) for worker in self.workers if (record := records[worker.rank]) is not None]
        if not recorded:
            return failed[0], None
        record, worker = min(recorded, key=lambda pair: record_time(pair[0]))
        # A record names the rank that failed, which is not always the one that wrote it: a rank
        # stuck in a hang is named by the rank that waited for it (ddpkit.diagnostics.hangs).
        named = [other for other in self.workers if other.rank == int(str(record["rank"]))]
        return (named[0] if named else worker), record

    def describe_root_cause(self, failed: Sequence[WorkerProcess]) -> str:
        """One paragraph naming the root cause (``root_cause``): the rank, how it ended, its traceback."""
        return self.root_cause_summary(failed)[0]

    def root_cause_summary(self, failed: Sequence[WorkerProcess]) -> tuple[str, float | None]:
        """``describe_root_cause``'s paragraph, and when its exception was recorded (None: the
        worker ended without recording one), from one reading of the records."""
        return self.summary_of(*self.root_cause(failed))

    @staticmethod
    def summary_of(worker: WorkerProcess, record: dict[str, object] | None) -> tuple[str, float | None]:
        """``root_cause_summary`` of a root cause already found (``root_cause``)."""
        if record is None:
            return f"{worker} {describe_exit(worker.process.poll())} without recording an exception.", None
        return (f"{worker} failed first with {record['type']}: {record['message']}\n"
                f"{str(record['traceback']).rstrip()}", record_time(record))

    def forget_failures(self) -> None:
        """Remove the failure records, so that the next failure is recorded (workers that live on
        through several tasks, as the pool's do)."""
        for worker in self.workers:
            with contextlib.suppress(FileNotFoundError):
                os.remove(worker.error_file)

    def stacks(self, ranks: Sequence[int] | None = None) -> list[tuple[WorkerProcess, str]]:
        """The Python stacks of every running worker (of ``ranks``, when given), as each wrote them.

        SIGUSR1 goes to the worker only, not its process group: its children have no handler.
        """
        offsets = []
        for worker in self.workers:
            if (ranks is None or worker.rank in ranks) and worker.process.poll() is None:
                offsets.append((worker, _size(worker.stack_file)))
                os.kill(worker.process.pid, signal.SIGUSR1)
        time.sleep(_STACK_DUMP_WAIT_SECONDS)
        stacks = []
        for worker, offset in offsets:
            try:
                with open(worker.stack_file, encoding="utf-8", errors="replace") as handle:
                    handle.seek(offset)
                    written = handle.read().rstrip()
            except OSError:
                written = ""
            stacks.append((worker, written or "(nothing written)"))
        return stacks

    def end(self, grace: float) -> list[WorkerProcess]:
        """SIGTERM (and SIGCONT) to each live worker's process group, SIGKILL after ``grace`` seconds, reap every worker.

        The SIGKILL goes to every group, finished or not: it also reaches grandchildren left behind.
        Returns the workers (not the spares) that had ended by themselves before it signalled them,
        and those killed by a SIGKILL before its own (killed by themselves, the out-of-memory
        killer, an operator): a launcher slow to poll, or a worker slow to die, still lets it learn
        which ends were not its own doing.
        """
        for spare in self.spares:
            if spare.process.stdin is not None and not spare.process.stdin.closed:
                with contextlib.suppress(OSError):
                    spare.process.stdin.close()  # the spare leaves by itself when its pipe closes
        pending = [worker for worker in [*self.workers, *self.spares] if not worker.reaped]
        ended_before = []
        for worker in pending:
            if worker.process.poll() is None:
                _signal_group(worker.process, signal.SIGTERM)
                # A stopped worker (SIGSTOP, a debugger) acts on SIGTERM only once continued, as
                # systemd and a shell's kill also know: without this it would wait out the grace.
                _signal_group(worker.process, signal.SIGCONT)
            elif worker in self.workers:
                ended_before.append(worker)
        deadline = time.monotonic() + grace
        while any(worker.process.poll() is None for worker in pending) and time.monotonic() < deadline:
            time.sleep(0.02)
        # Until here only SIGTERM and SIGCONT came from this launcher: a SIGKILL was someone else's.
        ended_before += [worker for worker in pending if worker in self.workers and worker not in ended_before
                         and worker.process.poll() == -signal.SIGKILL]
        for worker in pending:
            _signal_group(worker.process, signal.SIGKILL)
            worker.process.wait()
            worker.reaped = True
        for worker in pending:
            if worker.output is not None:
                worker.output.close()  # the last lines it wrote reach the console and its files
        return ended_before

    def close(self, grace: float) -> None:
        """``end`` the workers and remove their folder."""
        self.end(grace)
        shutil.rmtree(self.folder, ignore_errors=True)


def _signal_group(process: subprocess.Popen[bytes] | ForkedProcess, sig: int) -> None:
    """Send ``sig`` to the process group (session) a worker was started in, if it still exists."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
