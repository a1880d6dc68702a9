"""Failure propagation across ranks through the process group's store (no shared filesystem).

Without it, when one rank raises, the others wait in their next collective until the
process-group timeout, then report a "connection closed" or timeout that does not say why.
With it:

1. The failing rank publishes its rank and traceback under one key of the default group's
   store (the first failure wins: it is the root cause), then tears its process group down.
2. The other ranks find the record: ddpkit's collectives and the DDP module wait in slices and
   read it between them (``ddpkit.diagnostics.waits``), so they raise ``PeerFailedError``, "rank
   K failed: <its exception>" with K's traceback, within a fraction of a second, even while the
   failed process lives on and keeps its connections open. Where a collective fails outright,
   ddpkit reads the record too. A rank blocked in a call of its own is handled by the peer watch
   (``ddpkit.diagnostics.peer_watch``).

Failures are published by ``with ddpkit.guard():`` blocks, by the strategy and DDP module
(which run their work inside one), by ``DDPStrategy.reconciliate_processes``, and by the worker
bootstrap of ``ddpkit run`` for any uncaught exception, all through ``record_failure``, which also
writes the record to the file the launcher reads to name the root cause (``DDPKIT_ERROR_FILE``).
It works under any launcher or scheduler, since the store is the one the process group already
uses. The store lives in global rank 0's process: when rank 0 is the
one that fails, it keeps the store up for a moment at exit so that the others can read why.
When rank 0 dies without a word (SIGKILL, the out-of-memory killer, its machine), the store dies
with it: a collective that fails, or a read of the store that fails, then checks whether the
store still accepts connections and raises ``StoreHostGoneError`` (a ``PeerFailedError``) naming it.

With a job secret (``ddpkit.store.job_secret``), the records live under the job's key prefix and carry
the secret's HMAC, bound to their key and to the attempt and generation of the group
(``sign_records_in``): a record that a process outside the job wrote is ignored (and said once),
and cannot keep the job's own first failure from being published.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpkit.diagnostics.debug import CollectiveMismatchError
from ddpkit.diagnostics.exits import leave_on_uncaught_exception
from ddpkit.diagnostics.quiet_requests import quiet_requests
from ddpkit.diagnostics.records import exception_record, write_error_record
from ddpkit.diagnostics.relayed_news import announce, tcp_store_under
from ddpkit.diagnostics.store_probe import why_store_host_is_gone
from ddpkit.process_state import PROCESS
from ddpkit.store import keys as store_keys
from ddpkit.store.job_secret import JobSecretError, RecordSigner, job_secret
from ddpkit.variables import DDPKIT_ERROR_FILE, DDPKIT_LAUNCHED, DDPKIT_RESTART_COUNT

__all__ = ["CollectiveFailedError", "PeerFailedError", "PeerLostError", "StoreHostGoneError", "announced_loss",
           "expect_vanished_peers",
           "failure_behind", "guard", "lost_peers_expected", "note_lost_peer", "peer_failure", "peer_failure_raised",
           "raised_by_torch_distributed", "raising", "publish_first", "read_failure_record", "record_exception",
           "record_failure", "record_signer", "sign_records_in", "store_host_gone", "uncaught_failure"]

# The records' names under the job's key prefix (``RecordSigner.key``; spelled in ``ddpkit.store.keys``).
FAILURE = store_keys.FAILURE
# Under in-place recovery: a rank of this group vanished (no record: killed); the first rank whose
# collective failed says so, which frees the ranks still waiting on a live peer for the lost one.
LOST = store_keys.PEER_LOST
# A counter, which cannot be signed: a stranger who adds to it only shortens the failed rank 0's linger.
_SEEN = store_keys.FAILURE_SEEN
# How long the rank that hosts the store stays up after publishing its own failure, at most,
# waiting for every other rank to have read it.
_LINGER_SECONDS = 3.0
# Reading the record after a collective failed: the store may be gone with its host.
_READ_TIMEOUT = timedelta(seconds=2)


class CollectiveFailedError(RuntimeError):
    """A collective could not complete because another rank went away (killed, or failed outside
    any guard). A consequence, not a cause: ``guard`` does not publish it."""


class PeerFailedError(CollectiveFailedError):
    """Another rank failed; this one cannot go on. Names that rank and its exception."""

    def __init__(self, rank: int, kind: str, message: str, trace: str) -> None:
        self.rank, self.kind, self.message, self.trace = rank, kind, message, trace
        super().__init__(f"rank {rank} failed: {kind}: {message}\n--- traceback of rank {rank} ---\n{trace.rstrip()}")

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> PeerFailedError:
        """The error that names the failure of a published record (``ddpkit.diagnostics.records`` format)."""
        return cls(int(record["rank"]), str(record["type"]), str(record["message"]), str(record["traceback"]))


class PeerLostError(CollectiveFailedError):
    """Under in-place recovery (``ddpkit run --recovery in-place``): a rank of the group vanished
    without recording a failure (killed), so the group cannot go on; the launcher is starting its
    replacement. ``DDPStrategy.step()`` catches it and re-forms the group with the replacement."""


class StoreHostGoneError(PeerFailedError):
    """The process that hosts the process group's store (global rank 0, or the launcher's when it
    keeps the store: torchrun's agent, ``ddpkit run``'s store host) is gone without a word: killed,
    or its machine went down. ``rank`` is 0, or -1 for a launcher's (``host`` names it)."""

    def __init__(self, address: tuple[str, int], reason: str, host: str = "rank 0") -> None:
        self.rank, self.kind, self.trace, self.address = (0 if host == "rank 0" else -1), "StoreHostGone", "", address
        self.message = (f"{host}, the host of the process group's store at {address[0]}:{address[1]}, is gone: the "
                        f"store does not accept connections any more ({reason}). It ended without a chance to say why "
                        f"(killed, e.g. by SIGKILL or the out-of-memory killer, or its machine went down): its own "
                        f"log, the launcher or the scheduler says more. This rank cannot go on without it.")
        CollectiveFailedError.__init__(self, self.message)


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """Publish an exception raised inside the block to every rank, then re-raise it (one that a
    ``torch.distributed`` call failed with because a peer failed or was lost: that failure instead).

    The other ranks then fail at once with ``PeerFailedError`` naming this rank and its
    exception, instead of waiting for the process-group timeout. This rank's process group is
    torn down (the job cannot go on). Without a process group, the block is a plain block.
    """
    try:
        yield
    except (CollectiveFailedError, CollectiveMismatchError):
        raise  # a consequence of another rank's failure (published there), or raised on every rank alike
    except BaseException as error:
        # A torch.distributed call of the script's own (a collective in the model's forward, which
        # Lightning's training_step is) that failed because a peer failed or was lost: not this
        # rank's failure, and under in-place recovery one the step recovers from.
        behind = failure_behind(error) if isinstance(error, RuntimeError) and raised_by_torch_distributed(error) else None
        if behind is not None:
            raise raising(behind) from error
        record_exception(error)
        raise


