"""Shared multi-rank pools (spawned once per test session, respawned after a failing test), two
network namespaces for tests of several nodes, and the lock that runs a test marked ``alone`` with
nothing beside it when pytest-xdist runs two tests at once (pyproject.toml's ``-n 2``)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import IO

import pytest

from ddpkit.testing import WorkerPool


class _AloneLock:
    """A readers-writer lock shared by the test run's xdist workers, made of two files locked with
    ``flock``: every test holds the run's lock shared, a test marked ``alone`` holds it exclusively,
    so it starts once the other worker's test has ended and the other worker waits for it. Whoever
    waits first goes first (the turnstile), so a worker with many short tests cannot keep an
    ``alone`` test waiting. Timing tests are marked: a second job on two cores would measure it."""

    def __init__(self, run: str) -> None:
        self.folder = Path(tempfile.gettempdir()) / f"ddpkit-test-run-{run}"
        self.folder.mkdir(exist_ok=True)
        self._turnstile: IO[bytes] = open(self.folder / "turnstile", "ab")  # held for the worker's life
        self._tests: IO[bytes] = open(self.folder / "tests", "ab")

    @contextlib.contextmanager
    def held(self, alone: bool) -> Iterator[None]:
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._tests, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._tests, fcntl.LOCK_UN)


_alone_lock: _AloneLock | None = None

# The modules that take longest, longest first. Under xdist's ``--dist loadscope`` each module runs
# on one worker, in the order collected (pyproject.toml turns off its reordering by test count):
# a long module collected last would run alone at the end while the other worker idles. Measured
# with ``--durations=0``; a module missing here only runs in its path's order.
LONGEST_MODULES_FIRST = (
    "test_chaos.py", "test_real_loops.py", "launch_modes/test_matrix.py", "test_lightning.py", "test_node_restarts.py",
    "test_example.py", "test_shrinking.py", "test_spare_node.py", "test_stranger.py", "test_launcher.py",
    "test_kill_and_recover.py", "schedulers/test_slurm.py", "test_failed_rank_lives_on.py",
    "test_gpu_check.py", "schedulers/test_mpi.py", "test_launcher_never_stuck.py", "test_preemption.py",
)


# Besides those, the modules whose tests each start jobs of several nodes or soak: with the longest
# ones and every ``alone`` test they are ``slow``, left out of the edit-test loop (``-m "not slow"``).
SLOW_MODULES = LONGEST_MODULES_FIRST + ("test_straggler_replacement.py", "test_stragglers.py",
                                        "test_restarts.py", "test_torchrun_restarts.py", "test_store_host_gone.py",
                                        "test_hangs.py")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alone: runs with no other test beside it (it measures time or load)")
    config.addinivalue_line("markers", "slow: a long test (SLOW_MODULES, alone); -m \"not slow\" leaves them out")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules with an ``alone`` test first, then the longest modules (LONGEST_MODULES_FIRST);
    the sort is stable, so each module's tests, and the modules not named, keep their order.

    An ``alone`` test waits for the test in hand on the other worker to end, and that worker waits
    for it: among the other modules' tests, each ``alone`` test also cost the suite the rest of a
    test beside it. First, the two workers take those modules together, and mostly wait for each
    other's ``alone`` tests, which run one at a time anyway."""
    tests = Path(__file__).parent

    def module_of(item: pytest.Item) -> str:
        return item.path.relative_to(tests).as_posix() if item.path.is_relative_to(tests) else ""

    with_alone_tests = {module_of(item) for item in items if item.get_closest_marker("alone") is not None}

    def place(item: pytest.Item) -> int:
        module = module_of(item)
        if module in with_alone_tests:
            return -1
        return LONGEST_MODULES_FIRST.index(module) if module in LONGEST_MODULES_FIRST else len(LONGEST_MODULES_FIRST)

    items.sort(key=place)
    for item in items:
        if module_of(item) in SLOW_MODULES or item.get_closest_marker("alone") is not None:
            item.add_marker(pytest.mark.slow)


def pytest_unconfigure() -> None:
    """The lock's files go with the first worker to end: the other holds its own open files."""
    if _alone_lock is not None:
        shutil.rmtree(_alone_lock.folder, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    """Every test, its fixtures' set-up and tear-down included, under the run's lock (xdist only)."""
    global _alone_lock
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    if _alone_lock is None:
        _alone_lock = _AloneLock(run)
    with _alone_lock.held(item.get_closest_marker("alone") is not None):
        yield


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
