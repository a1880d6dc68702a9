"""Preemption: a signal that asks the job to save and stop, and the exit code that says it did.

A scheduler that takes the machines back warns first: SIGTERM, then SIGKILL after a grace
(Slurm's KillWait, Kubernetes' terminationGracePeriodSeconds), or a signal of the user's choice
ahead of time (Slurm's ``--signal=USR1@90``). ``ddpkit run`` passes it on to its workers as
SIGTERM; srun, mpirun or Kubernetes send it to every process themselves. In each worker a
``PreemptionNotice`` notes it, and ``DDPStrategy.preempted()`` turns the notes of all ranks into
one decision taken at the same step everywhere (``ddpkit.training.agreement``), so that every rank saves
and exits with ``PREEMPTED_EXIT_CODE``; run again, the script resumes from that checkpoint.

The signal besides SIGTERM comes from DDPKIT_PREEMPTION_SIGNAL: ``ddpkit run --preemption-signal``
sets it for the launcher and its workers alike, and a script started by srun or mpirun reads it too.

This module imports no torch: the launcher uses it too.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from types import FrameType
from typing import Any

from ddpkit.variables import DDPKIT_PREEMPTION_SIGNAL

__all__ = ["PREEMPTED_EXIT_CODE", "SAME_NOTICE_SECONDS", "PreemptionNotice", "parse_signal", "preemption_signals"]

# sysexits.h's EX_TEMPFAIL, "a temporary failure; the user is invited to retry": the job saved
# its work and stopped because the machines were taken back, not because anything broke.
PREEMPTED_EXIT_CODE = 75

# Signals a notice must leave alone: SIGINT stays Ctrl-C (KeyboardInterrupt), SIGKILL and SIGSTOP
# cannot be caught, SIGCHLD and SIGCONT come with every child and every resume.
_NOT_FOR_PREEMPTION = frozenset({signal.SIGINT, signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGCONT})


def parse_signal(value: str, origin: str = DDPKIT_PREEMPTION_SIGNAL) -> signal.Signals:
    """``"USR1"``, ``"SIGUSR1"`` or ``"10"`` as a signal; ``origin`` names the setting in the error."""
    text = value.strip().upper()
    try:
        parsed = signal.Signals(int(text)) if text.isdigit() else signal.Signals[text if text.startswith("SIG") else
                                                                                  "SIG" + text]
    except (KeyError, ValueError):
        raise ValueError(f"{origin}={value!r} is not a signal; give a name such as TERM or USR1 (as in Slurm's "
                         "--signal=USR1@90), or its number.") from None
    if parsed in _NOT_FOR_PREEMPTION:
        raise ValueError(f"{origin}={value!r}: {parsed.name} cannot announce a preemption (SIGINT stays Ctrl-C; "
                         "SIGKILL, SIGSTOP, SIGCHLD and SIGCONT are not for it); use TERM or USR1, say.")
    return parsed


def preemption_signals(environment: Mapping[str, str] = os.environ) -> tuple[signal.Signals, ...]:
    """SIGTERM, and the signal named by ``DDPKIT_PREEMPTION_SIGNAL`` when it names another."""
    signals = [signal.SIGTERM]
    chosen = environment.get(DDPKIT_PREEMPTION_SIGNAL, "").strip()
    if chosen and (parsed := parse_signal(chosen)) not in signals:
        signals.append(parsed)
    return tuple(signals)


# A preemption signal this soon after the first is the same notice delivered twice: under
# `srun ddpkit run`, Slurm signals every process of the step and the launcher passes it on too.
SAME_NOTICE_SECONDS = 2.0


class PreemptionNotice:
    """Catches the preemption signals in this process and remembers the first one.

    The first signal only sets ``received``: the training loop stops at a step the ranks agree on.
    Another within ``same_notice_seconds`` is the same notice delivered twice and changes
    nothing. One after that is a second request: the handlers are put back and the signal acts
    as it would have without them (SIGTERM ends the process), so an impatient scheduler or user
    still gets what they asked for.
    """

    def __init__(self, signals: tuple[signal.Signals, ...], same_notice_seconds: float = SAME_NOTICE_SECONDS) -> None:
        self.signals = signals
        self.same_notice_seconds = same_notice_seconds
        self.received: signal.Signals | None = None
        self._received_at = 0.0
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> None:
        """Catch the signals from now on (main thread only, as every Python signal handler)."""
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._note)

    def uninstall(self) -> None:
        """Put back the handlers that were there before ``install``."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None:
            self.received, self._received_at = signal.Signals(signum), time.monotonic()
            return
        if time.monotonic() - self._received_at < self.same_notice_seconds:
            return
        self.uninstall()
        os.kill(os.getpid(), signum)