def record_exception(error: BaseException, publish: bool = True) -> None:
    """``record_failure`` of ``error``, this process's exception (``publish``: to the other ranks too)."""
    record_failure(exception_record(_this_rank(), error), publish)


def record_failure(record: dict[str, object], publish: bool = True, tear_down: bool = True) -> None:
    """The one writer of failure records (``ddpkit.diagnostics.records`` format).

    Writes ``record`` to the file the launcher reads (``DDPKIT_ERROR_FILE``, when set; this
    process's first failure is kept) and, with ``publish``, to the process group's store (the
    job's first failure is kept: the root cause), then, with ``tear_down``, tears the process
    group down (where nothing else holds it, that also closes its connections; ddpkit's waits do
    not depend on it). A record may name another rank than this one: a rank that is stuck,
    published by the rank that waited for it (``ddpkit.diagnostics.hangs``).
    """
    error_file = os.environ.get(DDPKIT_ERROR_FILE)
    if error_file:
        write_error_record(error_file, record)
    if not publish or not (dist.is_available() and dist.is_initialized()):
        return
    store = _default_store()
    if store is None:
        return
    try:
        with quiet_requests():
            publish_first(store, record_signer(), FAILURE, json.dumps(record))
            announce(store)  # the other ranks' peer watches read it at their launchers' word
    except RuntimeError:
        return  # the store is gone (its host died first): nothing to tell, and no one to tell it
    if dist.get_rank() == 0:
        atexit.register(_linger_until_read, store, dist.get_world_size())
    if tear_down:
        dist.destroy_process_group()


