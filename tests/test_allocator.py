"""glibc's malloc thresholds (ddpkit._allocator): a process that ddpkit did not start gets them when
it builds a DistributedDataParallel, so its steps stop page-faulting freed gradients back in."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from ddpkit._allocator import keep_freed_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc thresholds are Linux's")

# One process (a world of 1, as a script started by hand), an 8 x 1024 MLP: the page faults of a
# training step, after a few steps to warm up, printed as "faults <per step>".
STEPS = textwrap.dedent("""
    import resource, tempfile, torch, torch.distributed as dist
    from torch import nn
    import ddpkit
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp()), rank=0, world_size=1)
    model = ddpkit.DistributedDataParallel(nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 1024), torch.randn(64, 1024)
    def step():
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        # what else a training step allocates and frees: a batch, a metric, a copy for logging
        torch.randn(256, 1024).sum().item()
    for _ in range(10):  # the heap grows over the first steps, then stays
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print("faults", (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
    dist.destroy_process_group()
""")


def faults_per_step(extra: dict[str, str]) -> float:
    environment = {name: value for name, value in os.environ.items() if not name.startswith("MALLOC_")}
    result = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, timeout=120,
                            env={**environment, **extra})
    assert result.returncode == 0, result.stderr[-3000:]
    return float(result.stdout.split("faults")[1])


def test_a_process_that_builds_ddp_stops_faulting_its_memory_back_in() -> None:
    ours = faults_per_step({})
    # glibc's own defaults, set explicitly (any malloc setting keeps ddpkit's thresholds off):
    # thousands of faults a step, a 4 MiB gradient alone being 1024 pages.
    glibcs = faults_per_step({"MALLOC_TOP_PAD_": str(128 * 1024)})
    assert ours < glibcs / 5, f"{ours:.0f} page faults per step, {glibcs:.0f} with glibc's defaults"


def test_a_malloc_setting_of_the_users_is_left_alone() -> None:
    assert keep_freed_memory({"MALLOC_ARENA_MAX": "2"}) is True  # not a threshold: ddpkit still sets its own
    assert keep_freed_memory({"MALLOC_TRIM_THRESHOLD_": "1"}) is False
    assert keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}) is False
    # The user's own setting (glibc read it at start) is what the process keeps: here a tiny trim
    # threshold, which hands memory back at once, so the steps fault as with glibc's defaults.
    assert faults_per_step({"MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_MMAP_THRESHOLD_": "131072"}) > 1000
