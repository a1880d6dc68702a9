"""Hang diagnosis: when a collective waits longer than a set time, say who has not arrived and
where every rank is.

On by default: a ddpkit collective (a DDP synchronisation, a barrier, ...) that waits
``DEFAULT_HANG_SECONDS`` (60 s, Horovod's stall-check default) is reported. That is ten times
below ddpkit's process-group timeout (10 minutes) and far above a slow step: the time counted is
what one rank waits for the others inside a collective, not a step. A rank that legitimately
waits that long (rank 0 writing a large checkpoint while the others wait in a barrier) only gets
a report that shows it. Set ``DDPKIT_HANG_SECONDS=N`` (or ``watch_for_hangs(N)`` on every rank)
to choose, ``DDPKIT_HANG_SECONDS=0`` to turn it off.

Each rank notes in memory the sequence number, operation and call site of every ddpkit
collective it enters (no communication on the training path); a thread of each rank publishes
that progress in the process group's store when it has changed, at most once every
``_progress_seconds`` (a sixth of the set time, 1 to 10 s: a report comes that late anyway, and
an answer to a request carries the rank's latest), and checks once a second:

- if this rank's collective has waited longer than the set time and it is the first of the
  waiting ranks to claim the report of that collective (one signed key: the others log one line
  naming the reporter, so a hang of W ranks costs the store W answers, not W^2), it asks every
  rank for its stack (a counter in the store), and about a second later logs a report: the
  collective, the ranks that have not arrived (their last collective is an earlier one) and each
  rank's last collective and current Python stack (that of its main thread, read by the thread
  even while the main thread is blocked);
- if another rank asked, it posts its own stack. Under ``ddpkit run`` across nodes a request is
  news its launcher relays (``diagnostics.relayed_news``): the count of requests is read when the
  news changed, and every ``relayed_news.FALLBACK_SECONDS`` besides; elsewhere every second.

A rank that cannot answer is named and described: on the reporting rank's machine, a stopped
process (SIGSTOP, a debugger) is said to be stopped; a running one whose threads cannot run is
most likely inside a C extension that holds the GIL, and when it runs under ddpkit's worker
bootstrap its stack is read anyway (faulthandler writes it from a signal handler, without the GIL).

The collective itself goes on waiting (the process-group timeout, or ``ddpkit.diagnostics.failures``,
still ends it), unless ``DDPKIT_HANG_ABORT_SECONDS=N`` is set (off by default, as Horovod's stall
shutdown): then, N seconds after its report, a rank still waiting for a rank that has not arrived
(the reporter) publishes a ``HangError`` failure naming that rank (the first of them) as the root cause, with the
report as its traceback. Every rank in a ddpkit collective raises ``PeerFailedError`` naming the
stuck rank, those elsewhere are ended by the peer watch, and ``ddpkit run`` names the stuck rank
as the root cause, not the rank that timed out. Where every rank is inside the collective (a slow
peer or network, no one missing), nothing is ended. ``last_report()`` returns the latest report,
for tests and tools.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ddpkit.diagnostics.failures import record_failure, record_signer
from ddpkit.diagnostics.quiet_requests import quiet_requests
from ddpkit.diagnostics.records import failure_record
from ddpkit.diagnostics.relayed_news import FALLBACK_SECONDS, announce, relayed_news
from ddpkit.diagnostics.settings import WORKER_SECONDS_SETTINGS, seconds_setting
from ddpkit.logs import get_logger
from ddpkit.process_state import PROCESS
from ddpkit.store import keys as store_keys
from ddpkit.variables import DDPKIT_HANG_ABORT_SECONDS, DDPKIT_HANG_SECONDS, DDPKIT_STACK_FILE

__all__ = ["DEFAULT_HANG_SECONDS", "last_report", "watch_for_hangs"]

_log = get_logger("diagnostics")

DEFAULT_HANG_SECONDS = 60.0
# Once a second: the reports come a minute late anyway, and the store is shared by every rank.
_POLL_SECONDS = 1.0
# How long a rank that runs under ddpkit's bootstrap gets to write its stack after SIGUSR1.
_SIGNALLED_STACK_SECONDS = 0.5
# How long the reporting rank waits for the others' stacks.
_GATHER_SECONDS = 2.5


class HangWatch:
    """One process's record of the collective it is in, and the thread that watches it."""

    def __init__(self, seconds: float, group: Any, store: Any) -> None:
        # A weak reference: a strong one would keep the group's connections open after
        # destroy_process_group, and peers blocked on them would not be freed (ddpkit.diagnostics.failures).
        self.seconds, self.group, self.store = seconds, weakref.ref(group), store
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.main_thread = threading.main_thread().ident
        self.entered = 0
        self.last_entered = "no ddpkit collective yet"
        self.published = 0  # the sequence number last published in the store
        self.current: tuple[int, str, str, float] | None = None  # (sequence, operation, call site, start)
        self.reported_sequence = 0
        self.reported_at = 0.0
        self.missing: list[int] = []  # the ranks that had not arrived at the reported collective
        self.abort_seconds = 0.0  # DDPKIT_HANG_ABORT_SECONDS, set by start_hang_watch in the main thread
        self.ended_sequence = 0
        self.requests_answered = 0
        self.report = ""
        self.progress_published_at = -math.inf
        self.news, self.requests_read_at = relayed_news(), -math.inf
        # Every value is signed with the job secret when there is one: a forged progress would name
        # the wrong rank, a forged process record would have the reporting rank signal any pid and
        # read any file (its "stack file").
        self.signer = record_signer()
        # Where this process is, for a reporting rank on the same machine when this one cannot answer.
        self._write(store_keys.hang_process(self.rank), json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "stack_file": os.environ.get(DDPKIT_STACK_FILE)}))
        self._thread = threading.Thread(target=self._run, name="ddpkit-hang-watch", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        return self._thread.is_alive()

    def enter(self, operation: str, call_site: str) -> None:
        """This rank enters collective ``operation``, called at ``call_site``: memory only, since it
        runs on the training path (the watch thread publishes it)."""
        self.entered += 1
        self.current = (self.entered, operation, call_site, time.monotonic())
        self.last_entered = f"#{self.entered} {operation} at {call_site}"

    def leave(self) -> None:
        self.current = None

    def _run(self) -> None:
        while True:
            time.sleep(_POLL_SECONDS)
            if PROCESS.hangs.watch is not self or _configured_seconds() <= 0:
                return  # turned off, or replaced by the watch of a new process group
            try:
                self._check()
            except Exception:  # noqa: BLE001 - the store is gone (the job is ending): stop watching
                return

    def _check(self) -> None:
        entered, last_entered = self.entered, self.last_entered
        if entered != self.published and time.monotonic() - self.progress_published_at >= _progress_seconds(self.seconds):
            self._write(store_keys.hang_progress(self.rank), last_entered)
            self.published, self.progress_published_at = entered, time.monotonic()
        current = self.current
        if current is not None and current[0] != self.reported_sequence and time.monotonic() - current[3] > self.seconds:
            self.reported_sequence = current[0]
            # One rank of those waiting gathers the report (the first to claim it): each of the
            # others asking every rank for its stack and reading them all cost the store W^2
            # requests in a hang of W ranks. The others say who reports, and answer its request.
            with quiet_requests():
                reporter = self.signer.write_first(self.store, self.signer.key(store_keys.hang_reporter(current[0])),
                                                   str(self.rank))
            if reporter != str(self.rank):
                self.ended_sequence = current[0]  # the reporter ends the job, if that is asked
                self.report = (f"ddpkit: rank {self.rank} has waited {time.monotonic() - current[3]:.1f} s in "
                               f"collective #{current[0]} {current[1]} at {current[2]}; rank {reporter} gathers every "
                               "rank's stack and reports this hang.\n")
                _log.warning(self.report.rstrip("\n"))
                self._answer_requests()
                return
            # The requests' count cannot be signed: a stranger who adds to it makes every rank post its
            # stack (signed, so not forged), nothing more.
            with quiet_requests():
                request = self.store.add(self.signer.key(store_keys.HANG_REQUESTS), 1)
                announce(self.store)  # the others' launchers relay it to their watches
            self._answer_requests(request)
            self.report, self.missing = self._build_report(current, request)
            self.reported_at = time.monotonic()
            _log.warning(self.report.rstrip("\n"))
            return
        if (current is not None and current[0] == self.reported_sequence != self.ended_sequence
                and self.abort_seconds > 0 and time.monotonic() - self.reported_at > self.abort_seconds):
            self.ended_sequence = current[0]
            self._end_the_job(current)
            return
        if self._requests_may_have_come():
            self._answer_requests()

    def _requests_may_have_come(self) -> bool:
        """Whether to read the count of requests now: without relayed news always; with it when
        the news changed, or none came for ``FALLBACK_SECONDS``."""
        news = self.news
        if news is not None and not news.changed() and time.monotonic() - self.requests_read_at < FALLBACK_SECONDS:
            return False
        self.requests_read_at = time.monotonic()
        return True

    def _answer_requests(self, latest: int | None = None) -> None:
        """Post this rank's stack for every request it has not answered, up to ``latest`` (None: the
        store's count).

        Every one, not only the latest: the requests of hangs in two collectives may be read at
        once. It also runs while this watch gathers a report or waits for a signalled stack: a rank
        whose Python runs must never look silent, or a peer would describe it as stuck in a C
        extension and signal it (faulthandler's dump of threads that run can crash the process).
        """
        if latest is None:
            with quiet_requests():
                latest = self.store.add(self.signer.key(store_keys.HANG_REQUESTS), 0)
        if latest <= self.requests_answered:
            return
        frame = sys._current_frames().get(self.main_thread) if self.main_thread is not None else None
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no main thread)\n"
        current = self.current
        where = f"in #{current[0]} {current[1]} at {current[2]}" if current else f"in no collective (entered {self.entered})"
        # At most one request per rank comes from one hang; a stranger can raise the count (it is not
        # signed), so no more than that many are answered at once.
        for request in range(max(self.requests_answered + 1, latest - self.world_size + 1), latest + 1):
            self._write(store_keys.hang_stack(request, self.rank), f"{where}\n{stack}")
        self.requests_answered = latest

    def _end_the_job(self, current: tuple[int, str, str, float]) -> None:
        """Publish the first missing rank's hang as the job's failure (DDPKIT_HANG_ABORT_SECONDS).

        The group is not torn down from this thread: the main thread's wait reads the record and
        raises, as every other rank's does.
        """
        sequence, operation, call_site, started = current
        setting = f"{DDPKIT_HANG_ABORT_SECONDS}={self.abort_seconds:g}"
        if not self.missing:
            _log.warning(f"ddpkit: {setting}: not ending the job: every rank is inside collective #{sequence} "
                         f"{operation} (a slow peer or network); the process-group timeout still bounds it.")
            return
        stuck = self.missing[0]
        message = (f"rank {stuck} did not arrive at collective #{sequence} {operation} (called at {call_site}), for "
                   f"which rank {self.rank} waited {time.monotonic() - started:.1f} s; {setting} ended the job "
                   f"{self.abort_seconds:g} s after the hang report. Where every rank was: the report below.")
        _log.error(f"ddpkit: ending the job: {message}")
        record_failure(failure_record(stuck, "HangError", message, self.report), tear_down=False)

    def _build_report(self, current: tuple[int, str, str, float], request: int) -> tuple[str, list[int]]:
        sequence, operation, call_site, started = current
        keys = [store_keys.hang_stack(request, rank) for rank in range(self.world_size)]
        deadline = time.monotonic() + _GATHER_SECONDS
        while time.monotonic() < deadline and not self._all_written(keys):
            time.sleep(0.05)
            self._answer_requests()
        lines = [f"\nddpkit: rank {self.rank} has waited {time.monotonic() - started:.1f} s in collective "
                 f"#{sequence} {operation} at {call_site}."]
        missing, sections = [], []
        for rank, key in enumerate(keys):
            progress = self._read(store_keys.hang_progress(rank)) or "no ddpkit collective yet"
            entered = int(progress[1:].split()[0]) if progress.startswith("#") else 0
            answer = self._read(key)
            entered = max(entered, _entered_by_answer(answer))  # an answer is newer than the published progress
            if entered < sequence:
                missing.append(rank)
            stack = answer or self._describe_silent_rank(rank, key)
            sections.append(f"--- rank {rank}: last entered {progress}; now {stack}")
        lines.append(f"Ranks that have not arrived: {missing or 'none (they are in it: a slow peer or the network)'}.")
        return "\n".join(lines) + "\n" + "".join(sections), missing

    def _describe_silent_rank(self, rank: int, stack_key: str) -> str:
        """What can be said of a rank whose watch thread did not post its stack under ``stack_key``."""
        process = json.loads(self._read(store_keys.hang_process(rank)) or "{}")
        host, pid, stack_file = process.get("host"), process.get("pid"), process.get("stack_file")
        where = f"pid {pid} on {host}"
        if host != socket.gethostname() or not isinstance(pid, int):
            return (f"no answer ({where}): it is stopped (SIGSTOP, a debugger), or inside a C extension that holds "
                    f"the GIL, or its machine is unreachable. `py-spy dump --pid {pid}` on {host} shows where.\n")
        state = _process_state(pid)
        if state is None:
            return f"no answer ({where}): the process has ended.\n"
        if state in "Tt":
            return (f"no answer ({where}): the process is STOPPED (SIGSTOP, or a debugger holds it), so its stack "
                    f"cannot be read. `kill -CONT {pid}` resumes it.\n")
        description = (f"no answer ({where}, state {state}): the process runs but its Python threads cannot, so it is "
                       "most likely inside a C extension that holds the GIL.")
        late_answer = self._read(stack_key)  # posted while the ranks before it were described
        if late_answer:
            return late_answer
        stack = _signalled_stack(pid, stack_file, self._answer_requests)
        if stack:
            return f"{description} Its threads' stacks (faulthandler):\n{stack}"
        return f"{description} `py-spy dump --pid {pid}` shows where.\n"

    # The store's requests: its host may be gone (the job is ending), which the watch's end says,
    # not torch's warning (``quiet_requests``).
    def _write(self, name: str, value: str) -> None:
        with quiet_requests():
            self.signer.write(self.store, self.signer.key(name), value)

    def _read(self, name: str) -> str | None:
        """The value of ``name`` one of the job's ranks wrote; None when there is none (or only a forged one)."""
        with quiet_requests():
            return self.signer.read(self.store, self.signer.key(name))

    def _all_written(self, names: list[str]) -> bool:
        with quiet_requests():
            return bool(self.store.check([self.signer.key(name) for name in names]))


