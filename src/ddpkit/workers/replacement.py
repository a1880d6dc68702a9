"""The launcher's side of in-place recovery (``ddpkit run --recovery in-place``).

For one start of the workers, ``Replacements`` keeps a warm spare (``workers.worker --spare``:
torch and ddpkit imported, waiting for a rank) and decides, when workers fail, whether the spare
can take over:

- the workers that ended (one, or several at once: a node's local ranks killed together) were
  killed by a signal (SIGKILL, the out-of-memory killer, a crash) without recording an
  exception, and at least one worker lives to hand on the state: their peers can go on once
  they are replaced. A worker whose script raised would most likely raise again: that failure
  goes the usual way (the job ends, or restarts with ``--max-restarts``);
- every surviving worker has said that it can take part in a recovery: its ``DDPStrategy``
  set up with in-place recovery and wrote its ready file (``ready_file``). A script that trains
  without it (a plain torch script, say) cannot re-form its group with a replacement: its loss is
  a failure like any other, and the launcher says so;
- no recovery is under way (a failure during one ends the job: its state transfer cannot be
  trusted), the budget (``--max-restarts``, shared with full restarts) is not spent, and the
  spare is alive. The survivors failing on the very loss being recovered, in a collective between
  steps that in-place recovery cannot redo, is no second fault: the recovery gives its share of
  the budget back, and every worker is restarted as if the launcher had seen their failure first.

The spare gets the lost worker's variables plus the group's next generation
(``DDPKIT_GENERATION``) and a file to write once it holds the survivors' state
(``DDPKIT_READY_FILE``); when several workers were lost, the others' replacements are spares
started then (forked from the node's template, where the workers are: warm; else they import
torch first), and all join the same generation. One recovery spends one of the
budget, however many ranks it replaces. A new spare starts warming up at once. A recovery that
does not finish within ``DDPKIT_RECOVERY_TIMEOUT_SECONDS`` (plus a margin) fails the job. torch-free, as the
launcher is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ddpkit.diagnostics.settings import recovery_timeout_seconds
from ddpkit.logs import get_logger
from ddpkit.ready_file import OUTSIDE, what_it_said
from ddpkit.variables import DDPKIT_READY_FILE, DDPKIT_RECOVERY_TIMEOUT_SECONDS
from ddpkit.workers.processes import WorkerProcess, WorkerProcesses, describe_exit
from ddpkit.workers.worker_template import ForkedProcess

__all__ = ["NO_REPLACEMENTS", "NoReplacements", "Replacements", "ready_file"]

_log = get_logger("launching")

# The ranks give up meeting after DDPKIT_RECOVERY_TIMEOUT_SECONDS; the launcher waits a little
# longer, so that a rank's own message comes first.
_MARGIN_SECONDS = 5.0


def ready_file(folder: str, generation: int, rank: int) -> str:
    """The file the worker of ``rank`` in ``generation`` writes once it can take part in a recovery
    (``DDPKIT_READY_FILE``): generation 0's workers at the end of ``DDPStrategy.setup``, a
    replacement once it holds the survivors' state."""
    return os.path.join(folder, f"ready{generation}.{rank}")


class NoReplacements:
    """Fail fast (``--recovery fail-fast``, the default): no worker is replaced in place; a failure
    ends every worker, and ``--max-restarts`` may start them all again."""

    survivors_go_on = False
    used = 0

    def replace(self, failed: Sequence[WorkerProcess]) -> bool:
        return False

    def recovering(self) -> str:
        return ""

    def check(self) -> str | None:
        return None

    def give_back(self) -> None:
        pass


NO_REPLACEMENTS = NoReplacements()


