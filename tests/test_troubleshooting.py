"""docs/troubleshooting.md quotes ddpkit's messages: each quote must still be words ddpkit prints (a
string in src/ddpkit), so that the page changes when a message does."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "troubleshooting.md"


def quoted_messages() -> list[str]:
    """The quotes in the page's entry headings (``### ... "words"``)."""
    return [quote for heading in re.findall(r"^### (.*)$", PAGE.read_text(), re.M)
            for quote in re.findall(r'"([^"]+)"', heading)]


def test_every_message_the_troubleshooting_page_quotes_is_one_ddpkit_prints() -> None:
    sources = "\n".join(path.read_text() for path in (ROOT / "src" / "ddpkit").rglob("*.py"))
    quotes = quoted_messages()
    assert len(quotes) >= 14, quotes
    assert [quote for quote in quotes if quote not in sources] == []


def test_every_error_class_a_user_meets_has_an_entry() -> None:
    headings = "\n".join(re.findall(r"^### (.*)$", PAGE.read_text(), re.M))
    for name in ("UntrackedStateError", "ReplicaMismatchError", "GradientsNotReducedError", "ParametersNotUpdatedError",
                 "PeerFailedError"):
        assert f"`{name}`" in headings, name
