"""ddpkit.logs: ddpkit's messages go through logging, with the rank in front, a level from
DDPKIT_LOG_LEVEL, and can be routed by the user."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

from ddpkit.logs import get_logger

SCRIPT = textwrap.dedent("""
    from ddpkit.logs import get_logger
    log = get_logger("example")
    log.info("an info line")
    log.warning("a warning\\nover two lines")
""")


def run(**env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "DDPKIT_LOG_LEVEL")} | env
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=environment, timeout=60)


def test_messages_go_to_stderr_with_the_rank_in_front_of_every_line() -> None:
    result = run(RANK="3")
    assert result.stdout == ""
    assert result.stderr.splitlines() == ["[rank 3] an info line", "[rank 3] a warning", "[rank 3] over two lines"]


def test_without_a_rank_there_is_no_prefix() -> None:
    assert run().stderr.splitlines() == ["an info line", "a warning", "over two lines"]


def test_the_level_comes_from_the_environment() -> None:
    assert run(DDPKIT_LOG_LEVEL="warning").stderr.splitlines() == ["a warning", "over two lines"]
    assert run(DDPKIT_LOG_LEVEL="ERROR").stderr == ""


def test_an_unknown_level_is_refused_naming_it_and_the_choices() -> None:
    result = run(DDPKIT_LOG_LEVEL="LOUD")
    assert result.returncode != 0
    assert "DDPKIT_LOG_LEVEL='LOUD' is not a logging level" in result.stderr
    assert "DEBUG, INFO, WARNING, ERROR, CRITICAL" in result.stderr


def test_a_user_can_route_the_messages_through_their_own_logging(caplog: pytest.LogCaptureFixture) -> None:
    log = get_logger("routing")
    root = logging.getLogger("ddpkit")
    saved = (list(root.handlers), root.propagate)
    root.handlers.clear()
    root.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="ddpkit"):
            log.info("routed")
        assert [(record.name, record.getMessage()) for record in caplog.records] == [("ddpkit.routing", "routed")]
    finally:
        root.handlers[:], root.propagate = saved
