"""The store a group is formed through, with torch's own values signed (``ddpkit.store.job_secret``).

When torch forms a Gloo group, each rank writes its address under a key of the store and reads
the others' (``set``, ``wait``, ``get``). Anyone who reaches the store can write an address under
a rank's key, and the ranks would connect to that process as the rank: at an in-place recovery,
it would stand in for the replacement and be sent the model's state. ``SignedStore`` signs every
value torch writes with the job secret (bound to the key and the group's attempt and generation)
and, when torch reads, waits for a value that carries the signature: a stranger's is passed over
(and said once), and the rank's own, written before or after it, is the one read. A stranger who
overwrites a rank's value after it was written stalls the formation until the store's timeout (a
denial of service the store allows; the members' proof, ``Group.prove_members``, still stands).

ddpkit's own records (under the job's key prefix) carry their own signature
(``job_secret.RecordSigner``) and pass through as they are, as do counts and the other calls.
"""

from __future__ import annotations

import time
from typing import Any

from ddpkit.store.job_secret import RecordSigner
from ddpkit.store.pass_through import PassThroughStore, kept

__all__ = ["SignedStore", "signed"]

# How often a read looks again for the signed value while only a forged one is there.
_RETRY_SECONDS = 0.01


class SignedStore(PassThroughStore):
    """``store`` with torch's values signed by ``signer`` (see the module docstring)."""

    def __init__(self, store: Any, signer: RecordSigner) -> None:
        super().__init__(store)
        self._signer = signer

    def _torchs(self, key: str) -> bool:
        # torch puts its group's prefix ("0/") before ddpkit's record keys, and never the job's prefix in its own.
        return self._signer.namespace not in key

    def set(self, key: str, value: bytes | str) -> None:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        self._store.set(key, self._signer.sign_bytes(key, raw) if self._torchs(key) else raw)

    def get(self, key: str) -> bytes:
        if not self._torchs(key):
            return bytes(self._store.get(key))
        deadline = time.monotonic() + self._store.timeout.total_seconds()
        while True:
            payload = self._signer.verify_bytes(key, bytes(self._store.get(key)))
            if payload is not None:
                return payload
            if time.monotonic() > deadline:
                raise RuntimeError(f"the store's value under {key!r} does not carry this job's secret, and none that "
                                   f"does came within {self._store.timeout.total_seconds():g} s: a process outside "
                                   "the job keeps writing it. Check who can reach the job's store port.")
            time.sleep(_RETRY_SECONDS)


def signed(store: Any, signer: RecordSigner) -> Any:
    """``store`` as the group should be formed through: a ``SignedStore`` when ``signer`` has a
    secret, ``store`` itself otherwise."""
    if signer.secret is None:
        return store
    return kept(SignedStore(store, signer))
