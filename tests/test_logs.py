"""ddpkit.logs: ddpkit's messages go through logging, with the rank in front, a level from
DDPKIT_LOG_LEVEL, and can be routed by the user."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

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


def _on_a_terminal(text: str) -> list[str]:
    """The lines a terminal shows for ``text``: a carriage return goes back to the line's start,
    ESC[K clears the rest of the line, other characters overwrite."""
    shown = []
    for physical in text.replace("\r\n", "\n").split("\n"):
        line: list[str] = []
        cursor = 0
        index = 0
        while index < len(physical):
            if physical.startswith("\x1b[K", index):
                del line[cursor:]
                index += 3
                continue
            character = physical[index]
            if character == "\r":
                cursor = 0
            else:
                line[cursor:cursor + 1] = [character]
                cursor += 1
            index += 1
        shown.append("".join(line))
    return shown


def test_on_a_terminal_the_launchers_lines_start_on_a_line_of_their_own_under_a_progress_bar(tmp_path: Path) -> None:
    """Issue 64, item 4: a worker's progress bar ends its line with a carriage return; the
    launcher's restart notice and its failure summary must not continue that line."""
    import pty

    (tmp_path / "bar.py").write_text(
        "import sys\n"
        "sys.stderr.write('epoch 1:  12%|#2        | 16/128 [00:01<00:07]\\r')\n"
        "sys.stderr.write('epoch 1:  13%|#3        | 17/128 [00:01<00:07]')\n"
        "sys.stderr.flush()\n"
        "sys.exit(1)\n")
    controller, terminal = pty.openpty()
    environment = {key: value for key, value in os.environ.items() if key not in ("RANK", "DDPKIT_LOG_LEVEL")}
    launcher = subprocess.Popen([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "1", "--max-restarts", "1",
                                 "bar.py"], cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal,
                                env={**environment, "TERM": "xterm"})
    os.close(terminal)
    written = b""
    while True:
        try:
            chunk = os.read(controller, 1 << 16)
        except OSError:  # the terminal's other side is closed: every process has ended
            break
        if not chunk:
            break
        written += chunk
    os.close(controller)
    assert launcher.wait(timeout=60) == 1
    shown = _on_a_terminal(written.decode(errors="replace"))
    ours = [line for line in shown if "ddpkit run:" in line]
    assert any("exited with code 1" in line for line in ours), shown
    assert any("restart" in line for line in ours), shown
    assert all(line.startswith("ddpkit run:") for line in ours), shown
