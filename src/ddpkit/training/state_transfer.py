"""The training state in flight: which rank of a new generation sends it (``gather_places``,
``send_state``; ``exchange_state`` does both), and how it travels: a survivor's state (a model's
and an optimizer's tensors, and everything around them) reaches every other rank in one broadcast.

The object is pickled with each tensor replaced by its index (``persistent_id``), so the pickle
holds only the structure; the tensors travel as the bytes of one flat buffer, each at an aligned
offset, so neither side pickles or unpickles their data. The buffer lives where the group's
collectives run (a GPU on NCCL); each receiver gets tensors of its own, on the device type its
sender held them on.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ddpkit.comm.collective_call import collective_call
from ddpkit.comm.collectives import all_gather_object, broadcast_object
from ddpkit.comm.primitives import communication_device
from ddpkit.diagnostics.failures import PeerLostError
from ddpkit.diagnostics.waits import run_collective
from ddpkit.logs import get_logger
from ddpkit.membership.group import current_group
from ddpkit.store.keys import REJOIN_PART

__all__ = ["Exchange", "Places", "broadcast_state", "exchange_state", "gather_places", "places_after_the_survivors_block",
           "send_state"]

_log = get_logger("recovery")

# Every tensor starts at a multiple of this many bytes in the flat buffer, so that a slice of it
# can be viewed as the tensor's dtype again.
_ALIGNMENT = 16


@dataclass
class Places:
    """What every rank of a new generation said of itself, by rank (``gather_places``): whether it
    replaces a lost rank, its optimizer steps (-1: a replacement), and the between-steps block it
    was in when the rank was lost (None: none; ``ddpkit.training.between_steps``)."""

    replacement: list[bool]
    steps: list[int]
    blocks: list[Any]

    @property
    def replaced(self) -> list[int]:
        return [rank for rank, is_replacement in enumerate(self.replacement) if is_replacement]

    @property
    def survivors(self) -> list[int]:
        return [rank for rank, is_replacement in enumerate(self.replacement) if not is_replacement]

    def check_same_block(self) -> None:
        """``RuntimeError`` on every rank when the survivors were not all in the same block between
        steps when the rank was lost (one had finished it and met the loss in its next collective):
        the block cannot be run again by some of them only."""
        where = {repr(self.blocks[rank]) for rank in self.survivors}
        if len(where) > 1:
            each = ", ".join(f"rank {rank}: {self.blocks[rank] or 'not in a block'}" for rank in self.survivors)
            raise RuntimeError(f"in-place recovery: the surviving ranks met the loss in different places ({each}), "
                               "so the block between steps cannot be run again by all of them. The job ends; run it "
                               "again from its checkpoint.")


@dataclass
class Exchange:
    """What ``send_state`` did on this rank: the state every rank now holds, whether this rank
    sent it, the ranks that replaced lost ones, and each rank's optimizer steps (-1: a replacement)."""

    state: dict[str, Any]
    sent: bool
    replaced: list[int]
    steps: list[int]


def gather_places(replacement: bool, steps: int, block: Any = None) -> Places:
    """The first collective of a new generation, on every rank of it: who replaces a lost rank, how
    many optimizer steps each took, and which between-steps block each was in."""
    gathered = all_gather_object((replacement, -1 if replacement else steps, block))
    return Places([bool(entry[0]) for entry in gathered], [int(entry[1]) for entry in gathered],
                  [entry[2] for entry in gathered])


def send_state(places: Places, state: Callable[[], dict[str, Any]]) -> Exchange:
    """The survivor with the most steps (the lowest rank among equals) sends ``state()`` (called on
    that rank only) to every other rank by one ``broadcast_state``. ``RuntimeError`` when every rank
    is a replacement (no rank holds the state)."""
    candidates = places.survivors
    if not candidates:
        raise RuntimeError("in-place recovery: every rank of the new generation is a replacement; no rank holds "
                           "the training state. Restart from a checkpoint (ddpkit run --max-restarts).")
    sender = max(candidates, key=lambda rank: (places.steps[rank], -rank))
    mine = dist.get_rank() == sender
    sent: dict[str, Any] = broadcast_state(state() if mine else None, sender)
    return Exchange(sent, mine, places.replaced, list(places.steps))


def places_after_the_survivors_block(places: Places, waiting: Callable[[], None]) -> Places:
    """In a replacement, after ``gather_places``: while the survivors say they were in a block between
    steps (they run it again without the replacements), call ``waiting`` (the launcher is told), wait
    outside until they ask the replacements to rejoin at their next step boundary (or a later
    generation forms), and gather again there; the places then."""
    group = current_group()
    while group is not None and (block := next((b for b in places.blocks if b is not None), None)) is not None:
        waiting()
        _log.warning(f"ddpkit: the other ranks run {block} again without this rank; it joins them at their next "
                     "step boundary")
        try:
            if not group.wait_outside():
                raise PeerLostError("a rank was lost while this rank waited outside the block")
            group.form_part(REJOIN_PART)
        except PeerLostError:
            group.form(group.generation + 1)  # a member lost meanwhile: the next generation (or a later one)
        places = gather_places(True, -1)
    return places


