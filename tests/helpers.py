"""Helpers that several test modules share: models and data with their single-process reference,
a strategy on the pool's group, a failing model, bare ranks without a launcher, worker processes'
pids. (``job_processes`` finds the processes a job left behind.)"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.environments import LocalEnvironment, find_free_port
from ddpkit.training.strategy import DDPStrategy

BATCH_PER_RANK = 4


@contextlib.contextmanager
def ddpkit_messages() -> Iterator[list[str]]:
    """The messages ddpkit's logger (``ddpkit.logs``) writes meanwhile, from any thread, each once:
    kept by a handler of the test's own on the ``ddpkit`` logger, which does not propagate. (pytest's
    ``caplog`` with that logger made to propagate counted such a message twice under pytest 9.2 and
    once under 9.0.)"""
    messages: list[str] = []

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger, handler = logging.getLogger("ddpkit"), Kept()
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def global_batch(world_size: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    n = BATCH_PER_RANK * world_size
    return torch.randn(n, 6, generator=generator), torch.randn(n, 3, generator=generator)


def shard(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    return tensor[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]


def grads_of(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.clone() for name, p in module.named_parameters()}


def sgd_on_shards(model: nn.Module, module: nn.Module, world: int, rank: int | None, steps: int,
                  before_step: Callable[[int], None] | None = None, set_to_none: bool = True) -> list[torch.Tensor]:
    """SGD through ``model`` on this rank's shard of each global batch; rank None: the whole batch,
    the single-process reference. Returns ``module``'s parameters."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        x, y = global_batch(world, step)
        if rank is not None:
            x, y = shard(x, rank), shard(y, rank)
        optimizer.zero_grad(set_to_none=set_to_none)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in module.parameters()]


class Counting:
    """Counts the bytes that go through torch.distributed.all_reduce while active, and the calls."""

    def __init__(self) -> None:
        self.sent = 0
        self.calls = 0
        self._original = dist.all_reduce

    def __enter__(self) -> Counting:
        def counted(tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.sent += tensor.numel() * tensor.element_size()
            self.calls += 1
            return self._original(tensor, *args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._original


def strategy(**kwargs: object) -> DDPStrategy:
    """A strategy for the pool's process group (the pool connected the workers already)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    environment = LocalEnvironment({"WORLD_SIZE": str(size), "RANK": str(rank), "LOCAL_RANK": str(rank),
                                    "MASTER_PORT": "1"})
    result = DDPStrategy(cluster_environment=environment, **kwargs)  # type: ignore[arg-type]
    result.setup_environment()  # the existing group agrees: kept
    return result


class Flaky(nn.Module):
    """A model whose forward raises on one rank at one step, like a bad batch would."""

    def __init__(self, failing_rank: int, failing_step: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 2)
        self.failing_rank, self.failing_step, self.step = failing_rank, failing_step, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        if dist.get_rank() == self.failing_rank and self.step == self.failing_step:
            raise ValueError(f"rank {self.failing_rank} broke on purpose")
        return self.layer(x)


def start_bare_ranks(folder: Path, world_size: int, *args: str, **variables: str) -> list[subprocess.Popen[str]]:
    port = find_free_port()
    ranks = []
    for rank in range(world_size):
        env = {**os.environ, **variables, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
               "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "lives-on"}
        ranks.append(subprocess.Popen([sys.executable, "script.py", *args], cwd=folder, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return ranks


def wait_then_end_all(ranks: list[subprocess.Popen[str]],
                      waited_for: list[subprocess.Popen[str]]) -> list[tuple[str, float]]:
    """(stderr, wall-clock end) of each process of ``waited_for``, in order; then every rank is ended."""
    ended = []
    try:
        for process in waited_for:
            ended.append((process.communicate(timeout=60)[1], time.time()))
    finally:
        for process in ranks:
            process.kill()
            process.communicate()
    return ended


def worker_pids(folder: Path, count: int, timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [folder / f"pid{rank}" for rank in range(count)]
        if all(f.exists() and f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    raise AssertionError("workers did not start")


def assert_gone(pids: list[int], within: float = 3.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if _alive(pid)]
        if not alive:
            return
        time.sleep(0.05)
    raise AssertionError(f"processes still alive: {alive}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is gone for our purposes once it is not running
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:  # reaped between the two looks
        return False


def example_summary(output: str) -> dict[str, Any]:
    """The machine-readable last word of ``examples/train.py`` (its ``summary {...}`` line, rank 0's)."""
    lines = [line for line in output.splitlines() if line.split("]: ")[-1].startswith("summary {")]
    if not lines:
        raise AssertionError(f"no summary line in the example's output:\n{output[-3000:]}")
    summary: dict[str, Any] = json.loads(lines[-1].split("]: ")[-1][len("summary "):])
    return summary


def command_line(pid: int) -> str:
    """A process's command line, its arguments joined by spaces ("" once it has ended)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().decode("utf-8", "replace").replace("\0", " ")
    except OSError:
        return ""


def waiting_spares(launcher: int) -> list[int]:
    """The warm spares of a ``ddpkit run`` launcher (or a test) that wait for a rank: named ``ddpkit-spare``
    while they wait (forked from the node's template, a spare has the template's command line)."""
    found = []
    for pid in descendants(launcher):
        try:
            with open(f"/proc/{pid}/comm", "rb") as handle:
                if handle.read().strip() == b"ddpkit-spare":
                    found.append(pid)
        except OSError:
            continue
    return found


def parent_pid(pid: int) -> int | None:
    """A process's parent's pid (None once it has ended)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return int(handle.read().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> list[int]:
    """Every process started by ``pid``, by its children and so on (those alive now)."""
    found, frontier = [], [pid]
    pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    while frontier:
        children = [child for child in pids if parent_pid(child) in frontier]
        found += children
        frontier = children
    return found


def launcher_workers(launcher: int) -> list[int]:
    """The workers of a ``ddpkit run`` launcher: its descendants that run the worker bootstrap, less
    the node's template (the launcher's child that forks them; the forked workers keep its command line)."""
    return [pid for pid in descendants(launcher) if "ddpkit.workers.worker" in (command := command_line(pid))
            and not ("--template" in command and parent_pid(pid) == launcher)]
