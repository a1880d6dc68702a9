"""torchrun's c10d rendezvous for ``ddpkit run``: nodes receive their node rank as they arrive.

    ddpkit run --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
               --rdzv-id job7 train.py          # the same command on every node, no --node-rank

The launcher on HOST (the one whose bind of the endpoint succeeds: ``claim_endpoint``) hosts the
job's store there (``launching.store_host``, handed the listening socket, so two launchers on
one host cannot both host it), unless ``ddpkit store`` holds the endpoint already (a store outside
the training nodes; then every launcher is a client); every launcher, that one included, joins
through the store (``join``): the n-th to arrive is node n - 1, one endpoint serves one rendezvous
id, and nobody starts a worker before all ``--nnodes`` launchers arrived (within ``join_timeout``,
torchrun's ``--rdzv-conf`` key, 600 s by default). From then on the job is a static one whose
master address and port are the endpoint's, and whose store is the launchers' (the workers meet
there, one key prefix per attempt, as under restarts across nodes: ``control_plane.nodes``); node
ranks stay the same across restarts.

With ``--nnodes MIN:MAX`` (under in-place recovery) the rendezvous closes with MAX nodes, or with
at least MIN once ``last_call_timeout`` (torchrun's key, 30 s) passed since MIN arrived; the first
launcher to see it close writes the world's size, and everyone reads that one. Launchers that
arrive after it closed, up to MAX in all, wait as spare nodes (``launching.spare_node``).

Arrivals are tickets: a launcher draws the next number from a count and writes its ticket under
it, signed with the job secret when there is one (``ddpkit.store.job_secret``); node ranks are the
order of the signed tickets, so a stranger who adds to the count or writes tickets of its own
takes no node's place. The rendezvous id stays outside the job's prefix and unsigned: it is what
tells a launcher of another job (with another secret) that the endpoint is taken.

``torch.distributed`` (the store's client, ``launching.store_client``) is imported only here, and
only with ``c10d``. A stop signal or the store host's end ends the waits within seconds (``give_up``),
and a store that stops answering ends them after ``read_timeout`` (``store_client.BoundedStore``).
"""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from ddpkit.logs import get_logger
from ddpkit.store import keys as store_keys
from ddpkit.store.client import (
    BoundedStore,
    GaveUpWaiting,
    GiveUp,
    StoreRequestTimeout,
    StoreUnreachableError,
    connect,
    never_give_up,
)
from ddpkit.store.job_secret import RecordSigner, job_secret

__all__ = ["DEFAULT_PORT", "Endpoint", "Place", "RendezvousError", "RendezvousSettings", "StoreWaits", "claim_endpoint",
           "join", "parse_endpoint", "parse_rdzv_conf"]

_log = get_logger("launching")

#: torchrun's port for a c10d endpoint given without one.
DEFAULT_PORT = 29400
_POLL_SECONDS = 0.05
# Tickets read at most, beyond --nnodes: a count raised by a stranger is not read to its end.
_EXTRA_TICKETS = 64


