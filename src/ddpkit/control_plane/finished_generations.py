"""Finished generations of the workers' group removed from the job's store, so that its keys do not
grow with the recoveries of a long run.

Each generation (``ddpkit.membership.generations``) leaves keys under its prefix: a claim for each
rank, the count of arrivals, its records (a layout, a lost node, a growth), and torch's own keys of
the group formed there (an address a rank). Nobody reads a generation's keys once two later ones
were counted: the workers meet the latest one or the one before it (a member replaced while the
last formed), and a read of a layout goes back only to the latest written. So one launcher (the
first live node's, which also reads every beat) removes them: when the job's count of generations
reaches G, it writes the layout in force at G - 2 there (``carry_layout_forward``: a rank that joins
later reads back no further), lists the store's keys once and removes those of generation G - 3 and
before, a few at each poll of its watch, so that a recovery of a big world costs the store no burst.

A process still waiting in a removed generation (a node whose link came back after two recoveries)
finds no claim on its rank and waits until the recovery timeout, then ends: its launcher ended its
workers already, taken for lost.
"""

from __future__ import annotations

from ddpkit.control_plane.launcher_records import LauncherRecords
from ddpkit.membership.generations import carry_layout_forward, generation_prefix
from ddpkit.store import keys
from ddpkit.store.job_secret import job_secret

__all__ = ["KEPT_GENERATIONS", "FinishedGenerations"]

#: The latest generations counted whose keys stay: the one forming, the one before it (a member
#: replaced while it formed), and one more, whose layout the later ones read.
KEPT_GENERATIONS = 3
# Keys removed at each poll of the watch (every 0.05 s by default): at most 320 a second, a trickle
# beside the beats of a thousand nodes (4,000 a second).
_REMOVED_PER_POLL = 16


class FinishedGenerations:
    """What one launcher removes of the generations that finished, look by look."""

    def __init__(self, records: LauncherRecords) -> None:
        self._records = records
        self._removed_through = -1  # generations up to this one are removed, or queued to be
        self._queued: list[str] = []
        self._attempt = records.attempt

    def on_news(self) -> None:
        """A launcher wrote something: when the job counted a generation since, queue the keys of
        those now finished (one ``add`` for the count; a list of the store's keys when some are)."""
        if self._records.attempt != self._attempt:  # a restart cleared every worker key already
            self._attempt, self._removed_through, self._queued = self._records.attempt, -1, []
        latest = self._records.count(keys.GENERATION_COUNT, 0, keys.JOB_WIDE)
        finished = latest - KEPT_GENERATIONS
        if finished <= self._removed_through:
            return
        records, secret = self._records, job_secret()
        records.call(carry_layout_forward, records.store, secret, self._attempt, finished + 1)
        prefixes = tuple(generation_prefix(secret, self._attempt, generation)
                         for generation in range(self._removed_through + 1, finished + 1))
        self._queued += [key for key in records.call("list_keys") if key.startswith(prefixes)]
        self._removed_through = finished

    def remove_some(self) -> int:
        """Remove up to ``_REMOVED_PER_POLL`` of the queued keys; how many were."""
        batch, self._queued = self._queued[:_REMOVED_PER_POLL], self._queued[_REMOVED_PER_POLL:]
        for key in batch:
            self._records.call("delete_key", key)
        return len(batch)
