"""The launchers' heartbeats: each says it is alive from a thread of its own, through a store client
of its own (its main thread may be busy ending workers for seconds), and reads the beats it
watches to know how long each has been silent.

A beat is the launcher's id and a count. Under in-place recovery a beat after the first replaces
only this launcher's own last one: a launcher that finds another's there was taken for lost, and a
spare node beats as its node now (``replaced``).

Not every launcher reads every beat: that would cost the store N beats' worth of bytes per look
per node, N^2 in all. Of the world's live nodes in order, the first one's launcher watches every
other node, and each other launcher the two nodes before it in a ring (``watched``): every node is
watched by the first and by the two after it, so any two nodes lost together are still seen at
once. A launcher that finds a node silent reports it
(``report_silent``, once per silence for the whole job, in the launchers' log ``silent``); every
launcher reads the reports when the job's news changes and believes them (``believe_silent``):
the silent node's beat is then read by every launcher, until it is decided (the job ends, the
world shrinks without it, or a spare node beats as it).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from ddpkit.control_plane.launcher_records import LauncherRecords
from ddpkit.control_plane.node_claims import ClaimKind, claim_kind, claimant, launcher_of, step_aside_request
from ddpkit.logs import get_logger
from ddpkit.process_state import PROCESS
from ddpkit.store import keys

__all__ = ["Heartbeats", "watched"]

_log = get_logger("launching")

# One that said nothing for the silent time was killed with its workers, or its host is gone: the
# others then end theirs instead of leaving their ranks waiting for the lost node's (in a
# collective, or while the group forms) until torch's timeout.
_BEAT_SECONDS = 1.0
_SILENT_SECONDS = 10.0
# Under in-place recovery across nodes a lost node is taken over by a spare node while the others'
# workers wait for it, so it is noticed sooner: beats four times a second, lost after 2 s of silence.
_SURVIVORS_WAIT_BEAT_SECONDS = 0.25
_SURVIVORS_WAIT_SILENT_SECONDS = 2.0
# How long ``stop`` waits for a beat under way (on a link that works, milliseconds).
_STOP_SECONDS = 1.0


# How far past the silent time a reported node is believed silent (a report is already the silence).
_BELIEVED_MARGIN = 1e-3


def watched(live: list[int], node: int) -> list[int]:
    """The nodes whose beats ``node``'s launcher watches, of the ``live`` nodes in order: every other
    one for the first node, the two before it for the others (the last two for the second: every
    node is watched by the first and by the two after it, in a ring), none for a node not among
    them (a spare node, or one taken for lost)."""
    if node not in live:
        return []
    position = live.index(node)
    if position == 0:
        return live[1:]
    return sorted({live[position - 1], live[(position - 2) % len(live)]} - {node})


class Heartbeats:
    """This launcher's beat, and what it heard of the others'."""

    SILENT_SECONDS = _SILENT_SECONDS  # the silent time out of place (a preemption's source waits that long)

    def __init__(self, records: LauncherRecords, survivors_go_on: bool) -> None:
        self._records = records
        self.beat_seconds = _SURVIVORS_WAIT_BEAT_SECONDS if survivors_go_on else _BEAT_SECONDS
        self.silent_seconds = _SURVIVORS_WAIT_SILENT_SECONDS if survivors_go_on else _SILENT_SECONDS
        self._survivors_go_on = survivors_go_on
        self.launcher_id = os.urandom(6).hex()  # tells this launcher's beats from a former one's of the same node
        self._heard: dict[int, tuple[str, float]] = {}  # node -> (its last beat, when it changed here)
        self._silent_since: dict[int, float] = {}  # node -> when it was first seen silent (waiting for a claim)
        self._stopped = threading.Event()  # set: stop beating
        self._thread: threading.Thread | None = None
        self.replaced = threading.Event()  # set: a spare node beats as this node

    def beat_through(self, store: Any) -> None:
        """Say this launcher is alive every beat, through ``store`` (a client for this alone), from a
        daemon thread, until ``stop``."""
        beat = self.beats_through(store)

        def beat_until_stopped() -> None:
            while not self._stopped.is_set() and beat():
                self._stopped.wait(self.beat_seconds)

        self._thread = threading.Thread(target=beat_until_stopped, name="ddpkit-launcher-beat", daemon=True)
        self._thread.start()

    def beats_through(self, store: Any) -> Callable[[], bool]:
        """One beat of this launcher's at each call, through ``store``: False once it must beat no
        more (a spare node beats as this node: ``replaced``; the store is gone, which the main
        thread finds out at its next request). ``beat_through`` calls it every beat."""
        key = self._records.key(keys.of(keys.BEAT, self._records.node_rank), keys.JOB_WIDE)
        count, last = 0, ""

        def beat() -> bool:
            nonlocal count, last
            count += 1
            value = self._records.sign(key, f"{self.launcher_id}:{count}")
            try:
                if not last or not self._survivors_go_on:
                    store.set(key, value)
                elif bytes(store.compare_set(key, last, value)) != value.encode():
                    self.replaced.set()
                    return False
            except Exception:  # noqa: BLE001 - the store's client raises several kinds, all meaning it is gone
                return False
            last = value
            return True

        return beat

    def stop(self) -> None:
        """Stop beating. A beat still in torch's store client a moment later (a link down) would end
        the launcher with SIGABRT were it woken while the interpreter finalises: the launcher then
        ends without finalising (``store.client.requests_left_unanswered``)."""
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=_STOP_SECONDS)
            if self._thread.is_alive():
                PROCESS.store_requests_unanswered.set()

    def who(self) -> str:
        """This launcher, as its claims on a node's place name it."""
        return f"node {self._records.node_rank}'s launcher {self.launcher_id}"

    def last_beat(self, node: int) -> str | None:
        """``node``'s launcher's last beat as the store holds it now (None: it never beat)."""
        return self._records.read(keys.of(keys.BEAT, node), keys.JOB_WIDE)

    def silent_for(self, node: int, beat: str, now: float) -> float:
        """How long ``node``'s launcher has been silent as this launcher heard it, ``beat`` being its
        beat read ``now`` (0 when it changed since the last read: then remembered). A beat from a
        new launcher of the node is a spare that took its place, said once."""
        last = self._heard.get(node)
        if last is not None and last[0] == beat:
            return now - last[1]
        if last is not None and launcher_of(last[0]) != launcher_of(beat):
            by = claimant(self._records, node, last[0]) or "unnamed"
            if claim_kind(by) is ClaimKind.SHRINK:
                _log.warning(f"ddpkit run: node {node} is back in the world: a spare node's launcher took its place")
            elif (asked := step_aside_request(self._records, node, launcher_of(last[0]))) is not None:
                _log.warning(f"ddpkit run: node {node}'s launcher stepped aside ({asked}); a spare node ({by}) took "
                             "its place, and this node's workers go on")
            else:
                _log.warning(f"ddpkit run: node {node}'s launcher went silent; a spare node ({by}) took its "
                             "place, and this node's workers go on")
        self._heard[node] = (beat, now)
        self._silent_since.pop(node, None)
        return 0.0

    def seen_silent_since(self, node: int, now: float) -> float:
        """When this launcher first saw ``node`` silent past the silent time (``now`` the first time
        it asks), until a new beat of the node is heard."""
        return self._silent_since.setdefault(node, now)

    def believe_silent(self, node: int, beat: str, now: float) -> None:
        """Take ``node`` for silent past the silent time at ``beat`` (another launcher that watches
        it reported it), unless a later beat of it was heard here."""
        last = self._heard.get(node)
        if last is None or last[0] == beat:
            heard_at = now - self.silent_seconds - _BELIEVED_MARGIN
            self._heard[node] = (beat, heard_at if last is None else min(last[1], heard_at))

    def report_silent(self, node: int, beat: str) -> bool:
        """Tell every launcher that ``node`` went silent at ``beat``, unless one did already: True
        when this launcher's report is the one written."""
        return self._records.append_once(keys.SILENT, f"{node}/{launcher_of(beat)}", f"{node} {beat}")

    def reports_after(self, count: int) -> list[tuple[int, str]]:
        """The silent nodes reported after the first ``count`` reports (``report_silent``), as
        (node, beat), in order."""
        reports = []
        for entry in self._records.read_log(keys.SILENT, count, keys.JOB_WIDE):
            node, _, beat = entry.partition(" ")
            reports.append((int(node) if node.lstrip("-").isdigit() else -1, beat))
        return reports

    def forget(self, node: int) -> None:
        """What was heard of ``node`` (this launcher is that node now)."""
        self._heard.pop(node, None)
        self._silent_since.pop(node, None)