class RendezvousError(RuntimeError):
    """The launchers did not form the job: too many, a different job on the endpoint, or too few in time."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class RendezvousSettings:
    """``--rdzv-endpoint`` and ``--rdzv-id`` of a c10d rendezvous."""

    endpoint: Endpoint
    run_id: str


@dataclass(frozen=True)
class StoreWaits:
    """torchrun's ``--rdzv-conf`` settings ddpkit reads, for a c10d rendezvous and for static
    nodes whose launchers coordinate (``control_plane.nodes``)."""

    # How long the launchers wait for one another to reach the job's store (600 s, torchrun's
    # default: the nodes of a job are rarely started at the same second).
    join_timeout: float = 600.0
    # How long one request to the store may go unanswered once connected (torchrun's is 60 s):
    # a store whose host froze must not hold the other nodes longer.
    read_timeout: float = 30.0
    # With ``--nnodes MIN:MAX``: how long the rendezvous stays open for more nodes once MIN arrived
    # (torchrun's default); launchers that come later wait as spare nodes.
    last_call_timeout: float = 30.0


def parse_endpoint(value: str) -> Endpoint:
    """``HOST``, ``HOST:PORT`` or ``[IPv6]:PORT`` (``ValueError`` saying what is wrong)."""
    text = value.strip()
    host, port_text = text, ""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    if not host:
        raise ValueError(f"--rdzv-endpoint={value!r} names no host: give HOST or HOST:PORT, e.g. node0:{DEFAULT_PORT}.")
    if not port_text:
        return Endpoint(host, DEFAULT_PORT)
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"--rdzv-endpoint={value!r}: {port_text!r} is not a TCP port (1..65535).")
    return Endpoint(host, int(port_text))


def parse_rdzv_conf(conf: str) -> StoreWaits:
    """``join_timeout`` and ``read_timeout`` from torchrun's ``--rdzv-conf key=value,...`` (the
    defaults of ``StoreWaits`` when absent); other keys are torchrun's tuning of its own rendezvous
    and are ignored with a notice."""
    read: dict[str, float] = {}
    for pair in filter(None, (part.strip() for part in conf.split(","))):
        key, sep, value = (part.strip() for part in pair.partition("="))
        if not sep:
            raise ValueError(f"--rdzv-conf={conf!r}: {pair!r} is not key=value (e.g. join_timeout=120).")
        if key not in ("join_timeout", "read_timeout", "last_call_timeout"):
            _log.info(f"ddpkit run: --rdzv-conf {key} is not used by ddpkit's rendezvous (only join_timeout, "
                      "read_timeout and last_call_timeout).")
            continue
        try:
            read[key] = float(value)
        except ValueError:
            raise ValueError(f"--rdzv-conf={conf!r}: {key}={value!r} is not a number of seconds.") from None
        if not 0 < read[key] < float("inf"):
            raise ValueError(f"--rdzv-conf={conf!r}: {key} must be a number of seconds more than 0 (e.g. {key}=60).")
    return StoreWaits(**read)


def claim_endpoint(endpoint: Endpoint) -> socket.socket | None:
    """A socket listening on the endpoint when it is an address of this machine and free: then this
    launcher hosts the store. None when another process holds it (another launcher on this host,
    say) or the address is another machine's."""
    try:
        listener = _bound(endpoint)
    except (OSError, UnicodeError):  # EADDRINUSE: held already; EADDRNOTAVAIL: not this machine's address
        return None
    try:
        listener.listen(512)
    except OSError:
        listener.close()
        return None
    listener.set_inheritable(True)
    return listener


def _bound(endpoint: Endpoint) -> socket.socket:
    """A socket bound to the endpoint (with SO_REUSEADDR, as the store's listener is); ``OSError``
    (``socket.gaierror`` for a name that does not resolve) or ``UnicodeError`` when it cannot be."""
    family = socket.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)[0][0]
    bound = socket.socket(family, socket.SOCK_STREAM)
    try:
        bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        bound.bind((endpoint.host, endpoint.port))
    except OSError:
        bound.close()
        raise
    return bound


def held_without_a_listener(endpoint: Endpoint, looks: int = 3) -> bool:
    """Whether the endpoint is an address of this host whose port another process holds (this
    launcher could not claim it) while nothing listens there, at each of ``looks`` looks a quarter
    second apart: then nothing will serve it, and waiting the join timeout would wait for nothing.
    A launcher claiming the port binds and listens at once, so a look between the two is not repeated."""
    for look in range(looks):
        if look:
            time.sleep(0.25)
        try:
            socket.create_connection((endpoint.host, endpoint.port), timeout=1.0).close()
            return False  # something listens: a launcher's store, or ``ddpkit store``
        except ConnectionRefusedError:
            pass
        except OSError:
            return False  # unreachable or slow: not known to be held here
        if not _port_in_use_here(endpoint):
            return False  # free, or another host's: a launcher may yet come and host it
    return True


def _port_in_use_here(endpoint: Endpoint) -> bool:
    """Whether binding the endpoint here fails because its port is in use (EADDRINUSE, which only
    an address of this host can give); the probe is bound for a moment only, and never listens."""
    try:
        _bound(endpoint).close()
        return False
    except OSError as error:  # a name that does not resolve (gaierror) is not in use here either
        return error.errno == errno.EADDRINUSE
    except UnicodeError:
        return False


