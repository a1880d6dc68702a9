"""A node's network link, timed (issue 49): the one phase a rank's own step times cannot show. In a
synchronised step every rank waits alike in the gradients' all-reduce, so a node whose link is
slow makes every rank's communication long, its own no longer than the others'.

So each node's launcher, across nodes and while the job's health is watched, times its own
sending: once per window it sends ``PROBE_BYTES`` to the launcher of each of its neighbours in the
world (the next and the previous node, in node order), ``TRIES`` times each, and the fastest try to
the fastest neighbour is its link time for the window. The nodes take turns, from ``PROBE_AT``
into the window on, each in its own slot: two probes at once would time each other (a shaped
link's queue holds back even the answers and acknowledgements it sends). A
neighbour's probe listener reads the bytes and answers once it has them all. The fastest, as a
busy host delays single tries; and the fastest neighbour, as a neighbour slow only to *receive*
slows this node's try to it alone (with two nodes there is one neighbour: a link slow one way is
then named by its sender). The link time goes into the node's health record
(``health.job_health.SharedWindows``) and node 0's launcher compares the nodes'
(``health.compare_links``): a node above the others' median by the straggler factor, and by at
least ``LINK_FLOOR_SECONDS``, is slow in its link.

A window's probe is one message of 4 MiB to each of two neighbours, twice: at the default 60-s
windows, 16 MiB a minute a node, while the job's gradients stream. The listener answers only a
sender that gives the token in the node's record (signed in the job's store, as every launcher
record is) within ``TOKEN_SECONDS`` of connecting, so that a stranger's connection holds it up no
longer; it reads at most ``PROBE_BYTES``, and gives each sender ``TIMEOUT_SECONDS``.

torch-free, as the launcher is.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import socket
import threading
import time
from collections.abc import Callable

from ddpkit.control_plane.launcher_records import LauncherRecords
from ddpkit.logs import get_logger
from ddpkit.store import keys

__all__ = ["LINK_FLOOR_SECONDS", "PROBE_BYTES", "LinkProbe", "Neighbour", "neighbours_of", "say_where"]

_log = get_logger("launching")

#: What a probe sends: over the burst a shaped link lets through at once, and a few milliseconds
#: on a healthy 10 Gbit/s link.
PROBE_BYTES = 4 * 1024 * 1024
TRIES = 2
#: The least a node's link time must exceed the other nodes' median by to name it: a busy host
#: delays a 4-MiB send by milliseconds; a link at 1 Gbit/s among faster ones adds over 25 ms.
LINK_FLOOR_SECONDS = 0.020
#: Where in each window the probes begin (a share of it), and the share the nodes' turns take:
#: done well before the window's record is published.
PROBE_AT = 0.2
PROBE_SPAN = 0.5
TIMEOUT_SECONDS = 5.0
TOKEN_SECONDS = 0.5
_TOKEN_BYTES = 16
_ANSWER = b"k"

Neighbour = tuple[int, str, int, bytes]  # (node, address, port, token)


class LinkProbe:
    """This launcher's probe listener and its once-a-window probes of its neighbours (``aim``), on
    two daemon threads; the link time of each window is ``taken_in``."""

    def __init__(self, address: str, window_seconds: float, node: Callable[[], int]) -> None:
        self.window_seconds = window_seconds
        self._node = node  # this launcher's node now (a spare node takes a place's)
        self._token = os.urandom(_TOKEN_BYTES)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((address, 0))
        self._listener.listen(8)
        self.address = (address, int(self._listener.getsockname()[1]))
        self._neighbours: list[Neighbour] = []
        self._turn = (0, 1)  # this node's place among the world's nodes, and their number
        self._times: dict[float, float] = {}  # window start -> link time
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._failed: set[int] = set()  # neighbours whose probe failed, said once each
        self._outgoing, self._incoming = bytes(PROBE_BYTES), bytearray(PROBE_BYTES)
        for target, name in ((self._serve, "listener"), (self._probe_each_window, "prober")):
            threading.Thread(target=target, name=f"ddpkit-link-probe-{name}", daemon=True).start()

    def record(self) -> str:
        """Where this launcher's listener is, for the job's store (``say_where``)."""
        return json.dumps({"address": self.address[0], "port": self.address[1], "token": self._token.hex()})

    def aim(self, neighbours: list[Neighbour], place: int, nodes: int) -> None:
        """Probe ``neighbours`` from the next window on (``neighbours_of``), in turn ``place`` of ``nodes``'."""
        with self._lock:
            self._neighbours, self._turn = neighbours, (place, max(1, nodes))

    def taken_in(self, start: float) -> float | None:
        """The link time of the window that started at ``start`` (None: none was taken), forgotten once read."""
        with self._lock:
            for older in [window for window in self._times if window < start]:
                del self._times[older]
            return self._times.pop(start, None)

    def stop(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):  # wakes the listener's accept (closing alone does not, on Linux)
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def _probe_each_window(self) -> None:
        while not self._stopped.is_set():
            with self._lock:
                place, nodes = self._turn
            now = time.time()
            start = now - now % self.window_seconds
            at = start + (PROBE_AT + PROBE_SPAN * place / nodes) * self.window_seconds
            if at <= now:
                start, at = start + self.window_seconds, at + self.window_seconds
            if self._stopped.wait(at - now):
                return
            with self._lock:
                neighbours = list(self._neighbours)
            times = [seconds for neighbour in neighbours if (seconds := self._time_to(neighbour)) is not None]
            if times:
                with self._lock:
                    self._times[start] = min(times)

    def _time_to(self, neighbour: Neighbour) -> float | None:
        """The fastest of ``TRIES`` sends of ``PROBE_BYTES`` to ``neighbour``, until its answer; None
        when it cannot be reached (said once: its node's own checks tell a lost node)."""
        node, address, port, token = neighbour
        fastest = None
        for _ in range(TRIES):
            try:
                with socket.create_connection((address, port), timeout=TIMEOUT_SECONDS) as connection:
                    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    began = time.perf_counter()
                    connection.sendall(token)
                    connection.sendall(self._outgoing)
                    if connection.recv(1) != _ANSWER:
                        raise OSError("it closed the connection without answering")
                    seconds = time.perf_counter() - began
            except OSError as error:
                if node not in self._failed:
                    self._failed.add(node)
                    _log.info(f"ddpkit run: node {self._node()}'s link probe could not reach node {node}'s launcher at "
                              f"{address}:{port} ({error}); its link time leaves that node out")
                return fastest
            fastest = seconds if fastest is None else min(fastest, seconds)
        return fastest

    def _serve(self) -> None:
        """Answer each sender that gives the token, once all its bytes are in; one at a time."""
        while not self._stopped.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed: the launcher is ending
            with connection:
                try:
                    connection.settimeout(TOKEN_SECONDS)
                    if hmac.compare_digest(_read_exactly(connection, self._incoming, _TOKEN_BYTES), self._token):
                        connection.settimeout(TIMEOUT_SECONDS)
                        _read_exactly(connection, self._incoming, PROBE_BYTES)
                        connection.sendall(_ANSWER)
                except OSError:
                    continue  # a sender that went away or stalled: the next one


