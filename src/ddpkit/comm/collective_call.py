"""The one diagnostics seam: every ddpkit collective, and each gradient synchronisation of the
DDP module, runs inside ``with collective_call(operation, group, tensor):`` (hang watch, debug-mode
fingerprints, a peer's failure named instead of a connection error); ``collective`` runs a
function of ``ddpkit.comm.collectives`` inside one. Built on ``ddpkit.comm.primitives`` (below it); the
public collectives are built on it: no module of either imports the other's way back.
"""

from __future__ import annotations

import functools
import inspect
import pickle
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch

from ddpkit.comm.primitives import ProcessGroup, all_gather_bytes, all_gather_stacked, communication_device, group_rank_and_size
from ddpkit.diagnostics.debug import (
    CollectiveMismatchError,
    call_site,
    checking,
    debug_enabled,
    fingerprint,
    mismatch,
)
from ddpkit.diagnostics.failures import failure_behind, raising
from ddpkit.diagnostics.hangs import HangWatch, start_hang_watch
from ddpkit.diagnostics.peer_watch import watch_peers
from ddpkit.membership.connection import distributed_available

__all__ = ["collective", "collective_call"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class collective_call:
    """The diagnostics seam: every ddpkit collective, and each gradient synchronisation of the
    DDP module, runs inside ``with collective_call(operation, group, tensor):``.

    - With hang diagnosis on (``ddpkit.diagnostics.hangs``), the watch notes that this rank is in
      ``operation``, called from the user's code at ``call_site()``, until the block ends.
    - In debug mode (``ddpkit.diagnostics.debug``; ``fingerprint`` overrides the setting), the ranks of
      ``group`` first compare fingerprints (operation, sequence number, dtype and, if ``compare_shape``,
      shape of ``tensor``, call site) and raise ``CollectiveMismatchError`` on every rank when they differ.
    - When the block fails with a ``RuntimeError`` because another rank published its failure
      (``ddpkit.diagnostics.failures``), ``PeerFailedError`` naming that rank and its exception is
      raised instead of the connection error. Under in-place recovery, a failure that nobody
      recorded (a rank was killed) becomes ``PeerLostError``, and the other ranks are told.

    Blocks inside a block (a collective that another one makes) are neither watched nor checked
    again. A class, not a generator: the call site is found by walking up the frames, and a
    generator's caller would be ``contextlib``.
    """

    __slots__ = ("_operation", "_group", "_tensor", "_compare_shape", "_fingerprint", "_nesting", "_watch")

    def __init__(self, operation: str, group: ProcessGroup = None, tensor: Any = None, *,
                 compare_shape: bool = True, fingerprint: bool | None = None) -> None:
        self._operation, self._group, self._tensor = operation, group, tensor
        self._compare_shape, self._fingerprint = compare_shape, fingerprint
        self._nesting: checking | None = None
        self._watch: HangWatch | None = None

    def __enter__(self) -> None:
        watch_peers()
        debug = debug_enabled() if self._fingerprint is None else self._fingerprint
        watch = start_hang_watch()
        if not (debug or watch is not None) or not distributed_available():
            return
        self._nesting = checking()
        if not self._nesting.__enter__():
            return  # inside another block, which is checked and watched
        if watch is not None:
            self._watch = watch
            watch.enter(self._operation, call_site())
        if debug:
            try:
                _check_fingerprints(self._operation, self._group, self._tensor, self._compare_shape)
            except BaseException as error:
                self.__exit__(type(error), error, error.__traceback__)
                raise

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        if self._watch is not None:
            self._watch.leave()
            self._watch = None
        if self._nesting is not None:
            self._nesting.__exit__()
            self._nesting = None
        if isinstance(error, RuntimeError):
            failure = failure_behind(error)
            if failure is not None:
                raise raising(failure) from error


def collective(tensor_argument: str | None = None,
                compare_shape: bool = True) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Run one of ddpkit's collectives inside ``collective_call``, named after the function; in
    debug mode its argument ``tensor_argument`` (and ``group``) are the ones fingerprinted."""

    def decorate(collective: Callable[_P, _R]) -> Callable[_P, _R]:
        signature = inspect.signature(collective)
        operation = collective.__name__

        @functools.wraps(collective)
        def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            debug = debug_enabled()
            group = tensor = None
            if debug:
                arguments = signature.bind(*args, **kwargs).arguments
                group = arguments.get("group")
                tensor = arguments.get(tensor_argument) if tensor_argument else None
            with collective_call(operation, group, tensor, compare_shape=compare_shape, fingerprint=debug):
                return collective(*args, **kwargs)

        return run

    return decorate


def _check_fingerprints(operation: str, group: ProcessGroup, tensor: Any = None, compare_shape: bool = True) -> None:
    """Debug mode: raise on every rank of ``group`` if they are not all about to run the same collective."""
    mine = fingerprint(operation, group, tensor, compare_shape)
    _, world_size = group_rank_and_size(group)
    code = torch.tensor(mine.code(), dtype=torch.long, device=communication_device(group))
    codes = all_gather_stacked(code, group, world_size)
    if bool((codes == codes[0]).all()):
        return
    with checking():  # the exchange is itself a collective: not fingerprinted
        everyone = [pickle.loads(theirs) for theirs in all_gather_bytes(pickle.dumps(mine), group)]
    problem = mismatch(everyone)
    if problem is not None:
        raise CollectiveMismatchError(f"ddpkit debug mode: {problem}")
