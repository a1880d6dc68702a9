"""The probe that tells a survivor whether the store's host is gone (``ddpkit.diagnostics.store_probe``).

A store's host killed with SIGKILL closes its sockets one after another: a peer's collective can fail
on one while the store's listening socket still completes connections. The CI caught a survivor that
probed in that moment, was told the host was alive, and raised Gloo's "Connection closed by peer"
instead of ``StoreHostGoneError``. Here a plain listening socket plays the store: open (a live host),
closed (a dead one), or closed a moment after the probe connected (a dying one).
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from ddpkit.diagnostics.store_probe import HOLD_SECONDS, why_store_host_is_gone


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A listening socket that never accepts, as a store server frozen or dying (the kernel completes
    connections to it all the same)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield server


def test_a_listening_store_is_alive(listener: socket.socket) -> None:
    started = time.monotonic()
    assert why_store_host_is_gone(listener.getsockname()) is None
    assert time.monotonic() - started < HOLD_SECONDS + 0.5


def test_a_store_whose_port_refuses_is_gone(listener: socket.socket) -> None:
    address = listener.getsockname()
    listener.close()
    assert why_store_host_is_gone(address) == "Connection refused"


def test_a_store_whose_listening_socket_closes_just_after_the_probe_connected_is_gone(listener: socket.socket) -> None:
    """The dying host: the probe's connection is completed by the kernel, then the listening socket
    is closed (the process's sockets closing one by one) and the waiting connection is reset. (The
    close follows the connection, and the hold is long, so that a loaded machine cannot reorder them.)"""
    def close_once_connected() -> None:
        select.select([listener], [], [], 10)  # readable: a connection waits in its queue
        listener.close()

    closing = threading.Thread(target=close_once_connected)
    closing.start()
    try:
        assert why_store_host_is_gone(listener.getsockname(), hold_seconds=10) == "Connection reset by peer"
    finally:
        closing.join()


def test_a_store_that_closes_the_probes_connection_is_gone() -> None:
    """A server that accepts and closes at once (the process exiting as the probe arrived)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        closing = threading.Thread(target=lambda: server.accept()[0].close())
        closing.start()
        assert why_store_host_is_gone(server.getsockname(), hold_seconds=10) == "closed the connection"
        closing.join(timeout=5)
