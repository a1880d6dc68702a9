"""``ddpkit run --stragglers replace`` (issue 49, item 4): a node whose rank was named a straggler
(``health.job_health``) is asked to step aside, and a waiting spare node takes its place as it
would a lost node's (``launching.spare_node``): the spare's warm workers take the node's ranks in
the next generation of the group, the other nodes' workers recover in place and train the step
in flight again, and the slow node's launcher, replaced, ends its workers and leaves (exit 0).
Without a spare the world may shrink without the node instead (``check``).

Only node 0's launcher names stragglers across nodes, so it is the one that asks. It never asks
itself (it reports the job's health), nor the node whose launcher hosts the job's store (a c10d
rendezvous's endpoint, unless ``ddpkit store`` holds it): the job would end with it. A node is
asked once (per launcher there). When no spare node claims its place within ``SPARE_SECONDS``, the
world shrinks without it if it may (``--nnodes MIN:MAX``, more than MIN nodes left: the others take
its ranks' shares of each global batch, as after a lost node), else the node stays, named.

On one node nothing can be replaced: a straggler's ranks cannot leave the node's hardware (the
launcher says so once, ``one_node_note``, and stragglers are named only).

torch-free, as the launcher is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ddpkit.control_plane.launcher_records import NodeContactLostError
from ddpkit.control_plane.nodes import NodeCoordination
from ddpkit.health.job_health import Straggler
from ddpkit.logs import get_logger

__all__ = ["SPARE_SECONDS", "StepAside", "one_node_note"]

_log = get_logger("launching")

#: How long a spare node has to claim a node asked to step aside before the world shrinks without
#: it instead (spares look twenty times a second).
SPARE_SECONDS = 2.0


def one_node_note() -> str:
    """What ``--stragglers replace`` does on one node: nothing but naming."""
    return ("ddpkit run: --stragglers replace on one node: a straggler's ranks cannot leave this node's hardware, so "
            "stragglers are named only. Across nodes (--nnodes MIN:MAX --rdzv-backend c10d --recovery in-place) a "
            "spare node takes a straggling node's place.")


@dataclass
class StepAside:
    """Node 0's launcher's answer to a straggler named (``JobHealth.on_named``): True when its node
    was asked to step aside now."""

    nodes: NodeCoordination
    _said: set[str] = field(default_factory=set)  # notes said once
    _asked: dict[int, tuple[str, str, float]] = field(default_factory=dict)  # node -> (beat, reason, when) unanswered

    def __call__(self, straggler: Straggler) -> bool:
        node = straggler.node
        if node == self.nodes.node_rank:
            self._say_once("self", f"ddpkit run: --stragglers replace: node {node} is not replaced: its launcher reports "
                                   "the job's health (and may host the job's store); it stays, named")
            return False
        world = self.nodes.world
        try:
            if node == self.nodes.step_asides.store_host_node():
                self._say_once("store", f"ddpkit run: --stragglers replace: node {node} is not replaced: its launcher "
                                        "hosts the job's store, which would end with it (keep the store outside the "
                                        "nodes with `ddpkit store` to let any node but node 0 be replaced)")
                return False
            if not world.node_losses_left():
                self._say_once("spent", f"ddpkit run: --stragglers replace: node {node} is not replaced: the job "
                                        f"recovered from all the lost or replaced nodes --max-restarts allows")
                return False
            reason = f"named a straggler: {straggler.describe()}"
            beat = self.nodes.heartbeats.last_beat(node)
            if beat is None or not self.nodes.step_asides.ask(node, beat, reason):
                return False  # its launcher never beat, or it was asked before
        except NodeContactLostError:
            return False  # the store is gone: the watch's own checks end the attempt
        shrinks = world.shrinking is not None
        _log.warning(f"ddpkit run: asking a waiting spare node to take node {node}'s place ({reason}); without one, "
                     + ("the world shrinks without it" if shrinks else f"node {node} stays"))
        self._asked[node] = (beat, reason, time.monotonic())
        return True

    def check(self) -> None:
        """Each poll of the job's health: a node asked to step aside that no spare node claimed within
        ``SPARE_SECONDS`` is shrunk away when the world may shrink (``--nnodes MIN:MAX``), else left."""
        world = self.nodes.world
        for node, (beat, reason, asked_at) in list(self._asked.items()):
            try:
                claimed = world.claimant(node, beat) is not None
                if not claimed and time.monotonic() - asked_at < SPARE_SECONDS:
                    continue
                del self._asked[node]
                if claimed:
                    continue  # a spare node took its place
                if world.shrink_without_straggler(node, beat, reason):
                    continue
            except NodeContactLostError:
                return  # the store is gone: the watch's own checks end the attempt
            _log.warning(f"ddpkit run: no spare node took node {node}'s place within {SPARE_SECONDS:g} s, and the "
                         "world may not shrink without it: it stays, named")

    def _say_once(self, what: str, text: str) -> None:
        if what not in self._said:
            self._said.add(what)
            _log.warning(text)
