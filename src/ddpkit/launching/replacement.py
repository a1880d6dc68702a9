"""The launcher's side of in-place recovery (``ddpkit run --recovery in-place``).

For one start of the workers, ``Replacements`` keeps a warm spare (``launching.worker --spare``:
torch and ddpkit imported, waiting for a rank) and decides, when workers fail, whether the spare
can take over:

- exactly one worker ended, killed by a signal (SIGKILL, the out-of-memory killer, a crash),
  without recording an exception: its peers can go on once it is replaced. A worker whose
  script raised would most likely raise again: that failure goes the usual way (the job ends,
  or restarts with ``--max-restarts``);
- no recovery is under way (a failure during one ends the job: its state transfer cannot be
  trusted), the budget (``--max-restarts``, shared with full restarts) is not spent, and the
  spare is alive.

The spare gets the lost worker's variables plus the group's next generation
(``DDPKIT_GENERATION``) and a file to write once it holds the survivors' state
(``DDPKIT_READY_FILE``); a new spare starts warming up at once. A recovery that does not finish
within ``DDPKIT_RECOVERY_TIMEOUT_SECONDS`` (plus a margin) fails the job. torch-free, as the
launcher is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence

from ddpkit.diagnostics.settings import seconds_setting
from ddpkit.environments import DDPKIT_GENERATION, RECOVERY_TIMEOUT_SECONDS, RECOVERY_TIMEOUT_VARIABLE
from ddpkit.launching.processes import READY_FILE_VARIABLE, WorkerProcess, WorkerProcesses, describe_exit
from ddpkit.logs import get_logger

__all__ = ["Replacements", "recovery_timeout_seconds"]

_log = get_logger("launching")

# The ranks give up meeting after DDPKIT_RECOVERY_TIMEOUT_SECONDS; the launcher waits a little
# longer, so that a rank's own message comes first.
_MARGIN_SECONDS = 5.0


class Replacements:
    """Warm spares and in-place replacements for one start of a node's workers."""

    def __init__(self, workers: WorkerProcesses, command: Sequence[str], environment: Mapping[str, str],
                 rank_variables: Callable[..., dict[str, str]], budget: int) -> None:
        self._workers, self._command, self._environment = workers, list(command), dict(environment)
        self._rank_variables = rank_variables  # local rank -> the variables of that worker
        self.budget = budget
        self.used = 0
        self.generation = 0
        self._pending: tuple[WorkerProcess, str, float, float] | None = None  # (replacement, ready file, start, deadline)
        self._timeout = recovery_timeout_seconds() + _MARGIN_SECONDS
        self._spare = workers.start_spare(self._command, self._environment)

    def replace(self, failed: Sequence[WorkerProcess]) -> bool:
        """Hand the rank of the one lost worker in ``failed`` to the spare, if it can be (see the
        module docstring); False leaves the failure to the caller."""
        if self._pending is not None or len(failed) != 1 or self.used >= self.budget:
            return False
        lost = failed[0]
        code = lost.process.poll()
        if code is None or code >= 0 or os.path.exists(lost.error_file) or self._spare.process.poll() is not None:
            return False
        self.used += 1
        self.generation += 1
        ready_file = os.path.join(self._workers.folder, f"ready{self.generation}")
        variables = {**self._rank_variables(lost.local_rank), DDPKIT_GENERATION: str(self.generation),
                     READY_FILE_VARIABLE: ready_file}
        spare = self._spare
        self._workers.replace(lost, spare, variables)
        _log.warning(f"ddpkit run: {lost} {describe_exit(code)}; the spare (pid {spare.process.pid}) takes over its "
                     f"rank in place (replacement {self.used} of {self.budget}; the other ranks keep running)")
        now = time.monotonic()
        self._pending = (spare, ready_file, now, now + self._timeout)
        self._spare = self._workers.start_spare(self._command, self._environment)  # the next one warms up
        return True

    def recovering(self) -> WorkerProcess | None:
        """The replacement whose recovery is under way, if any."""
        return self._pending[0] if self._pending is not None else None

    def check(self) -> str | None:
        """Follow the recovery under way: None while it goes on or when it is over; a description of
        the failure when it did not finish in time."""
        if self._pending is None:
            return None
        replacement, ready_file, started, deadline = self._pending
        if os.path.exists(ready_file):
            _log.warning(f"ddpkit run: {replacement} holds the survivors' state: recovered in place "
                         f"{time.monotonic() - started:.2f} s after the loss")
            self._pending = None
            return None
        if time.monotonic() > deadline:
            return (f"the in-place recovery of rank {replacement.rank} did not finish within "
                    f"{deadline - started:.0f} s (DDPKIT_RECOVERY_TIMEOUT_SECONDS): the ranks did not meet again.")
        return None


def recovery_timeout_seconds() -> float:
    """``DDPKIT_RECOVERY_TIMEOUT_SECONDS`` (``ValueError`` naming it when it is not a number)."""
    return seconds_setting(RECOVERY_TIMEOUT_VARIABLE, RECOVERY_TIMEOUT_SECONDS, "60")
