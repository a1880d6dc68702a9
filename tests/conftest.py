"""Shared multi-rank pools: spawned once per test session, respawned after a failing test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ddpkit.testing import WorkerPool


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
