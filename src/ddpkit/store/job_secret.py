"""The job secret: what tells ddpkit's own records in the store from a stranger's.

torch's store (c10d's TCPStore) lets any process that reaches its port read, list, write and
delete every key, and PyTorch's SECURITY.md says c10d has no authorisation. ddpkit trusts the
store more than torch does: one failure record ends every rank and names the culprit, a lost-peer
note starts an in-place recovery, a hang report names the stuck rank. So, when the job has a
secret:

- every key ddpkit reads or writes lives under a prefix derived from it (``namespace``): jobs that
  share a store keep apart, and a key name read from ddpkit's source is not the job's. The prefix
  is not itself secret (a stranger can list the store's keys);
- every record ddpkit believes carries an HMAC-SHA256 of the secret over its key, its scope (the
  attempt and generation of the group it belongs to) and its contents (``RecordSigner``); a record
  that fails is ignored, and said once;
- every member of a group proves the secret before anything is sent to it or unpickled from it
  (``member_proof``, used by ``ddpkit.membership.group``).

Where the secret comes from (``job_secret``), in this order: ``DDPKIT_JOB_SECRET`` (the job's
environment: what a scheduler passes to every node, e.g. a Kubernetes Secret), or the file named by
``DDPKIT_JOB_SECRET_FILE`` (readable only by the job's user). ``ddpkit run`` on one node, and
in-script launching, make a random one when neither is given and hand it to their workers;
across nodes each launcher needs the same one from the user (``--rdzv-id`` is not secret). Without
one, ddpkit runs as before (records unauthenticated) and says so once.

What this leaves open is torch's own: a stranger can still delete or overwrite keys (ending or
stalling a job: a denial of service, never a forged cause or a state transfer), and Gloo's and
NCCL's data connections are not authenticated. Imports only ``variables`` and ``logs``.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ddpkit.logs import get_logger
from ddpkit.process_state import PROCESS
from ddpkit.store.keys import NAMESPACE, signed_namespace
from ddpkit.variables import DDPKIT_JOB_SECRET, DDPKIT_JOB_SECRET_FILE

__all__ = ["MIN_SECRET_CHARACTERS", "JobSecret", "JobSecretError", "RecordSigner", "job_secret", "member_proof",
           "new_job_secret", "unsigned_namespace"]

_log = get_logger("security")

#: The shortest secret accepted: 16 characters (a random hex string of 64 bits at the least).
MIN_SECRET_CHARACTERS = 16
_SIGNED_MARK = "ddpkit-hmac-sha256:"
_HOW_TO_MAKE = "python -c 'import secrets; print(secrets.token_hex(32))'"


class JobSecretError(ValueError):
    """The job secret given is unusable (too short, not text, its file unreadable)."""


@dataclass(frozen=True)
class JobSecret:
    """The job's secret and where it came from (said in messages; the value never is)."""

    value: bytes = field(repr=False)
    source: str

    def namespace(self) -> str:
        """The prefix of every key ddpkit reads or writes in the job's stores."""
        digest = hmac.new(self.value, b"ddpkit key namespace", hashlib.sha256).hexdigest()
        return signed_namespace(digest[:16])

    def mac(self, *parts: str) -> str:
        """HMAC-SHA256 of ``parts`` (each length-prefixed, so no two splits of a text collide), hex."""
        message = b"".join(len(encoded).to_bytes(8, "big") + encoded
                           for encoded in (part.encode("utf-8", "surrogateescape") for part in parts))
        return hmac.new(self.value, message, hashlib.sha256).hexdigest()


def unsigned_namespace() -> str:
    """The prefix of ddpkit's keys in a job without a secret."""
    return NAMESPACE


def new_job_secret() -> str:
    """A fresh random secret (256 bits, hex) for a launcher to hand its workers."""
    return secrets.token_hex(32)


