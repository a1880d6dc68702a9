"""Processes as /proc shows them, for the benchmarks that start launchers and must find (and end,
or report) every process those started: ``descendants(pid)``, ``all_pids()``, ``read_proc(path)``,
``waits_for_its_input(pid)``.
Linux only."""

from __future__ import annotations

import os

__all__ = ["all_pids", "descendants", "read_proc", "waits_for_its_input"]


def read_proc(path: str) -> str:
    """A /proc file's text, or "" once the process is gone."""
    try:
        with open(path, "rb") as handle:
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""


def waits_for_its_input(pid: int) -> bool:
    """Whether the process is blocked reading its standard input (``read(0, ...)``): a warm spare
    of ``ddpkit run`` once it imported what the script needs (x86-64's and arm64's syscall numbers)."""
    return read_proc(f"/proc/{pid}/syscall").startswith(("0 0x0 ", "63 0x0 "))


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _parent(pid: int) -> int | None:
    stat = read_proc(f"/proc/{pid}/stat")
    return int(stat.rsplit(")", 1)[1].split()[1]) if stat else None


def descendants(pid: int) -> list[int]:
    """Every live process started by ``pid``, by its children and so on."""
    parents = {other: _parent(other) for other in all_pids()}
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found
