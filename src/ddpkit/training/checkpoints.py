"""Checkpoint files: written so that a save killed half-way leaves the previous file in place.

``DDPStrategy.save_checkpoint`` decides who writes (rank 0, or the lowest survivor when rank 0 was
lost during the save) and makes every rank wait; this module only writes and reads the file.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

__all__ = ["read_checkpoint", "write_atomically"]


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


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