def job_secret(environment: Mapping[str, str] | None = None) -> JobSecret | None:
    """The job's secret from ``DDPKIT_JOB_SECRET`` or ``DDPKIT_JOB_SECRET_FILE`` (``environment``:
    ``os.environ`` by default); None when neither is set. ``JobSecretError`` names what is wrong
    with a value given (both set, too short, a file that cannot be read) and how to fix it."""
    env = os.environ if environment is None else environment
    return _read(env.get(DDPKIT_JOB_SECRET), env.get(DDPKIT_JOB_SECRET_FILE))


@functools.lru_cache(maxsize=8)
def _read(value: str | None, path: str | None) -> JobSecret | None:
    # Cached: the file is read once per process (it may be removed once the job runs).
    if value and path:
        raise JobSecretError(f"Both {DDPKIT_JOB_SECRET} and {DDPKIT_JOB_SECRET_FILE}={path!r} are set: give the job's "
                             "secret one way only (unset one of them).")
    if value is not None and value != "":
        return JobSecret(_checked(value, DDPKIT_JOB_SECRET), DDPKIT_JOB_SECRET)
    if value == "":
        raise JobSecretError(f"{DDPKIT_JOB_SECRET} is set but empty: set it to the same random value on every node "
                             f"(e.g. the output of `{_HOW_TO_MAKE}`), or unset it.")
    if path is None:
        return None
    if not path.strip():
        raise JobSecretError(f"{DDPKIT_JOB_SECRET_FILE} is set but empty: name a file that holds the job's secret, "
                             "or unset it.")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(4097)
        mode = os.stat(path).st_mode
    except OSError as error:
        raise JobSecretError(f"{DDPKIT_JOB_SECRET_FILE}={path!r} cannot be read ({error.strerror or error}): name a "
                             "file this user can read on every node, holding the job's secret.") from None
    if len(raw) > 4096:
        raise JobSecretError(f"{DDPKIT_JOB_SECRET_FILE}={path!r} holds more than 4096 bytes: it should hold one "
                             f"secret on one line (e.g. the output of `{_HOW_TO_MAKE}`).")
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise JobSecretError(f"{DDPKIT_JOB_SECRET_FILE}={path!r} is not UTF-8 text: write the secret as text (e.g. "
                             f"the output of `{_HOW_TO_MAKE}`).") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        _log.warning(f"ddpkit: {DDPKIT_JOB_SECRET_FILE}={path!r} can be read by other users (mode "
                     f"{stat.filemode(mode)}): whoever reads it can act as this job. `chmod 600 {path}`.")
    return JobSecret(_checked(text, f"{DDPKIT_JOB_SECRET_FILE}={path!r}"), f"{DDPKIT_JOB_SECRET_FILE}={path}")


def _checked(text: str, source: str) -> bytes:
    try:
        value = text.encode("utf-8")
    except UnicodeEncodeError:  # a value that was not UTF-8 in the environment (surrogate escapes)
        raise JobSecretError(f"{source} is not UTF-8 text: use the output of `{_HOW_TO_MAKE}`.") from None
    if len(text) < MIN_SECRET_CHARACTERS:
        raise JobSecretError(f"{source} is {len(text)} characters long: a job secret needs at least "
                             f"{MIN_SECRET_CHARACTERS} random ones, e.g. the output of `{_HOW_TO_MAKE}`.")
    return value