def exchange_state(replacement: bool, steps: int, state: Callable[[], dict[str, Any]]) -> Exchange:
    """The exchange of a new generation, on every rank of it: ``gather_places`` then ``send_state``."""
    return send_state(gather_places(replacement, steps), state)


def broadcast_state(obj: Any, src: int) -> Any:
    """``broadcast_object`` for an object of large tensors (a model's and an optimizer's state):
    the rest is pickled and sent as usual, the tensors travel as the bytes of one flat buffer,
    so neither side pickles or unpickles their data (a large part of a recovery's time otherwise).
    The buffer lives where the group's collectives run (a GPU on NCCL, which moves only CUDA
    tensors). Each receiver gets tensors of its own, each on the device type the sender held it
    on (a GPU tensor on this rank's GPU, the RNG state on the CPU); ``src`` (a global rank) gets ``obj`` back."""
    mine = dist.get_rank() == src
    tensors: list[Tensor] = []
    outline = broadcast_object((_set_tensors_apart(obj, tensors),
                                [(t.shape, t.dtype, t.device.type != "cpu") for t in tensors]) if mine else None, src=src)
    skeleton, layout = outline
    device = communication_device(None)
    flat = _pack(tensors, device) if mine else torch.empty(_packed_size(layout), dtype=torch.uint8, device=device)
    with collective_call("in-place recovery: the training state", None, flat):  # a loss here: PeerLostError
        run_collective(dist.broadcast, flat, src=src)
    return obj if mine else _put_tensors_back(skeleton, _unpack(flat, layout))


def _set_tensors_apart(obj: Any, tensors: list[Tensor]) -> bytes:
    """``obj`` pickled with each tensor replaced by its index in ``tensors`` (appended there)."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)

    def persistent_id(value: Any) -> int | None:
        if isinstance(value, Tensor):
            tensors.append(value.detach())
            return len(tensors) - 1
        return None

    pickler.persistent_id = persistent_id  # type: ignore[method-assign]
    pickler.dump(obj)
    return buffer.getvalue()


def _put_tensors_back(skeleton: bytes, tensors: list[Tensor]) -> Any:
    """The object ``_set_tensors_apart`` pickled, with ``tensors`` in their places."""
    unpickler = pickle.Unpickler(io.BytesIO(skeleton))
    unpickler.persistent_load = lambda index: tensors[index]  # type: ignore[method-assign]
    return unpickler.load()


def _bytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return shape.numel() * dtype.itemsize


def _span(shape: torch.Size, dtype: torch.dtype) -> int:
    """The bytes a tensor takes in the flat buffer: its own, up to the next aligned offset."""
    return -(-_bytes(shape, dtype) // _ALIGNMENT) * _ALIGNMENT


# Each tensor of the state as the flat buffer lays it out: shape, dtype, and whether the sender
# held it on an accelerator (the receiver puts it on its own) rather than on the CPU.
_Layout = list[tuple[torch.Size, torch.dtype, bool]]


def _packed_size(layout: _Layout) -> int:
    return sum(_span(shape, dtype) for shape, dtype, _ in layout)


def _pack(tensors: list[Tensor], device: torch.device) -> Tensor:
    """The bytes of ``tensors``, one after the other (each at an aligned offset), on ``device``."""
    flat = torch.empty(_packed_size([(t.shape, t.dtype, False) for t in tensors]), dtype=torch.uint8, device=device)
    offset = 0
    for tensor in tensors:
        size = _bytes(tensor.shape, tensor.dtype)
        if size:
            flat[offset : offset + size].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        offset += _span(tensor.shape, tensor.dtype)
    return flat


def _unpack(flat: Tensor, layout: _Layout) -> list[Tensor]:
    """The tensors ``_pack`` laid out in ``flat``, each a tensor of its own (not a view of ``flat``),
    on this rank's GPU when the sender's was on one (and this rank has one), else on the CPU."""
    accelerator = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tensors = []
    offset = 0
    for shape, dtype, on_accelerator in layout:
        piece = flat[offset : offset + _bytes(shape, dtype)].view(dtype).reshape(shape)
        target = accelerator if on_accelerator else torch.device("cpu")
        tensors.append(piece.to(target, copy=True))
        offset += _span(shape, dtype)
    return tensors