class Replacements:
    """Warm spares and in-place replacements for one start of a node's workers (each started with
    its ``ready_file`` of generation 0)."""

    survivors_go_on = True

    def __init__(self, workers: WorkerProcesses, command: Sequence[str], environment: Mapping[str, str],
                 rank_variables: Callable[..., dict[str, str]], budget: int, generation: int = 0,
                 next_generation: Callable[[], int] | None = None,
                 announce_loss: Callable[[int, str], None] | None = None) -> None:
        """``generation``: the one the workers were started in (a spare node's take a lost node's
        place in a later one); ``next_generation``: where the next generation's number comes from
        when other nodes form generations too (``NodeWorld.next_generation``), else counted here;
        ``announce_loss(generation, why)``: tells the survivors of ``generation`` that ranks were lost,
        when nothing else would (NCCL notices no peer that was killed: ``joining.announce_loss``)."""
        self._workers, self._command, self._environment = workers, list(command), dict(environment)
        self._rank_variables = rank_variables  # local rank -> the variables of that worker
        self.budget = budget
        self.used = 0
        self.generation = generation
        self._next_generation = next_generation or (lambda: self.generation + 1)
        self._announce_loss = announce_loss
        self._pending: _Recovery | None = None
        self._timeout = recovery_timeout_seconds() + _MARGIN_SECONDS
        # The ready file of the worker that holds each rank now (a replacement's is of its generation).
        self._ready_files = {worker.rank: ready_file(workers.folder, generation, worker.rank)
                             for worker in workers.workers}
        self._spare = workers.start_spare(self._command, self._environment)
        self._spares_started = 0  # spares started again after one ended between recoveries

    def replace(self, failed: Sequence[WorkerProcess]) -> bool:
        """Hand the ranks of the lost workers in ``failed`` to replacements, if they can be (see the
        module docstring); False leaves the failure to the caller."""
        if self._pending is not None or not failed or self.used >= self.budget:
            return False
        if len(failed) >= len(self._workers.workers) or not self._spare_waits():
            return False  # no survivor would hold the state, or no spare can be started again
        codes = [lost.process.poll() for lost in failed]
        if any(code is None or code >= 0 for code in codes) or any(os.path.exists(lost.error_file) for lost in failed):
            return False
        unready = [worker for worker in self._workers.workers
                   if worker not in failed and not os.path.exists(self._ready_files[worker.rank])]
        if unready:
            _log.warning(
                f"ddpkit run: {', '.join(map(str, failed))} {describe_exit(codes[0])} and cannot be replaced in place: "
                f"{', '.join(f'rank {worker.rank}' for worker in unready)} did not set up in-place recovery. A script "
                "recovers in place when it trains with DDPStrategy: setup(model, optimizer) under `ddpkit run --recovery "
                "in-place`, and each step inside `with strategy.step():` (examples/train.py); a plain torch.distributed "
                "script does not. The loss ends every worker instead (restarted while --max-restarts allows).")
            return False
        if self._announce_loss is not None:
            why = f"{', '.join(map(str, failed))} {describe_exit(codes[0])}"
            try:
                self._announce_loss(self.generation, why)
            except Exception as error:  # noqa: BLE001 - torch's store errors have no common base; the replacement goes on
                _log.warning(f"ddpkit run: telling the other ranks that {why} failed ({error}); they learn it when "
                             "their collective times out")
        self.used += 1
        self.generation = self._next_generation()
        started: list[tuple[WorkerProcess, str]] = []
        for number, lost in enumerate(failed):
            spare = self._spare if number == 0 else self._workers.start_spare(self._command, self._environment)
            ready = ready_file(self._workers.folder, self.generation, lost.rank)
            self._ready_files[lost.rank] = ready
            variables = {**self._rank_variables(lost.local_rank, generation=self.generation), DDPKIT_READY_FILE: ready}
            self._workers.replace(lost, spare, variables)
            how = ("the spare" if number == 0 else "another spare, forked from the node's template"
                   if isinstance(spare.process, ForkedProcess) else "a new process (not warm: it imports torch first)")
            _log.warning(f"ddpkit run: {lost} {describe_exit(codes[number])}; {how} (pid {spare.process.pid}) takes "
                         f"over its rank in place (recovery {self.used} of {self.budget}; the other ranks keep running)")
            started.append((spare, ready))
        now = time.monotonic()
        self._pending = _Recovery(started, now, now + self._timeout)
        self._spare = self._workers.start_spare(self._command, self._environment)  # the next one warms up
        return True

    def _spare_waits(self) -> bool:
        """Whether a warm spare waits for a rank, after starting another if it ended (up to
        ``_SPARE_STARTS`` times). Asked before each replacement as well as between recoveries: the
        spare's end and a rank's loss can come in one look (the out-of-memory killer's two victims,
        or a spare killed a moment before), and the loss must not find the spare gone."""
        code = self._spare.process.poll()
        if code is None:
            return True
        if self._spares_started >= _SPARE_STARTS:
            return False
        self._spares_started += 1
        self._spare = self._workers.start_spare(self._command, self._environment)
        _log.warning(f"ddpkit run: the warm spare {describe_exit(code)}; a new one (pid "
                     f"{self._spare.process.pid}) takes its place ({self._spares_started} of {_SPARE_STARTS})")
        return True

    def recovering(self) -> str:
        """The ranks whose in-place recovery is under way ("1, 2"; empty when none is)."""
        return self._pending.ranks() if self._pending is not None else ""

    def give_back(self) -> None:
        """The recovery under way was cut short by the survivors' failure on the very loss it was
        replacing (a collective between steps, which in-place recovery cannot redo): the restart that
        follows is that loss's recovery, so this one gives back its share of the budget. One loss then
        costs one of ``--max-restarts`` whichever the launcher saw first, the lost rank's end (a
        replacement, then the survivors' failure) or the survivors' failure (a restart at once)."""
        if self._pending is None:
            return
        _log.warning(f"ddpkit run: the in-place recovery of rank {self._pending.ranks()} is given up: the other ranks "
                     "failed on that loss where they cannot recover from it; a restart of every worker recovers "
                     "instead, and spends the --max-restarts the recovery took")
        self._pending = None
        self.used -= 1

    def check(self) -> str | None:
        """Follow the recovery under way: None while it goes on or when it is over; a description of
        the failure when it did not finish in time. Between recoveries, a warm spare that ended (killed
        with the others' processes untouched, or by the out-of-memory killer) is started again, up to
        ``_SPARE_STARTS`` times: a lost rank is then still replaced in place, not by a restart of all."""
        pending = self._pending
        if pending is None:
            self._spare_waits()
            return None
        if all(os.path.exists(path) for _, path in pending.replacements):
            several = len(pending.replacements) > 1
            outside = any(what_it_said(path) == OUTSIDE for _, path in pending.replacements)
            _log.warning(f"ddpkit run: the replacement{'s' if several else ''} of rank {pending.ranks()} "
                         + (f"wait{'' if several else 's'} outside the block between steps the other ranks run "
                            "again, and join at their next step boundary: " if outside else
                            f"hold{'' if several else 's'} the survivors' state: ")
                         + f"recovered in place {time.monotonic() - pending.started:.2f} s after the loss")
            self._pending = None
            return None
        if time.monotonic() > pending.deadline:
            return (f"the in-place recovery of rank {pending.ranks()} did not finish within "
                    f"{pending.deadline - pending.started:.0f} s ({DDPKIT_RECOVERY_TIMEOUT_SECONDS}): the ranks did not "
                    "meet again.")
        return None


# How often a spare that ended between recoveries is started again: one that keeps ending (a broken
# environment) stops being replaced, and a lost rank then ends the workers as without a spare.
_SPARE_STARTS = 3


@dataclass
class _Recovery:
    """A recovery under way: each replacement with the file it writes once it holds the state."""

    replacements: list[tuple[WorkerProcess, str]]
    started: float
    deadline: float

    def ranks(self) -> str:
        return ", ".join(str(replacement.rank) for replacement, _ in self.replacements)

