"""Whether the host of a TCP store is gone, found from outside the store's protocol.

A process that died refuses connections at once, and a machine that went down does not answer.
The probe must also see a process in the middle of dying: SIGKILL stops its threads at once, but
the kernel closes its sockets one by one afterwards. A peer's collective can fail on a socket closed
early while the store's listening socket still completes connections in the kernel; a bare connect
then calls a dying host alive. So the probe holds its connection open for a moment: when the
listening socket closes, the connection still waiting in its queue is reset. A live store server
says nothing to a client that has sent nothing, so silence means alive.
"""

from __future__ import annotations

import socket

__all__ = ["CONNECT_SECONDS", "HOLD_SECONDS", "why_store_host_is_gone"]

# A machine that went down does not answer a connection at all.
CONNECT_SECONDS = 1.0
# How long a dying process may take between its first sockets closing and its listening socket:
# the kernel closes them in a row, but a loaded machine can preempt it in between.
HOLD_SECONDS = 0.3


def why_store_host_is_gone(address: tuple[str, int], connect_seconds: float = CONNECT_SECONDS,
                           hold_seconds: float = HOLD_SECONDS) -> str | None:
    """Why the store at ``address`` (host, port) is gone with its host ("Connection refused", "timed
    out", "closed the connection", ...), or None when it accepted a connection and kept it open for
    ``hold_seconds``. Costs up to ``connect_seconds + hold_seconds``: call it after a collective
    failed, never per step."""
    try:
        connection = socket.create_connection(address, timeout=connect_seconds)
    except OSError as error:
        return error.strerror or type(error).__name__
    with connection:
        connection.settimeout(hold_seconds)
        try:
            if connection.recv(1) == b"":
                return "closed the connection"
        except TimeoutError:
            return None  # still listening, silent as a live server is
        except OSError as error:
            return error.strerror or type(error).__name__
    return None