def record_signer() -> RecordSigner:
    """How this process signs and checks its records in the default group's store."""
    return RecordSigner(job_secret(), _default_scope() if PROCESS.failures.scope is None else PROCESS.failures.scope)


def sign_records_in(scope: str) -> None:
    """Bind this process's records from now on to ``scope`` (``ddpkit.membership.group``: the attempt and the
    generation of the group it formed), so that a record of another attempt or generation, copied
    into this one's keys, does not pass."""
    PROCESS.failures.scope = scope


def _default_scope() -> str:
    """A group that ddpkit did not form: the attempt the launcher says (each has a store of its own)."""
    return f"attempt {os.environ.get(DDPKIT_RESTART_COUNT) or os.environ.get('TORCHELASTIC_RESTART_COUNT') or 0}"


def publish_first(store: Any, signer: RecordSigner, name: str, payload: str) -> None:
    """Write record ``name`` unless the job wrote one already: the first of the job's records wins.
    A value under its key that does not carry the job's secret (a stranger's) is replaced."""
    with contextlib.suppress(JobSecretError):  # a stranger rewriting it: a denial of service the store allows
        signer.write_first(store, signer.key(name), payload)


def _this_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "-1"))


def peer_failure(probe_first: bool = False) -> CollectiveFailedError | None:
    """The failure another rank published, as the error to raise (``StoreHostGoneError`` when the
    store's host is gone); None when there is none. Call it between slices of a wait, or with
    ``probe_first`` after a collective failed (a dead host's store is then not asked: torch
    prints a long warning for each failed store request). A query: raise what it returns
    through ``raising``."""
    store = _default_store()
    if store is None:
        return None
    failure: CollectiveFailedError | None = (
        _gone_error(store) or (store_host_gone() if probe_first else None) or _published_failure(store))
    if failure is None and PROCESS.failures.peers_may_vanish:
        failure = _lost_peer(store)
    return failure


def raising(failure: CollectiveFailedError) -> CollectiveFailedError:
    """Say that ddpkit raises ``failure`` (from ``peer_failure``) in this process now, and return
    it (``raise raising(failure) from error``):

    - the collective ddpkit stops waiting for stays pending in Gloo, and finalising would wait for
      it: an uncaught exception leaves the process at once (``exits.leave_on_uncaught_exception``);
    - the peer watch learns that the main thread has it (``peer_failure_raised``);
    - the failed rank, which may host the store, counts this rank among those that read its record.
    """
    leave_on_uncaught_exception()
    PROCESS.failures.raised.set()
    if type(failure) is PeerFailedError and not PROCESS.failures.seen:
        PROCESS.failures.seen = True
        store = _default_store()
        if store is not None:
            with contextlib.suppress(RuntimeError), quiet_requests():
                store.add(record_signer().key(_SEEN), 1)  # once per process: the rank hosting the store waits for every rank
    return failure


def _published_failure(store: Any) -> PeerFailedError | None:
    """The failure another rank published in ``store``; ``StoreHostGoneError`` when it cannot be read
    because its host is gone."""
    try:
        record = read_failure_record(store)
    except RuntimeError:
        return store_host_gone()
    if record is None or (dist.is_initialized() and record["rank"] == dist.get_rank()):
        return None  # none, or our own failure: the original exception is already on its way
    return PeerFailedError.from_record(record)


def expect_vanished_peers(node_lost: Callable[[], str | None] = lambda: None) -> None:
    """From now on (in-place recovery), a collective that fails without any record means a rank
    vanished: ``note_lost_peer`` tells the others, and ``peer_failure`` answers ``PeerLostError``;
    so does ``node_lost`` saying why a node of the group was lost (``ddpkit.membership.generations``: its
    ranks may be alive behind a link that went down, and no collective fails)."""
    PROCESS.failures.peers_may_vanish = True
    PROCESS.failures.node_lost = node_lost


def lost_peers_expected() -> bool:
    """Whether ``expect_vanished_peers`` was called in this process."""
    return PROCESS.failures.peers_may_vanish