def _read_exactly(connection: socket.socket, buffer: bytearray, count: int) -> bytes:
    """``count`` bytes from ``connection`` into ``buffer``; the first 16 of them (a token's length)."""
    view, received = memoryview(buffer), 0
    while received < count:
        got = connection.recv_into(view[received:count])
        if got == 0:
            raise OSError("the sender closed the connection early")
        received += got
    return bytes(buffer[:min(count, _TOKEN_BYTES)])


def say_where(records: LauncherRecords, node: int, probe: LinkProbe) -> None:
    """Write where ``node``'s probe listener is to the job's store."""
    records.put(keys.of(keys.LINK_PROBE, node), probe.record(), keys.JOB_WIDE)


def neighbours_of(records: LauncherRecords, node: int, world: list[int]) -> list[Neighbour]:
    """The next and the previous node of ``node`` in ``world`` (in order, around), where their
    launchers said their listeners are; those that did not say are left out."""
    if node not in world or len(world) < 2:
        return []
    here = world.index(node)
    found = []
    for other in dict.fromkeys([world[(here + 1) % len(world)], world[here - 1]]):
        value = records.read(keys.of(keys.LINK_PROBE, other), keys.JOB_WIDE)
        if value is None:
            continue
        try:
            where = json.loads(value)
            found.append((other, str(where["address"]), int(where["port"]), bytes.fromhex(where["token"])))
        except (ValueError, KeyError, TypeError):
            continue  # not a record of this version's launchers
    return found
