"""A node's link timed by its launcher (``health.link_probe``, issue 49): two probes on loopback
aimed at each other each take a link time in their window's turn, and a stranger that reaches a
listener without the node's token gets no answer and holds it up for no longer than the token's
wait. tests/test_stragglers.py names a node whose link is shaped slower, end to end."""

from __future__ import annotations

import json
import socket
import time

import pytest

from ddpkit.health import link_probe
from ddpkit.health.link_probe import PROBE_BYTES, TOKEN_SECONDS, LinkProbe

# Alone: the probes' round trips are bounded under a second.
pytestmark = pytest.mark.alone


@pytest.mark.timeout(60)
def test_two_probes_time_their_sends_to_each_other_in_turns_and_a_stranger_gets_no_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link_probe, "PROBE_AT", 0.1)
    monkeypatch.setattr(link_probe, "PROBE_SPAN", 0.4)
    probes = [LinkProbe("127.0.0.1", 1.0, lambda node=node: node) for node in (0, 1)]
    try:
        records = [json.loads(probe.record()) for probe in probes]
        for node, probe in enumerate(probes):
            other = records[1 - node]
            probe.aim([(1 - node, other["address"], other["port"], bytes.fromhex(other["token"]))], node, 2)
        with socket.create_connection(probes[0].address, timeout=5) as stranger:  # holds the listener, says nothing
            began = time.monotonic()
            assert stranger.recv(1) == b""  # closed once the token's wait is over, unanswered
            assert time.monotonic() - began < TOKEN_SECONDS + 1.0
        with socket.create_connection(probes[0].address, timeout=5) as stranger:  # the wrong token, then bytes
            try:
                stranger.sendall(b"x" * 16 + bytes(PROBE_BYTES))
                answer = stranger.recv(1)
            except (ConnectionResetError, BrokenPipeError):  # closed with its bytes unread
                answer = b""
            assert answer == b""
        now = time.time()
        start = now - now % 1.0 + 1.0  # the next window: both turns (at 0.1 and 0.3 s into it) taken by 0.8 s
        time.sleep(start + 0.8 - now)
        times = [probe.taken_in(start) for probe in probes]
        assert all(seconds is not None and 0 < seconds < 1.0 for seconds in times), times
        assert probes[0].taken_in(start) is None  # read once
    finally:
        for probe in probes:
            probe.stop()