def _entered_by_answer(answer: str | None) -> int:
    """The last collective a rank entered, as its answer to a request says (``_answer_requests``:
    "in #N ..." or "in no collective (entered N)"); 0 without an answer."""
    if answer is None:
        return 0
    where = answer.split("\n", 1)[0]
    if where.startswith("in #"):
        return int(where[4:].split()[0])
    if where.startswith("in no collective (entered "):
        return int(where.removeprefix("in no collective (entered ").split(")")[0])
    return 0


def _progress_seconds(seconds: float) -> float:
    """How often a rank's progress is published for a watch that reports after ``seconds``."""
    return min(10.0, max(1.0, seconds / 6))


def _process_state(pid: int) -> str | None:
    """The state letter of a process of this machine (R running, S sleeping, T stopped, ...), or
    None when it has ended (or /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            state = handle.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None
    return None if state in "ZX" else state


def _signalled_stack(pid: int, stack_file: str | None, between_reads: Callable[[], None]) -> str:
    """The stacks a process under ddpkit's worker bootstrap writes to its stack file on SIGUSR1
    (``workers.worker``; from a signal handler, so without the GIL); '' when it has none.
    ``between_reads`` runs while it waits (this watch answers its peers' requests meanwhile)."""
    if not stack_file:
        return ""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            if b"ddpkit.workers.worker" not in handle.read():
                return ""  # not the worker any more (its pid was reused): SIGUSR1 could end that process
        offset = os.path.getsize(stack_file)
        os.kill(pid, signal.SIGUSR1)
    except OSError:
        return ""
    deadline = time.monotonic() + _SIGNALLED_STACK_SECONDS
    written = ""
    while time.monotonic() < deadline:
        time.sleep(0.05)
        between_reads()
        try:
            with open(stack_file, encoding="utf-8", errors="replace") as handle:
                handle.seek(offset)
                written = handle.read()
        except OSError:
            return ""
    return written


def watch_for_hangs(seconds: float | None) -> None:
    """Report collectives that wait longer than ``seconds`` (None: follow ``DDPKIT_HANG_SECONDS``,
    ``DEFAULT_HANG_SECONDS`` when unset; 0: off). Call it on every rank."""
    if seconds is not None and seconds < 0:
        raise ValueError(f"watch_for_hangs(seconds={seconds}): give a positive number of seconds, 0 or None.")
    PROCESS.hangs.seconds = seconds


def last_report() -> str:
    """The latest hang report of this process ('' when none)."""
    return PROCESS.hangs.watch.report if PROCESS.hangs.watch is not None else ""


def _configured_seconds() -> float:
    if PROCESS.hangs.seconds is not None:
        return PROCESS.hangs.seconds
    return seconds_setting(DDPKIT_HANG_SECONDS, DEFAULT_HANG_SECONDS, WORKER_SECONDS_SETTINGS[DDPKIT_HANG_SECONDS])


def start_hang_watch() -> HangWatch | None:
    """Start this process's hang watch for the current default group unless it runs already, and
    return it; None when hang diagnosis is off. ``Group.install_diagnostics`` starts it at
    connection; ddpkit's collectives call it too, for a group that other code made."""
    seconds = _configured_seconds()
    if seconds <= 0 or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None  # off, or no one to wait for
    watch: HangWatch | None = PROCESS.hangs.watch
    group = dist.distributed_c10d._get_default_group()
    if watch is None or watch.group() is not group or not watch.running():  # first use, a new group, or turned back on
        watch = PROCESS.hangs.watch = HangWatch(seconds, group, dist.distributed_c10d._get_default_store())
    watch.seconds = seconds
    watch.abort_seconds = seconds_setting(DDPKIT_HANG_ABORT_SECONDS, 0.0,
                                           WORKER_SECONDS_SETTINGS[DDPKIT_HANG_ABORT_SECONDS])
    return watch