@dataclass(frozen=True)
class Place:
    """Where a launcher stands once the rendezvous closed: its node rank in a world of ``nnodes``
    nodes, or None for a spare node (``--nnodes MIN:MAX``: a launcher beyond the world, waiting to
    take a lost node's place)."""

    node_rank: int | None
    nnodes: int


def join(endpoint: Endpoint, run_id: str, nnodes: int, waits: StoreWaits,
         give_up: GiveUp = never_give_up, max_nodes: int | None = None,
         beyond_max: Callable[[BoundedStore, int], bool] | None = None) -> tuple[Place, BoundedStore]:
    """Join the rendezvous ``run_id`` at ``endpoint`` and wait until it closes: with ``nnodes`` launchers,
    or with ``max_nodes`` given (``--nnodes MIN:MAX``, MIN being ``nnodes``), with MAX, or with at least
    MIN once ``waits.last_call_timeout`` passed since MIN arrived. This launcher's place (its node rank
    is its order of arrival) and the store's client (kept for ``control_plane.nodes``). ``give_up`` ends
    the wait with ``GaveUpWaiting`` (a stop signal, the store host gone). A launcher that arrives
    beyond MAX is refused, unless the rendezvous closed and ``beyond_max(store, places past MAX)``
    says it may wait as a spare node (the world shrank, or nodes were lost: ``control_plane.nodes.may_wait_beyond_max``)."""
    join_timeout = waits.join_timeout
    if held_without_a_listener(endpoint):
        raise RendezvousError(
            f"the endpoint {endpoint} is this host's, and another process holds its port without listening on it "
            "(a connection's own port, say): no launcher can host the rendezvous store there, and no `ddpkit store` "
            f"serves it. Give every node another --rdzv-endpoint port, or end what holds it (`ss -tanp | grep "
            f":{endpoint.port}` shows it).")
    try:
        store = BoundedStore(connect(endpoint.host, endpoint.port, join_timeout, give_up), waits.read_timeout)
    except StoreUnreachableError as error:
        raise RendezvousError(
            f"could not reach the rendezvous store at {endpoint} within {join_timeout:g} s ({error}). The launcher "
            f"on the endpoint's host hosts it, or `ddpkit store --port {endpoint.port}` there: start one of them on "
            "that host, and check that this host can reach it.") from None
    bounds = _Bounds(nnodes, nnodes if max_nodes is None else max_nodes, waits.last_call_timeout)
    try:
        return _arrive(store, endpoint, run_id, bounds, join_timeout, give_up, beyond_max), store
    except StoreRequestTimeout as unanswered:
        raise RendezvousError(
            f"the rendezvous store at {endpoint} stopped answering ({unanswered}; --rdzv-conf read_timeout): the "
            "launcher on the endpoint's host is frozen, or its host unreachable.") from None


@dataclass(frozen=True)
class _Bounds:
    least: int
    most: int
    last_call: float

    def __str__(self) -> str:
        return f"--nnodes={self.least}" if self.least == self.most else f"--nnodes={self.least}:{self.most}"