def note_lost_peer(error: BaseException) -> PeerLostError:
    """Tell the group's other ranks (through its store) that a rank vanished, as this rank's
    collective found out with ``error``; return the error to raise here."""
    store = _default_store()
    if store is not None:
        with contextlib.suppress(RuntimeError):
            publish_first(store, record_signer(), LOST, f"rank {_this_rank()}: {error}".splitlines()[0])
            announce(store)
    return PeerLostError(f"a rank of the group vanished (its collective failed on rank {_this_rank()}: "
                         f"{str(error).splitlines()[0] if str(error) else type(error).__name__}); "
                         "in-place recovery replaces it")


def announced_loss(store: Any) -> PeerLostError | None:
    """Under in-place recovery, the loss of a rank or node that a rank or a launcher announced in
    ``store`` (the group's), as the error to raise; None when none was, or outside in-place recovery."""
    return _lost_peer(store) if PROCESS.failures.peers_may_vanish else None


def _lost_peer(store: Any) -> PeerLostError | None:
    signer = record_signer()
    key = signer.key(LOST)
    try:
        with quiet_requests():
            note = signer.read(store, key)
        if note is None and (node := PROCESS.failures.node_lost()) is not None:
            return PeerLostError(f"a node of the group was lost ({node}); in-place recovery replaces its ranks")
    except RuntimeError:
        return None
    if note is None:
        return None
    return PeerLostError(f"a rank of the group vanished ({note}); in-place recovery replaces it")


def failure_behind(error: RuntimeError) -> CollectiveFailedError | None:
    """What a collective that failed with ``error`` tells of the other ranks: the failure one of
    them published (``PeerFailedError``, ``StoreHostGoneError``), or, under in-place recovery, that
    a rank vanished (``PeerLostError``; the other ranks are told through the store). None when it
    is none of these, or ``error`` says so already: ``error`` is then the caller's to raise.
    Raise what it returns through ``raising``."""
    if isinstance(error, (PeerFailedError, PeerLostError)):
        return None
    failure = peer_failure(probe_first=True)
    if failure is None and PROCESS.failures.peers_may_vanish:
        failure = note_lost_peer(error)  # a rank vanished: in-place recovery replaces it
    return failure


def raised_by_torch_distributed(error: BaseException) -> bool:
    """Whether ``error`` was raised inside ``torch.distributed`` (its innermost frame is there): a
    collective of the user's own, called without ddpkit, rather than an error of the user's code."""
    trace = error.__traceback__
    if trace is None:
        return False
    while trace.tb_next is not None:
        trace = trace.tb_next
    return os.path.abspath(trace.tb_frame.f_code.co_filename).startswith(_TORCH_DISTRIBUTED)


# The folder of torch.distributed's Python code (its collectives raise from there).
_TORCH_DISTRIBUTED = os.path.dirname(os.path.abspath(dist.__file__)) + os.sep


def uncaught_failure(error: BaseException) -> BaseException:
    """What a worker records for ``error``, an exception its script did not catch: when it is a
    ``torch.distributed`` collective of the user's own that failed because another rank failed or
    was lost, the error that says so (caused by ``error``), so that the launcher does not name a
    survivor's "Connection closed by peer" as the job's cause. A ``PeerLostError`` that got this far
    left ``DDPStrategy.step()`` (which recovers from it) or never was in one: a ddpkit collective
    between steps (``strategy.reduce`` of an epoch's metrics), which in-place recovery cannot redo;
    it says so instead of promising a recovery. Otherwise ``error``."""
    if isinstance(error, PeerLostError):
        return _not_redone(error, "a collective between steps", error.__cause__ or error)
    if not (isinstance(error, RuntimeError) and raised_by_torch_distributed(error)):
        return error
    failure = failure_behind(error)
    if failure is None:
        return error
    if isinstance(failure, PeerLostError):
        return _not_redone(failure, "a collective of its own", error)
    failure.__cause__ = error
    return failure.with_traceback(error.__traceback__)


# How a PeerLostError ends when it is raised to be recovered from (note_lost_peer, _lost_peer).
_PROMISE = re.compile(r"; in-place recovery replaces (it|its ranks)$")


