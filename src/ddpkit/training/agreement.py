"""``StepAgreement``: the ranks decide together, once per step, whether any of them raised a flag.

A rank that stops alone leaves the others waiting in their next collective (Lightning's SIGTERM
handling hung that way, #20806), so the ranks must stop at the same step, and agreeing takes an
all-reduce (of two numbers: the flag and the step time). Waited for at once in every step, it
adds its latency to every step, and on a GPU reading its result stalls the host until the device
has caught up (Lightning later made its per-step SIGTERM broadcast optional for that cost,
#21487). So:

- short steps: a round's all-reduce is started in one call and read in the next round's, by
  when it has long finished (on a GPU the host reads a copy made on the device's stream behind
  it, through an event, not a whole-device sync), and steps shorter than
  ``ROUND_INTERVAL_SECONDS`` share a round. The decision comes a round late: at most about
  twice the longer of a step and the interval after the flag.
- long steps (the slowest rank's steps took ``WAIT_AT_ONCE_SECONDS`` or more): each round is
  waited for in its own call, so the decision comes at the end of the step the flag was raised
  in, and the wait is small beside the step.

Each choice (skip this call, read late, wait at once) follows from the values of an earlier
round, which are the same on every rank, and from the count of calls, so every rank makes the
same one. Every rank must call ``decide`` at the same points of its loop (once per step, say).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.comm.collective_call import collective_call
from ddpkit.comm.primitives import communication_device
from ddpkit.diagnostics.waits import wait_for
from ddpkit.environments.preemption import PreemptionNotice, preemption_signals
from ddpkit.logs import get_logger
from ddpkit.membership.connection import distributed_available
from ddpkit.membership.group import Group, Membership, current_group

__all__ = ["ROUND_INTERVAL_SECONDS", "WAIT_AT_ONCE_SECONDS", "GrowthWatch", "PreemptionAgreement", "StepAgreement"]

_log = get_logger("recovery")

# From this step time on the all-reduce is waited for at once: a decision a step late would
# cost that much more, while the wait (a round trip, and on a GPU the host waiting for the
# device) is a small part of the step.
WAIT_AT_ONCE_SECONDS = 0.1
# Shorter steps share one round per this many seconds: a round costs about as much as a tiny
# all-reduce (a fraction of a millisecond on Gloo), which on a 10 ms step is several per cent.
ROUND_INTERVAL_SECONDS = 0.1

_MICROSECONDS = 1_000_000


class _Round:
    """One all-reduce of [flag, step time in µs] (MAX over the ranks) on its way."""

    def __init__(self, flag: bool, step_seconds: float, device: torch.device) -> None:
        values = torch.tensor([int(flag), int(step_seconds * _MICROSECONDS)], dtype=torch.int64)
        self._device_copy: tuple[torch.Tensor, Any] | None = None
        if device.type == "cuda":
            # Every copy is asynchronous, from and to pinned memory, and NCCL's wait makes the
            # current stream wait, not the host; reading waits for the event behind them only.
            values = values.pin_memory().to(device, non_blocking=True)
        with collective_call("step agreement", None, values):
            self._work = dist.all_reduce(values, op=dist.ReduceOp.MAX, async_op=True)
        self._values = values
        if device.type == "cuda":
            self._work.wait()
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._device_copy = (host, event)

    def result(self) -> tuple[bool, float]:
        """(some rank raised its flag, the slowest rank's step time in seconds)."""
        if self._device_copy is not None:
            host, event = self._device_copy
            event.synchronize()
            flag, micros = host.tolist()
        else:
            with collective_call("step agreement (wait)", fingerprint=False):
                wait_for(self._work)
            flag, micros = self._values.tolist()
        return flag > 0, micros / _MICROSECONDS


class StepAgreement:
    """``decide(flag)`` is True on every rank at the same call, from the first call at which some
    rank's flag has been seen, and stays True. Without a process group it is the flag itself.

    Short steps share a round: about one per ``round_interval_seconds`` (a flag raised between
    rounds is kept for the next); ``wait_at_once_seconds`` is the step time from which each
    round is waited for in its own call (0: always).
    """

    def __init__(self, wait_at_once_seconds: float = WAIT_AT_ONCE_SECONDS,
                 round_interval_seconds: float = ROUND_INTERVAL_SECONDS) -> None:
        self.wait_at_once_seconds = wait_at_once_seconds
        self.round_interval_seconds = round_interval_seconds
        self._pending: _Round | None = None
        self._wait_at_once = wait_at_once_seconds <= 0
        self._decided = False
        self._flag_raised = False
        self._calls_until_round = 0  # calls that pass without a round (the same count on every rank)
        self._calls_since_round = 0
        self._last_round: float | None = None
        self._follows_group = False

    def decide(self, flag: bool) -> bool:
        if self._decided:
            return True
        if not distributed_available():
            self._decided = flag
            return flag
        if not self._follows_group:
            group = current_group()
            if group is not None:
                group.on_reconfigure(self._forget_pending_round)
            self._follows_group = True
        self._flag_raised = self._flag_raised or flag
        self._calls_since_round += 1
        if self._calls_until_round > 0:
            self._calls_until_round -= 1
            return False
        now = time.perf_counter()
        step_seconds = 0.0 if self._last_round is None else (now - self._last_round) / self._calls_since_round
        self._last_round, self._calls_since_round = now, 0
        if self._pending is not None:  # the previous round, read a round late
            self._take(self._pending.result())
            self._pending = None
            if self._decided:
                return True
        pending = _Round(self._flag_raised, step_seconds, communication_device(None))
        if self._wait_at_once:
            self._take(pending.result())
        else:
            self._pending = pending
        return self._decided

    def _forget_pending_round(self, _: Membership) -> None:
        """The group was formed again (``ddpkit.membership.group``): the round on its way belonged to the
        abandoned one, whose collective will not complete. Agree afresh, from the state a new
        agreement starts in: a replacement that joins the group starts there, and a survivor that
        still waited for each round at once (slow steps) while the replacement read its first round
        a call late would take a round at another call, skip other calls, and pair its next round
        with another collective of the replacement's."""
        self._pending = None
        self._calls_until_round = self._calls_since_round = 0
        self._last_round = None
        self._wait_at_once = self.wait_at_once_seconds <= 0

    def _take(self, result: tuple[bool, float]) -> None:
        """Act on a round's reduced values, which every rank sees alike."""
        self._decided, slowest = result
        self._wait_at_once = slowest >= self.wait_at_once_seconds
        self._calls_until_round = max(0, int(self.round_interval_seconds / slowest) - 1) if slowest > 0 else 0


class PreemptionAgreement:
    """``DDPStrategy.preempted()``'s parts: this process's preemption notice (SIGTERM and
    DDPKIT_PREEMPTION_SIGNAL caught from the first call on) and the ranks' agreement on it."""

    def __init__(self) -> None:
        self._notice = PreemptionNotice(preemption_signals())
        self._notice.install()
        self._agreement = StepAgreement()

    def decide(self) -> bool:
        """True on every rank at the same call once any rank received a preemption signal."""
        return self._agreement.decide(self._notice.received is not None)

    def close(self) -> None:
        """Give the signals their handlers from before back."""
        self._notice.uninstall()


class GrowthWatch:
    """In a world that shrank: whether a node waits to join, decided by every rank at the same step
    boundary (a ``StepAgreement``, whose rounds cost a tiny all-reduce now and then). Only the group's
    rank 0 reads the store, at most every ``_LOOK_SECONDS``."""

    _LOOK_SECONDS = 0.5

    def __init__(self) -> None:
        self._agreement = StepAgreement()
        self._requested = False
        self._next_look = 0.0

    def decide(self, group: Group) -> bool:
        if group.rank == 0 and not self._requested and time.monotonic() >= self._next_look:
            self._next_look = time.monotonic() + self._LOOK_SECONDS
            if (who := group.growth_requested()) is not None:
                self._requested = True
                _log.warning(f"ddpkit: {who}; the group grows at the next step boundary every rank agrees on")
        return self._agreement.decide(self._requested)
