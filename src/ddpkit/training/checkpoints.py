"""Checkpoint files: written so that a save killed half-way leaves the previous file in place.

``DDPStrategy.save_checkpoint`` decides who writes (rank 0, or the lowest survivor when rank 0 was
lost during the save) and makes every rank wait; this module writes and reads the file, and keeps
in it how many shares each global batch had (``DATA_WORLD_KEY``): a job that resumes it with
another world would train other batches than the run it continues (smaller or larger ones, and
another number of steps per epoch), so ``take_data_world`` refuses it before anything is trained.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

__all__ = ["DATA_WORLD_KEY", "read_checkpoint", "take_data_world", "write_atomically"]

#: The key under which a checkpoint keeps its job's data world (the shares of each global batch).
DATA_WORLD_KEY = "ddpkit_data_world_size"


def write_atomically(path: str, state: dict[str, Any]) -> None:
    """Temporary file in the same folder, fsync, rename: a reader sees the old file or the new one."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=".ddpkit-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o666 & ~_current_umask())  # mkstemp makes it 0600; a checkpoint is an ordinary file
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def read_checkpoint(path: str, device: torch.device) -> dict[str, Any]:
    """The checkpoint at ``path``, its tensors on ``device``."""
    loaded: dict[str, Any] = torch.load(path, map_location=device, weights_only=False)
    return loaded


def take_data_world(path: str, state: dict[str, Any], data_world: int, world_may_differ: bool) -> dict[str, Any]:
    """``state`` without ``DATA_WORLD_KEY``; ``ValueError`` when it says the checkpoint's job cut each
    global batch in another number of shares than ``data_world``, this job's, unless
    ``world_may_differ`` (a checkpoint without the key, written by other code, is not checked)."""
    saved = state.pop(DATA_WORLD_KEY, None)
    if saved is None or world_may_differ or int(saved) == data_world:
        return state
    fewer = int(saved) > data_world
    raise ValueError(
        f"the checkpoint {path} was trained by a job of {int(saved)} ranks, whose global batch had {int(saved)} shares, "
        f"and this job has {data_world}: resuming it would train {'smaller' if fewer else 'larger'} global batches, "
        f"{'more' if fewer else 'fewer'} steps per epoch, than the run it continues, and end elsewhere. Start the job "
        f"with {int(saved)} ranks (with --nnodes MIN:MAX, wait for every node: a longer --rdzv-conf last_call_timeout), "
        "or, to continue with this world's global batch on purpose, load_checkpoint(path, world_may_differ=True).")


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