def _not_redone(lost: PeerLostError, collective: str, cause: BaseException) -> PeerLostError:
    """``lost`` reworded for a collective that in-place recovery cannot redo (outside a step)."""
    failure = PeerLostError(
        f"{_PROMISE.sub('', str(lost))}, while this rank was in {collective} that "
        "in-place recovery cannot redo: one outside `with strategy.step():` and outside "
        "`strategy.between_steps(function)` (run code between steps, an evaluation or a metric's reduction, "
        "through it: it is then run again after a loss), or in a script that does not train in DDPStrategy's loop")
    failure.__cause__ = cause
    return failure.with_traceback(cause.__traceback__)


def store_host_gone() -> StoreHostGoneError | None:
    """``StoreHostGoneError`` when the default group's store (a TCP store) no longer accepts
    connections, else None. Found by connecting to it (``store_probe``: its server ignores the
    connection); remembered (with who hosted it: rank 0, or the launcher that tells its workers
    ``TORCHELASTIC_USE_AGENT_STORE``)."""
    store = _default_store()
    address = _tcp_address(store)
    if address is None:
        return None
    gone = _gone_error(store)
    if gone is not None:
        return gone
    reason = why_store_host_is_gone(address)
    if reason is None:
        return None
    PROCESS.failures.gone = (id(store), address, reason, _store_host_name())
    return _gone_error(store)


def _store_host_name() -> str:
    """Who hosts the default group's store: rank 0, or the launcher (torchrun's agent, or ddpkit
    run's store host) when it told the workers to use its store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return "rank 0"
    return "ddpkit run's store host" if os.environ.get(DDPKIT_LAUNCHED) else "torchrun's agent"


def _tcp_address(store: Any) -> tuple[str, int] | None:
    """(host, port) of the TCP store under ``store``'s prefixes; None for other stores."""
    tcp = tcp_store_under(store)
    return None if tcp is None else (tcp.host, tcp.port)


def read_failure_record(store: Any, timeout: timedelta | None = _READ_TIMEOUT) -> dict[str, Any] | None:
    """The failure record published in ``store`` (``ddpkit.diagnostics.records`` format), or None
    when there is none. Raises ``RuntimeError`` when the store cannot be reached (it may have died
    with its host: ``store_host_gone`` tells).

    ``timeout`` bounds the read (the store's own timeout is restored after); None leaves the
    store's timeout alone, for a reader in another thread: changing it, even briefly, would
    change it for the main thread's store operations too.
    """
    signer = record_signer()
    key = signer.key(FAILURE)
    previous_timeout = store.timeout
    try:
        if timeout is not None:
            store.set_timeout(timeout)
        with quiet_requests():
            payload = signer.read(store, key)
        if payload is None:
            return None
        record: dict[str, Any] = json.loads(payload)
        if not isinstance(record, dict) or not {"rank", "type", "message", "traceback"} <= record.keys():
            return None
        return record
    except ValueError:
        return None
    finally:
        if timeout is not None:
            with contextlib.suppress(RuntimeError):  # the group goes on using this store when nobody failed
                store.set_timeout(previous_timeout)


def peer_failure_raised(within: float = 0.0) -> bool:
    """Whether ddpkit has handed this process a ``PeerFailedError`` (it is on its way up the user's
    code), waiting up to ``within`` seconds for it to happen."""
    return PROCESS.failures.raised.wait(within)


def _gone_error(store: Any) -> StoreHostGoneError | None:
    """A new ``StoreHostGoneError`` when ``store``'s host was found gone (a new error each time:
    one raised twice would carry both tracebacks)."""
    gone = PROCESS.failures.gone
    if gone is None or gone[0] != id(store):
        return None
    return StoreHostGoneError(*gone[1:])


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _linger_until_read(store: Any, world_size: int) -> None:
    """At exit of the rank hosting the store: wait until the others have read the failure (bounded)."""
    deadline = time.monotonic() + _LINGER_SECONDS
    while time.monotonic() < deadline:
        try:
            with quiet_requests():
                seen = store.add(record_signer().key(_SEEN), 0)
            if seen >= world_size - 1:
                return
        except RuntimeError:
            return
        time.sleep(0.05)
