"""A store written in Python over another store, for the wrappers through which ddpkit forms a
group (``signed_store``, ``forming_store``): every call is passed on, and a subclass changes the
few it must.

torch keeps only the C++ half of a store written in Python, whose methods fail ("Not
implemented") once the Python half is freed, and a group may outlive ddpkit's account of it (an
abandoned one, which a thread frees once its pending collectives end: ``group.Group.abort``):
``kept`` holds each wrapper until the process ends.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from ddpkit.process_state import PROCESS

__all__ = ["PassThroughStore", "kept"]


class PassThroughStore(dist.Store):  # type: ignore[misc,name-defined]  # a pybind11 class torch does not declare
    """``store``, every call passed on to it."""

    def __init__(self, store: Any) -> None:
        super().__init__()
        self._store = store
        super().set_timeout(store.timeout)

    @property
    def underlying_store(self) -> Any:
        """The store under this one (as ``PrefixStore`` says it), for whoever needs its address."""
        return self._store

    def set(self, key: str, value: bytes | str) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._store.get(key))

    def add(self, key: str, value: int) -> int:
        return int(self._store.add(key, value))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return bytes(self._store.compare_set(key, expected, desired))

    def check(self, keys: list[str]) -> bool:
        return bool(self._store.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._store.wait(keys)
        else:
            self._store.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self._store.delete_key(key))

    def num_keys(self) -> int:
        return int(self._store.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self._store.set_timeout(timeout)

    def list_keys(self) -> list[str]:
        return list(self._store.list_keys())


Wrapper = TypeVar("Wrapper", bound=PassThroughStore)


def kept(store: Wrapper) -> Wrapper:
    """``store``, held until the process ends (see the module docstring)."""
    PROCESS.kept_stores.append(store)
    return store

