"""``ddpkit run --stragglers replace`` (issue 49, item 4): a node whose rank was named a straggler
(``launching.health``) is asked to step aside, and a waiting spare node takes its place as it
would a lost node's (``launching.spare_node``): the spare's warm workers take the node's ranks in
the next generation of the group, the other nodes' workers recover in place and train the step
in flight again, and the slow node's launcher, replaced, ends its workers and leaves (exit 0).

Only node 0's launcher names stragglers across nodes, so it is the one that asks. It never asks
itself (it reports the job's health), nor the node whose launcher hosts the job's store (a c10d
rendezvous's endpoint, unless ``ddpkit store`` holds it): the job would end with it. A node is
asked once (per launcher there); without a spare node waiting, the request stays unanswered
and the node stays, named. On one node nothing can be replaced: a straggler's ranks cannot leave
the node's hardware (``check_one_node`` says so once, and stragglers are named only).

torch-free, as the launcher is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddpkit.launching.health import Straggler
from ddpkit.launching.launcher_records import NodeContactLostError
from ddpkit.launching.nodes import NodeCoordination
from ddpkit.logs import get_logger

__all__ = ["StepAside", "one_node_note"]

_log = get_logger("launching")


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

    def __call__(self, straggler: Straggler) -> bool:
        node = straggler.node
        if node == self.nodes.node_rank:
            self._say_once("self", f"ddpkit run: --stragglers replace: node {node} is not replaced: its launcher reports "
                                   "the job's health (and may host the job's store); it stays, named")
            return False
        world = self.nodes.world
        try:
            if node == world.store_host_node():
                self._say_once("store", f"ddpkit run: --stragglers replace: node {node} is not replaced: its launcher "
                                        "hosts the job's store, which would end with it (keep the store outside the "
                                        "nodes with `ddpkit store` to let any node but node 0 be replaced)")
                return False
            if not world.node_losses_left():
                self._say_once("spent", f"ddpkit run: --stragglers replace: node {node} is not replaced: the job "
                                        f"recovered from all the lost or replaced nodes --max-restarts allows")
                return False
            reason = f"named a straggler: {straggler.describe()}"
            if not world.ask_to_step_aside(node, reason):
                return False
        except NodeContactLostError:
            return False  # the store is gone: the watch's own checks end the attempt
        _log.warning(f"ddpkit run: asking a waiting spare node to take node {node}'s place ({reason}); without one, "
                     f"node {node} stays")
        return True

    def _say_once(self, what: str, text: str) -> None:
        if what not in self._said:
            self._said.add(what)
            _log.warning(text)
