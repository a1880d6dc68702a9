"""Each rank's steps summed up per window of wall-clock time (issue 49): the record a worker
appends to its file and the launcher reads (``health.job_health``), and the worker's recorder.

Under ``ddpkit run`` (``--report-every`` or ``--metrics``), the launcher gives each worker a file
(``DDPKIT_METRICS_FILE``) and a window length (``DDPKIT_METRICS_SECONDS``). The DDP module's step
clock (``parallel.step_timings``) hands each step's phases to a ``WindowRecorder``; at the first
step of the next window it appends one JSON line for the window that ended: a ``RankWindow``.
Windows start at multiples of their length since the epoch, so the ranks' windows line up
without talking to each other. A step costs one list append; a window one line written.

A ``RankWindow`` line (one JSON object; times in seconds, phases medians over the window's steps):
``{"rank": 1, "start": 1795770600.0, "seconds": 60.0, "steps": 812, "between": ..., "forward": ...,
"backward": ..., "communication": ..., "optimizer": ... or null, "data": ..., "step": ...,
"step_p90": ..., "covered": ...}`` (``covered``: the seconds the window's steps took together).
``compute`` is forward + backward: the rank's own work in a step.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from ddpkit.variables import DDPKIT_METRICS_FILE, DDPKIT_METRICS_SECONDS

__all__ = ["RankWindow", "WindowRecorder", "read_windows"]


@dataclass(frozen=True)
class RankWindow:
    """What one rank's steps did in one window (medians over its steps; see the module docstring)."""

    rank: int
    start: float  # the window's start, seconds since the epoch
    seconds: float  # its length
    steps: int
    between: float
    forward: float
    backward: float
    communication: float
    optimizer: float | None  # None: not timed (the DDP module without ddpkit's strategy)
    data: float  # between minus the optimizer step: the data loader and the loop's own code
    step: float
    step_p90: float
    covered: float  # the seconds its steps took together: less than ``seconds`` in a run's first and last windows

    @property
    def compute(self) -> float:
        """The rank's own work in a step: its forward and its backward until its gradients were ready."""
        return self.forward + self.backward

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> RankWindow:
        return cls(int(value["rank"]), float(value["start"]), float(value["seconds"]), int(value["steps"]),
                   float(value["between"]), float(value["forward"]), float(value["backward"]),
                   float(value["communication"]), None if value.get("optimizer") is None else float(value["optimizer"]),
                   float(value["data"]), float(value["step"]), float(value["step_p90"]), float(value["covered"]))


def read_windows(path: str, offset: int) -> tuple[list[RankWindow], int]:
    """The whole lines appended to ``path`` from ``offset`` on, and the offset after them (a line
    being written is left for the next read); a missing file has none."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            written = handle.read()
    except OSError:
        return [], offset
    complete = written[: written.rfind(b"\n") + 1]
    windows = []
    for line in complete.decode("utf-8", errors="replace").splitlines():
        try:
            windows.append(RankWindow.from_dict(json.loads(line)))
        except (ValueError, KeyError, TypeError):
            continue  # not a window line: nothing to learn from it
    return windows, offset + len(complete)


class WindowRecorder:
    """Collects this rank's steps of the current window and appends its ``RankWindow`` once the
    next window's first step ends (``from_environment``: when the launcher asked for them)."""

    def __init__(self, path: str, seconds: float, to_wall: float | None = None) -> None:
        self.path, self.seconds = path, seconds
        # What turns a step's end (a perf_counter reading) into wall-clock time.
        self._to_wall = time.time() - time.perf_counter() if to_wall is None else to_wall
        self._window_end = -math.inf  # perf_counter reading
        self._window_start = 0.0  # wall clock
        self._steps: list[tuple[float, float, float, float, float]] = []

    @classmethod
    def from_environment(cls) -> WindowRecorder | None:
        path, seconds = os.environ.get(DDPKIT_METRICS_FILE), os.environ.get(DDPKIT_METRICS_SECONDS)
        try:
            length = float(seconds) if seconds else 0.0
        except ValueError:
            return None  # set by ddpkit run only: a malformed value is not the user's to fix
        return cls(path, length) if path and length > 0 else None

    def add(self, ended: float, between: float, forward: float, backward: float, communication: float,
            optimizer: float) -> None:
        """One step, which ended at ``ended`` (perf_counter), its phases in seconds."""
        if ended >= self._window_end:
            if self._steps:
                self._write()
            wall = ended + self._to_wall
            self._window_start = wall - wall % self.seconds
            self._window_end = self._window_start + self.seconds - self._to_wall
            self._steps = []
        self._steps.append((between, forward, backward, communication, optimizer))

    def _write(self) -> None:
        steps, timed = self._steps, any(step[4] for step in self._steps)
        between, forward, backward, communication, optimizer = (statistics.median(step[index] for step in steps)
                                                                for index in range(5))
        totals = sorted(sum(step[:4]) for step in steps)
        window = RankWindow(
            _rank(), self._window_start, self.seconds, len(steps), between, forward, backward, communication,
            optimizer if timed else None, statistics.median(step[0] - step[4] for step in steps),
            statistics.median(totals), totals[min(len(totals) - 1, int(0.9 * len(totals)))], sum(totals))
        try:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(window.to_json() + "\n")
        except OSError:
            pass  # the launcher's folder is gone (it is ending the job): nothing to report to


def _rank() -> int:
    """This process's rank now (a shrunk world renumbers the ranks)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))
