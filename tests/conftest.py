"""Shared multi-rank pools (spawned once per test session, respawned after a failing test), and two
network namespaces for tests of several nodes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from ddpkit.testing import WorkerPool


@pytest.fixture(autouse=True)
def environment_kept() -> Iterator[None]:
    """Every test leaves ``os.environ`` as it found it. A test that connects in this process
    (``init_dist_connection`` sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as Lightning's
    does) would otherwise hand its variables to every launcher a later test starts."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def pool2() -> Iterator[WorkerPool]:
    with WorkerPool(2, timeout=60, pg_timeout=20) as pool:
        yield pool


@pytest.fixture(scope="session")
def pool3() -> Iterator[WorkerPool]:
    with WorkerPool(3, timeout=60, pg_timeout=20) as pool:
        yield pool


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def pool(request: pytest.FixtureRequest) -> WorkerPool:
    """Runs the test on 2 and on 3 ranks."""
    return request.getfixturevalue(f"pool{request.param}")


@pytest.fixture()
def two_namespaces() -> Iterator[list[tuple[str, str]]]:
    """Two network namespaces joined by a veth pair: [(namespace, its address)] for nodes 0 and 1."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs Linux, root and iproute2's `ip` to make network namespaces")
    tag = f"ddpk{os.getpid() % 100000}"
    nodes = [(f"{tag}n0", "10.231.7.1"), (f"{tag}n1", "10.231.7.2")]
    links = [f"{tag}a", f"{tag}b"]
    commands = [["ip", "netns", "add", nodes[0][0]], ["ip", "netns", "add", nodes[1][0]],
                ["ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1]]]
    for (namespace, address), link in zip(nodes, links):
        commands += [["ip", "link", "set", link, "netns", namespace],
                     ["ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", link],
                     ["ip", "-n", namespace, "link", "set", link, "up"],
                     ["ip", "-n", namespace, "link", "set", "lo", "up"]]
    try:
        for command in commands:
            made = subprocess.run(command, capture_output=True, text=True, timeout=30)
            if made.returncode != 0:
                pytest.skip(f"cannot make network namespaces here: {' '.join(command)}: {made.stderr.strip()}")
        yield nodes
    finally:
        for namespace, _ in nodes:  # deleting a namespace also deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
