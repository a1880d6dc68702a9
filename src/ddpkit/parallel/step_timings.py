"""Where this rank's steps go, phase by phase, from what the DDP module sees anyway (issue 49).

A synchronised backward makes every rank's step end at the same moment, so wall-clock step times
are equal on every rank and name nobody. The phases do: a slow rank spends longer in its own
forward and backward, and the others wait for it in the gradients' all-reduce. A step runs from
the end of one gradient synchronisation to the end of the next:

- ``between``: from the end of the last synchronisation to this step's first forward: the
  optimizer step, the data loader, the loop's own code (``DDPStrategy.timings`` splits off the
  optimizer step);
- ``forward``: the module's forwards (every micro-batch's, under ``no_sync``);
- ``backward``: the rest until the synchronisation starts: the loss and this rank's own backward
  (its last gradient ready);
- ``communication``: the synchronisation: what this rank waited for the others' gradients and
  the reduction not hidden behind its backward, then the copy back. With ``overlap_optimizer`` the
  reductions end in the next forward: its waits for them (and their copy back) count here, not in
  ``forward``, which keeps the deferred step's updates; so a rank that waits for a slow one shows it
  here in either mode.

Four clock readings a step (``time.perf_counter``; with ``overlap_optimizer`` two more per bucket the
next forward waits for) and one small record: nothing measurable beside a step
(``benchmarks/ddp_step.py`` runs with them). Under ``ddpkit run --report-every``/``--metrics`` each
step also goes to a ``WindowRecorder`` (``diagnostics.step_windows``), for the launcher."""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, fields

from ddpkit.diagnostics.step_windows import WindowRecorder

__all__ = ["PHASES", "StepClock", "StepTimings"]

PHASES = ("between", "forward", "backward", "communication")


@dataclass(frozen=True)
class StepTimings:
    """Medians over the last ``steps`` steps, in seconds (0.0 for each when none was timed).
    ``optimizer`` and ``data`` are the strategy's split of ``between`` (None from the module alone:
    it does not see the optimizer)."""

    steps: int
    between: float
    forward: float
    backward: float
    communication: float
    step: float
    optimizer: float | None = None
    data: float | None = None

    def as_dict(self) -> dict[str, float | int | None]:
        return {field.name: getattr(self, field.name) for field in fields(self)}


class StepClock:
    """The phases of this rank's last ``keep`` steps (see the module docstring). The DDP module's
    forward writes ``first_forward`` and adds to ``forward_seconds`` itself (plain attributes: its
    frame is left to Dynamo's callers, and a method call there would be a frame Dynamo compiles);
    its reducer calls ``synchronisation_started``/``_ended`` around each gradient synchronisation."""

    def __init__(self, keep: int = 100) -> None:
        self._steps: deque[tuple[float, float, float, float]] = deque(maxlen=keep)
        self._optimizer: deque[float] = deque(maxlen=keep)
        self._last_sync_end: float | None = None
        self.first_forward: float | None = None  # this step's first forward began (perf_counter)
        self.forward_seconds = 0.0  # this step's forwards so far, less their waits for held reductions
        #: Seconds spent waiting for held reductions (overlap_optimizer), ever: the reducer adds to it,
        #: and the forward takes what its own call added out of ``forward_seconds`` into ``forward_waits``.
        self.awaited_seconds = 0.0
        self.forward_waits = 0.0  # this step's forwards' waits for held reductions
        self._optimizer_in_step = 0.0
        self._optimizer_start: float | None = None
        self._sync_start = 0.0
        self.recorder = WindowRecorder.from_environment()  # None unless the launcher asked for windows

    def synchronisation_started(self) -> None:
        self._sync_start = time.perf_counter()

    def synchronisation_ended(self) -> None:
        now = time.perf_counter()
        first, last = self.first_forward, self._last_sync_end
        if first is not None and last is not None and first >= last:  # a whole step: its start is known
            backward = max(0.0, self._sync_start - first - self.forward_seconds - self.forward_waits)
            phases = (first - last, self.forward_seconds, backward, now - self._sync_start + self.forward_waits)
            self._steps.append(phases)
            self._optimizer.append(self._optimizer_in_step)
            if self.recorder is not None:
                self.recorder.add(now, *phases, self._optimizer_in_step)
        self._last_sync_end, self.first_forward, self.forward_seconds, self._optimizer_in_step = now, None, 0.0, 0.0
        self.forward_waits = 0.0

    def optimizer_started(self) -> None:
        self._optimizer_start = time.perf_counter()

    def optimizer_ended(self) -> None:
        """An optimizer step (the strategy's hooks): counted in the ``between`` of the step after it."""
        if self._optimizer_start is not None and self.first_forward is None:
            self._optimizer_in_step += time.perf_counter() - self._optimizer_start
        self._optimizer_start = None

    def timings(self, last: int | None = None, optimizer_timed: bool = False) -> StepTimings:
        """Medians over the last ``last`` steps kept (all by default)."""
        steps = list(self._steps)[-last:] if last else list(self._steps)
        if not steps:
            return StepTimings(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        between, forward, backward, communication = (statistics.median(step[index] for step in steps)
                                                     for index in range(len(PHASES)))
        total = statistics.median(sum(step) for step in steps)
        if not optimizer_timed:
            return StepTimings(len(steps), between, forward, backward, communication, total)
        optimizer = list(self._optimizer)[-len(steps):]
        return StepTimings(len(steps), between, forward, backward, communication, total,
                           optimizer=statistics.median(optimizer),
                           data=statistics.median(step[0] - spent for step, spent in zip(steps, optimizer)))