class RecordSigner:
    """Signs and checks the records one process writes in and reads from one store.

    ``scope`` binds a record to where it belongs (the attempt and the generation of the group), so
    that a record copied from another attempt or generation does not pass. Without a secret,
    records are written and read as they are, under ``unsigned_namespace()``.
    """

    def __init__(self, secret: JobSecret | None, scope: str = "") -> None:
        self.secret, self.scope = secret, scope

    @property
    def namespace(self) -> str:
        return self.secret.namespace() if self.secret is not None else NAMESPACE

    def key(self, name: str) -> str:
        """The store key of ddpkit's record ``name`` (e.g. ``"failure"``)."""
        return self.namespace + name

    def sign(self, key: str, payload: str) -> str:
        """What to write under ``key``: ``payload`` with its HMAC (``payload`` alone without a secret)."""
        if self.secret is None:
            return payload
        return f"{_SIGNED_MARK}{self.secret.mac(key, self.scope, payload)}:{payload}"

    def verify(self, key: str, stored: bytes | str) -> str | None:
        """The payload of a value read from ``key``, or None when it does not carry the job secret's
        HMAC (written by a process outside the job: ignored, and said once per key)."""
        text = stored.decode("utf-8", "surrogateescape") if isinstance(stored, bytes) else stored
        if self.secret is None:
            return text
        mac, _, payload = text.removeprefix(_SIGNED_MARK).partition(":")
        if text.startswith(_SIGNED_MARK) and hmac.compare_digest(mac, self.secret.mac(key, self.scope, payload)):
            return payload
        self._refuse(key, text)
        return None

    def read(self, store: Any, key: str) -> str | None:
        """The payload the job wrote under ``key`` in ``store``; None when there is none, or it does
        not carry the job secret's HMAC."""
        if not store.check([key]):
            return None
        return self.verify(key, store.get(key))

    def write(self, store: Any, key: str, payload: str) -> None:
        """Write ``payload`` under ``key`` in ``store``, signed."""
        store.set(key, self.sign(key, payload))

    def _refuse(self, key: str, text: str) -> None:
        if key not in PROCESS.refused_keys and self.secret is not None:
            PROCESS.refused_keys.add(key)
            _log.warning(f"ddpkit: ignored a value under the store key {key!r} that does not carry this job's secret "
                         f"({self.secret.source}): a process outside the job wrote it. Its first bytes: "
                         f"{text[:80]!r}. Check who can reach the job's store port.")

    def write_first(self, store: Any, key: str, payload: str) -> str:
        """Write ``payload`` under ``key`` unless the job wrote a value there already (the first
        written wins); return the payload that holds the key now. A value that does not carry the
        job secret (a stranger's) is replaced, up to ``_REPLACE_ATTEMPTS`` times."""
        value, expected = self.sign(key, payload), ""
        for _ in range(_REPLACE_ATTEMPTS):
            current = bytes(store.compare_set(key, expected, value)).decode("utf-8", "surrogateescape")
            if current == value:
                return payload
            held = self.verify(key, current)
            if held is not None:
                return held
            expected = current
        raise JobSecretError(f"could not write {key!r} in the job's store: a value without this job's secret replaced "
                             f"it {_REPLACE_ATTEMPTS} times (a process outside the job rewrites it). Check who can "
                             "reach the job's store port.")

    def sign_bytes(self, key: str, payload: bytes) -> bytes:
        """``sign`` for a binary value (torch's own, e.g. a Gloo address)."""
        if self.secret is None:
            return payload
        return f"{_SIGNED_MARK}{self.secret.mac(key, self.scope, payload.hex())}:".encode() + payload

    def verify_bytes(self, key: str, stored: bytes) -> bytes | None:
        """``verify`` for a binary value: its payload, or None (said once per key)."""
        if self.secret is None:
            return stored
        mark = _SIGNED_MARK.encode()
        mac, _, payload = stored.removeprefix(mark).partition(b":")
        if stored.startswith(mark) and hmac.compare_digest(mac.decode("ascii", "replace"),
                                                           self.secret.mac(key, self.scope, payload.hex())):
            return payload
        self._refuse(key, stored.decode("utf-8", "replace"))
        return None



# How many forged values ``write_first`` replaces before it gives up (a stranger rewriting the key
# as fast as it is replaced: a denial of service the store allows, see the module docstring).
_REPLACE_ATTEMPTS = 8

# The keys under which this process ignored a forged value: each is said once per process, however
# often a watch thread reads it.


def member_proof(secret: JobSecret, scope: str, rank: int, nonces: bytes) -> bytes:
    """What rank ``rank`` of a group sends to prove that it holds ``secret``: an HMAC over the
    group's ``scope`` and the ``nonces`` every member drew for this formation (so a proof seen once
    is worth nothing the next time), 32 bytes."""
    return bytes.fromhex(secret.mac("member proof", scope, str(rank), nonces.hex()))
