"""The launchers' heartbeats: each says it is alive from a thread of its own, through a store client
of its own (its main thread may be busy ending workers for seconds), and reads the others' beats
to know how long each has been silent.

A beat is the launcher's id and a count. Under in-place recovery a beat after the first replaces
only this launcher's own last one: a launcher that finds another's there was taken for lost, and a
spare node beats as its node now (``replaced``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from ddpkit.launching.launcher_records import LauncherRecords
from ddpkit.launching.node_claims import ClaimKind, claim_kind, claimant, launcher_of, step_aside_request
from ddpkit.logs import get_logger
from ddpkit.process_state import PROCESS
from ddpkit.store import keys

__all__ = ["Heartbeats"]

_log = get_logger("launching")

# One that said nothing for the silent time was killed with its workers, or its host is gone: the
# others then end theirs instead of leaving their ranks waiting for the lost node's (in a
# collective, or while the group forms) until torch's timeout.
_BEAT_SECONDS = 1.0
_SILENT_SECONDS = 10.0
# Under in-place recovery across nodes a lost node is taken over by a spare node while the others'
# workers wait for it, so it is noticed sooner: beats four times a second, lost after 2 s of silence.
_IN_PLACE_BEAT_SECONDS = 0.25
_IN_PLACE_SILENT_SECONDS = 2.0
# How long ``stop`` waits for a beat under way (on a link that works, milliseconds).
_STOP_SECONDS = 1.0


class Heartbeats:
    """This launcher's beat, and what it heard of the others'."""

    SILENT_SECONDS = _SILENT_SECONDS  # the silent time out of place (a preemption's source waits that long)

    def __init__(self, records: LauncherRecords, in_place: bool) -> None:
        self._records = records
        self.beat_seconds = _IN_PLACE_BEAT_SECONDS if in_place else _BEAT_SECONDS
        self.silent_seconds = _IN_PLACE_SILENT_SECONDS if in_place else _SILENT_SECONDS
        self._in_place = in_place
        self.launcher_id = os.urandom(6).hex()  # tells this launcher's beats from a former one's of the same node
        self._heard: dict[int, tuple[str, float]] = {}  # node -> (its last beat, when it changed here)
        self._silent_since: dict[int, float] = {}  # node -> when it was first seen silent (waiting for a claim)
        self._stopped = threading.Event()  # set: stop beating
        self._thread: threading.Thread | None = None
        self.replaced = threading.Event()  # set: a spare node beats as this node

    def beat_through(self, store: Any) -> None:
        """Say this launcher is alive every beat, through ``store`` (a client for this alone), from a
        daemon thread, until ``stop``."""
        key = self._records.key(keys.of(keys.BEAT, self._records.node_rank), keys.JOB_WIDE)

        def beat() -> None:
            count, last = 0, None
            while not self._stopped.is_set():
                count += 1
                value = self._records.sign(key, f"{self.launcher_id}:{count}")
                try:
                    if last is None or not self._in_place:
                        store.set(key, value)
                    elif bytes(store.compare_set(key, last, value)) != value.encode():
                        self.replaced.set()
                        return
                except Exception:  # the store is gone: the main thread finds out at its next request
                    return
                last = value
                self._stopped.wait(self.beat_seconds)

        self._thread = threading.Thread(target=beat, name="ddpkit-launcher-beat", daemon=True)
        self._thread.start()

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

    def last_beats(self, nodes: list[int]) -> dict[int, str | None]:
        """``last_beat`` of each of ``nodes``, read at once (``LauncherRecords.read_many``)."""
        beats = self._records.read_many([keys.of(keys.BEAT, node) for node in nodes], keys.JOB_WIDE)
        return dict(zip(nodes, beats, strict=True))

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

    def silent_launchers(self, nodes: list[int]) -> dict[int, str]:
        """The last beat of each of ``nodes``' launchers that has been silent for the silent time (read
        now, at once, and compared with what this launcher heard before)."""
        now = time.monotonic()
        return {node: beat for node, beat in self.last_beats(nodes).items()
                if beat is not None and self.silent_for(node, beat, now) > self.silent_seconds}

    def forget(self, node: int) -> None:
        """What was heard of ``node`` (this launcher is that node now)."""
        self._heard.pop(node, None)
        self._silent_since.pop(node, None)
