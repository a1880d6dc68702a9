"""The launchers' coordination at many nodes (issue 62): what one launcher asks the job's store while
nothing happens must not grow with the number of nodes, or the store saturates at a few dozen.
(``benchmarks/control_plane.py`` measures the whole control plane at hundreds of nodes.)"""

from __future__ import annotations

import time
from typing import Any

import pytest
from torch.distributed import TCPStore

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
    """Every beat read at once, and the failure, stop and left records read only when the job's count
    of records written changed: before, each look read each node's beat (two requests per node ten
    times a second) and the records every poll (about 650 requests a second at 32 nodes)."""
    few, many = requests_of_a_quiet_watch(4, 1.0), requests_of_a_quiet_watch(32, 1.0)
    assert many <= few * 1.25 + 2, (few, many)
    assert many <= 25, many  # the count read ten times a second, two requests per look at the beats (4 looks/s)