def _arrive(store: BoundedStore, endpoint: Endpoint, run_id: str, bounds: _Bounds, join_timeout: float,
            give_up: GiveUp, beyond_max: Callable[[BoundedStore, int], bool] | None = None) -> Place:
    """This launcher's place once the rendezvous closed (see ``join``)."""
    # One endpoint, one job: the first launcher names the rendezvous id; any other id is refused.
    served = store.compare_set(store_keys.RENDEZVOUS_ID, "", run_id).decode()
    if served != run_id:
        raise RendezvousError(
            f"the rendezvous at {endpoint} serves --rdzv-id={served!r}, not {run_id!r}: another job uses this endpoint. "
            "Give each job its own --rdzv-endpoint port, or the same --rdzv-id to join that job.")
    signer = RecordSigner(job_secret(), f"rendezvous {run_id}")
    tickets = _Tickets(store, signer, bounds.most)
    closing = _Closing(store, signer)
    mine = tickets.draw()
    deadline = time.monotonic() + join_timeout
    enough_since: float | None = None  # when this launcher first saw the least number of nodes arrived
    told = False
    while True:
        arrived = tickets.signed()
        closed = closing.world()
        if (mine in arrived and arrived.index(mine) >= bounds.most
                and not (closed is not None and beyond_max is not None
                         and beyond_max(store, arrived.index(mine) - bounds.most + 1))):
            raise RendezvousError(
                f"rendezvous {run_id!r} at {endpoint} already has its {bounds} nodes; this launcher arrived "
                f"as number {mine}. Start exactly --nnodes launchers (a node that is started again joins a new job: give it "
                "a new --rdzv-id or endpoint).")
        if closed is None and len(arrived) >= bounds.least:
            enough_since = time.monotonic() if enough_since is None else enough_since
            if len(arrived) >= bounds.most or time.monotonic() - enough_since >= bounds.last_call:
                closed = closing.close(min(len(arrived), bounds.most))
        if closed is not None and mine in arrived:
            break
        if (reason := give_up()) is not None:
            raise GaveUpWaiting(reason)
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"rendezvous {run_id!r} at {endpoint}: {len(arrived)} of {bounds} launchers arrived within "
                f"{join_timeout:g} s (--rdzv-conf join_timeout). Start `ddpkit run` with the same --rdzv-endpoint, "
                "--rdzv-id, --nnodes and job secret on every node.")
        if not told:
            _log.info(f"ddpkit run: arrived at rendezvous {run_id!r} at {endpoint}; waiting for "
                      f"{max(1, bounds.least - len(arrived))} more node(s)")
            told = True
        time.sleep(_POLL_SECONDS)
    position = arrived.index(mine)
    if position >= closed:
        _log.info(f"ddpkit run: rendezvous {run_id!r} at {endpoint} closed with {closed} nodes; this launcher waits "
                  "as a spare node, to take the place of a node that is lost")
        return Place(None, closed)
    _log.info(f"ddpkit run: rendezvous {run_id!r} at {endpoint} complete: this is node {position} of {closed}")
    return Place(position, closed)


class _Closing:
    """How many nodes the world has, decided once by the first launcher that sees the rendezvous
    close (``compare_set``: the first value written is everyone's), signed like the tickets."""

    def __init__(self, store: BoundedStore, signer: RecordSigner) -> None:
        self._store, self._signer = store, signer
        self._key = signer.key(store_keys.RENDEZVOUS_CLOSED)

    def world(self) -> int | None:
        if not self._store.check([self._key]):
            return None
        return self._read(self._store.get(self._key))

    def close(self, nodes: int) -> int | None:
        return self._read(self._store.compare_set(self._key, "", self._signer.sign(self._key, str(nodes))))

    def _read(self, value: bytes) -> int | None:
        text = self._signer.verify(self._key, value)
        return None if text is None or not text.isdigit() else int(text)


class _Tickets:
    """The launchers' arrivals at one rendezvous: numbers drawn from a count, each one's ticket
    written under its number and signed (see the module docstring)."""

    def __init__(self, store: BoundedStore, signer: RecordSigner, nnodes: int) -> None:
        self._store, self._signer, self._nnodes = store, signer, nnodes
        self._signed: set[int] = set()

    def draw(self) -> int:
        number = self._store.add(self._signer.key(store_keys.RENDEZVOUS_TICKETS), 1)
        key = self._ticket_key(number)
        self._signer.write(self._store, key, "arrived")
        return number

    def signed(self) -> list[int]:
        """The numbers of the signed tickets so far, in order (a signed one stays signed)."""
        drawn = min(self._store.add(self._signer.key(store_keys.RENDEZVOUS_TICKETS), 0), self._nnodes + _EXTRA_TICKETS)
        for number in range(1, drawn + 1):
            key = self._ticket_key(number)
            if number not in self._signed and self._signer.read(self._store, key) is not None:
                self._signed.add(number)
        return sorted(self._signed)

    def _ticket_key(self, number: int) -> str:
        return self._signer.key(store_keys.rendezvous_ticket(number))
