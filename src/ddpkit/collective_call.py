"""The one diagnostics seam: every ddpkit collective, and each gradient synchronisation of the
DDP module, runs inside ``with collective_call(operation, group, tensor):`` (hang watch, debug-mode
fingerprints, a peer's failure named instead of a connection error); ``collective`` runs a
function of ``ddpkit.collectives`` inside one. With the few helpers the seam and the collectives
share: the device of a group's tensors, a rank's place in a group, a stacked all-gather.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from ddpkit.connection import distributed_available
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
from ddpkit.diagnostics.waits import run_collective

__all__ = ["all_gather_stacked", "collective", "collective_call", "communication_device", "group_rank_and_size"]

ProcessGroup = Any  # torch.distributed.ProcessGroup, or None for the default group

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
    from ddpkit.collectives import all_gather_object  # the collectives run inside this seam: imported late

    with checking():  # the exchange is itself a collective: not fingerprinted
        everyone = all_gather_object(mine, group)
    problem = mismatch(everyone)
    if problem is not None:
        raise CollectiveMismatchError(f"ddpkit debug mode: {problem}")


def group_rank_and_size(group: ProcessGroup) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; raises if this process is not in it."""
    rank = dist.get_rank(group)
    if rank < 0:
        members = dist.get_process_group_ranks(group)
        raise ValueError(
            f"Global rank {dist.get_rank()} called a collective on a process group it is not a member of "
            f"(members: global ranks {members}). Call collectives on a group only from its members."
        )
    return rank, dist.get_world_size(group)


def communication_device(group: ProcessGroup) -> torch.device:
    """Where tensors that ddpkit creates for a collective must live: NCCL only moves CUDA tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); earlier
# releases, which pyproject's torch>=2.4 admits, have only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_stacked(tensor: Tensor, group: ProcessGroup, world_size: int) -> Tensor:
    """All ranks' ``tensor`` (same shape everywhere) stacked into ``(world_size, *shape)``.

    Gathers a flat view into one output buffer: no list of outputs and no ``torch.stack`` copy.
    """
    flat = tensor.detach().contiguous().reshape(-1)
    out = flat.new_empty(world_size * flat.numel())
    if flat.numel() > 0:  # every rank has the same numel here, so all skip or none does
        run_collective(_all_gather_single, out, flat, group=group)
    return out.view(world_size, *tensor.shape)
