"""The launchers' coordination at many nodes (issue 62): what one launcher asks the job's store while
nothing happens must not grow with the number of nodes, or the store saturates at a few dozen.
(``benchmarks/control_plane.py`` measures the whole control plane at hundreds of nodes.)"""

from __future__ import annotations

import time
from typing import Any

import pytest
from torch.distributed import TCPStore

from ddpkit.launching import heartbeats
from ddpkit.launching.launcher_records import LauncherRecords
from ddpkit.launching.nodes import NodeCoordination
from ddpkit.store import keys
from ddpkit.store.client import BoundedStore, connect


class CountedRequests:
    """A store client that counts the requests made through it."""

    def __init__(self, store: Any) -> None:
        self._store, self.requests = store, 0

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._store, name)
        if name == "set_timeout" or not callable(attribute):
            return attribute

        def counted(*args: Any) -> Any:
            self.requests += 1
            return attribute(*args)

        return counted


def requests_of_a_quiet_watch(nnodes: int, seconds: float) -> int:
    """Node 0's launcher under in-place recovery, polled as ``launching.watch`` polls it (every
    0.05 s) for ``seconds`` while every other node has beaten and nothing else happens: its requests."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    counted = CountedRequests(connect("127.0.0.1", store.port, 10))
    watching = NodeCoordination(BoundedStore(counted, 10), 0, nnodes, "127.0.0.1", store.port, in_place=True)
    for node in range(1, nnodes):  # each other node's beat, signed as its launcher signs it
        other = LauncherRecords(BoundedStore(connect("127.0.0.1", store.port, 10), 10), node, "")
        key = other.key(keys.of(keys.BEAT, node), keys.JOB_WIDE)
        store.set(key, other.sign(key, f"launcher{node}:1"))
    assert not watching.ended_elsewhere()  # the first look reads everything
    counted.requests = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert not watching.ended_elsewhere()
        time.sleep(0.05)
    return counted.requests


@pytest.mark.timeout(60)
def test_a_launchers_quiet_watch_asks_the_store_as_often_at_32_nodes_as_at_4() -> None:
    """The beats it watches read together with the job's count of records written, in one request a
    look (four a second), and the failure, stop and left records only when that count changed:
    before, each look read each node's beat (two requests per node ten times a second) and the
    records every poll (about 650 requests a second at 32 nodes); then the count ten times a second
    and the beats in two requests four times (about 15 a second)."""
    few, many = requests_of_a_quiet_watch(4, 1.5), requests_of_a_quiet_watch(32, 1.5)
    assert many <= few * 1.25 + 2, (few, many)
    assert many <= 1.5 * 4 + 2, many  # one request a look, four looks a second


@pytest.mark.timeout(60)
def test_a_node_gone_silent_is_reported_by_a_launcher_that_watches_it_to_those_that_do_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Four nodes in a ring: node 0's launcher watches every beat, node 1's nodes 0 and 3's, node 2's
    nodes 0 and 1's. Node 3's launcher stops beating: node 0's and node 1's find it silent and one
    reports it, and node 2's, which never read node 3's beat, takes it for lost from the report,
    within a look or two of the others."""
    monkeypatch.setattr(heartbeats, "_IN_PLACE_SILENT_SECONDS", 0.5)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    nodes = [NodeCoordination(BoundedStore(connect("127.0.0.1", store.port, 10), 10), node, 4, "127.0.0.1",
                              store.port, in_place=True) for node in range(4)]
    for node in nodes:
        node.beat_through(connect("127.0.0.1", store.port, 10))
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert [node.silent_node() for node in nodes] == [None] * 4
        time.sleep(0.05)
    assert sorted(nodes[1].looks.beats) == [0, 3] and sorted(nodes[2].looks.beats) == [0, 1]  # what each reads
    nodes[3].heartbeats.stop()  # node 3's launcher killed
    lost: dict[int, float] = {}
    deadline = time.monotonic() + 10
    while len(lost) < 3 and time.monotonic() < deadline:
        for number in range(3):
            if number not in lost and (why := nodes[number].silent_node()) is not None:
                assert "node 3's launcher went silent" in why, why
                lost[number] = time.monotonic()
        time.sleep(0.02)
    assert sorted(lost) == [0, 1, 2], lost
    assert max(lost.values()) - lost[0] < 1.0, lost
    for node in nodes:
        node.heartbeats.stop()
