"""glibc's malloc thresholds for training: freed gradients and activations stay in the process.

glibc hands freed memory of 128 KiB and more back to the kernel and takes it back on the next
allocation, zero-filled page by page. Training frees and reallocates its gradients and activations
every step, so without these thresholds a CPU step of an 8 x 1024 MLP takes thousands of page
faults (benchmarks/README.md, "Allocator and threads"). Both are set: a trim threshold alone turns
glibc's adaptive mmap threshold off and faults more. 32 MiB is the largest mmap threshold glibc
accepts on 64-bit systems.

``ddpkit run`` gives its workers the thresholds as environment variables (glibc reads them at
start); a process that ddpkit did not start (torchrun, srun, mpirun, a script run by hand) gets
them from ``keep_freed_memory()``, which ``DistributedDataParallel`` calls when it is built. Either
way only when the user chose no malloc setting of their own. Nothing of torch is imported here:
the launcher uses the same table.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

__all__ = ["MALLOC_DEFAULTS", "MALLOC_SETTINGS", "keep_freed_memory", "malloc_chosen"]

_MMAP_THRESHOLD = 32 * 1024 * 1024
_TRIM_THRESHOLD = 256 * 1024 * 1024
MALLOC_DEFAULTS = {"MALLOC_MMAP_THRESHOLD_": str(_MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(_TRIM_THRESHOLD)}
#: Any of these in the environment means the user tuned malloc: ddpkit then leaves it alone.
MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")

# mallopt's parameter numbers, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def malloc_chosen(environment: Mapping[str, str]) -> bool:
    """Whether ``environment`` holds a malloc setting of the user's (or of ``ddpkit run``'s)."""
    return any(name in environment for name in MALLOC_SETTINGS)


def keep_freed_memory(environment: Mapping[str, str] | None = None) -> bool:
    """Set this process's mmap and trim thresholds (``MALLOC_DEFAULTS``) through glibc's
    ``mallopt``; return whether they were set. Nothing happens off Linux, without glibc, or when
    ``environment`` (``os.environ`` by default) holds a malloc setting: glibc has read that one
    at start. Calling it again changes nothing."""
    if not sys.platform.startswith("linux") or malloc_chosen(os.environ if environment is None else environment):
        return False
    import ctypes  # only here: the launcher imports this module for its table and needs no ctypes

    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    # gnu_get_libc_version is glibc's own: musl has a mallopt that does nothing.
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # The mmap threshold first: setting it also fixes it (glibc stops adapting it), as the variable does.
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
