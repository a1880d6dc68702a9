"""In-script launching: `python train.py` with DDPStrategy(parallel_devices=[cpu, cpu]) starts its own
local rank 1 by running the same command again; failures on either side end the job."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_gone, worker_pids
from torch import nn

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from torch import nn
    import ddpkit

    mode = sys.argv[1]
    strategy = ddpkit.DDPStrategy(parallel_devices=[torch.device("cpu")] * 2)
    strategy.setup_environment()
    rank = strategy.global_rank
    folder = os.path.dirname(os.path.abspath(__file__))
    open(os.path.join(folder, f"pid{rank}"), "w").write(str(os.getpid()))
    torch.manual_seed(rank)  # different initial weights: the DDP module must give everyone rank 0's
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = strategy.setup(model, optimizer)
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        optimizer.zero_grad()
        strategy.backward(model(x).pow(2).mean())
        optimizer.step()
        if mode == "child-raises" and rank == 1:
            raise ValueError("local rank 1 broke on purpose")
        if mode == "parent-raises" and rank == 0:
            raise ValueError("local rank 0 broke on purpose")
    names = ["MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
             "DDPKIT_LAUNCHED"]
    result = {"argv": sys.argv, "env": {name: os.environ.get(name) for name in names}, "threads": torch.get_num_threads(),
              "weight": model.module.weight.detach().clone(), "bias": model.module.bias.detach().clone()}
    torch.save(result, os.path.join(folder, f"result{rank}.pt"))
    strategy.teardown()
    """
)


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    (tmp_path / "train_here.py").write_text(SCRIPT)
    return tmp_path


def run(folder: Path, *command: str) -> subprocess.Popen[str]:
    environment = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}
    return subprocess.Popen([sys.executable, *command], cwd=folder, text=True, env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def reference_parameters() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.cat([torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank)) for rank in (0, 1)])
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    return model.weight.detach(), model.bias.detach()


@pytest.mark.parametrize("how", [["train_here.py", "ok"], ["-m", "train_here", "ok"]], ids=["script", "module"])
def test_running_the_script_directly_starts_the_other_local_rank(folder: Path, how: list[str]) -> None:
    process = run(folder, *how)
    out, err = process.communicate(timeout=90)
    assert process.returncode == 0, err
    results = [torch.load(folder / f"result{rank}.pt") for rank in (0, 1)]
    child = results[1]["env"]
    assert child["WORLD_SIZE"] == "2" and child["RANK"] == "1" and child["LOCAL_RANK"] == "1"
    assert child["LOCAL_WORLD_SIZE"] == "2" and child["NODE_RANK"] == "0" and child["DDPKIT_LAUNCHED"] == "1"
    assert child["MASTER_PORT"] == results[0]["env"]["MASTER_PORT"] and results[0]["env"]["RANK"] == "0"
    assert results[1]["argv"][1:] == ["ok"]  # the same command, arguments included
    share = max(1, len(os.sched_getaffinity(0)) // 2)  # the cores shared out, on both ranks, as under ddpkit run
    assert [result["threads"] for result in results] == [share, share] and "OMP_NUM_THREADS=" in err
    weight, bias = reference_parameters()
    for result in results:  # trained like one process on both ranks' batches
        torch.testing.assert_close(result["weight"], weight, rtol=0, atol=1e-6)
        torch.testing.assert_close(result["bias"], bias, rtol=0, atol=1e-6)


def test_a_failing_child_ends_the_job_naming_its_rank_and_cause(folder: Path) -> None:
    process = run(folder, "train_here.py", "child-raises")
    pids = worker_pids(folder, 2)
    started = time.monotonic()
    out, err = process.communicate(timeout=60)
    assert time.monotonic() - started < 10
    assert process.returncode != 0
    assert "ddpkit: rank 1 (local rank 1, pid" in err and "failed first with ValueError: local rank 1 broke on purpose" in err
    assert "ddpkit: ending the job." in err, err
    assert_gone(pids)


def test_a_failing_parent_takes_its_children_down(folder: Path) -> None:
    process = run(folder, "train_here.py", "parent-raises")
    pids = worker_pids(folder, 2)
    out, err = process.communicate(timeout=60)
    assert process.returncode != 0
    assert "ValueError: local rank 0 broke on purpose" in err
    assert_gone(pids)


def test_without_a_script_to_rerun_it_says_what_to_do_instead() -> None:
    code = "import torch, ddpkit; ddpkit.DDPStrategy(parallel_devices=[torch.device('cpu')] * 2).setup_environment()"
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert process.returncode != 0
    assert "no script to run" in process.stderr and "ddpkit.launch(fn, nprocs=N)" in process.stderr
