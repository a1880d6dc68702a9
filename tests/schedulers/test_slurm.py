"""ddpkit under a real Slurm cluster (one node, from Debian's packages), started the ways users start
jobs: srun, sbatch with and without srun, salloc, `srun bash -c`, `ddpkit run` inside each, and a
task killed with SIGKILL. The cases are issue 15's, each numbered as there."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from job_processes import job_marker, processes_of_job

from .clusters import EXAMPLE, REPOSITORY, SlurmCluster, trained_as_one_world_of

TRAIN = ["python", str(EXAMPLE), "--epochs", "1", "--samples", "512"]
SBATCH_EXAMPLE = REPOSITORY / "examples" / "slurm" / "train.sbatch"
SBATCH_LAUNCHER_EXAMPLE = REPOSITORY / "examples" / "slurm" / "train-launcher.sbatch"


@pytest.mark.parametrize(
    "command",
    [
        ["srun", "-N1", "--ntasks-per-node=2", *TRAIN],
        # Case 1: the job is named after the command (`bash`), which detection once skipped.
        ["srun", "-N1", "--ntasks-per-node=2", "bash", "-c", " ".join(TRAIN)],
        # Case 1: srun inside an allocation named `interactive`, as salloc's shell is.
        ["salloc", "-J", "interactive", "-N1", "--ntasks-per-node=2", "srun", *TRAIN],
        # Case 6: --ntasks without --ntasks-per-node, evenly placed on the one node.
        ["srun", "--ntasks=2", *TRAIN],
        # A launcher per node: ddpkit run starts the node's processes itself.
        ["srun", "-n1", "python", "-m", "ddpkit", "run", "--nproc-per-node", "2", *TRAIN[1:]],
        # ddpkit run in every srun task starts nothing of its own: srun's tasks are the ranks.
        ["srun", "-N1", "--ntasks-per-node=2", "python", "-m", "ddpkit", "run", *TRAIN[1:]],
        # salloc runs its command outside any step, as its shell would: ddpkit run starts its workers.
        ["salloc", "-N1", "--ntasks-per-node=2", "python", "-m", "ddpkit", "run", "--nproc-per-node", "2", *TRAIN[1:]],
    ],
    ids=["srun", "srun-bash-c", "salloc-interactive", "srun-ntasks", "srun-one-launcher", "srun-launcher-per-task",
         "salloc-launcher"],
)
def test_srun_tasks_train_as_one_world(slurm: SlurmCluster, command: list[str]) -> None:
    result = slurm.run(command)
    assert result.returncode == 0, result.stderr[-3000:]
    trained_as_one_world_of(2, result.stdout + result.stderr)


def test_the_sbatch_examples_train_as_one_world(slurm: SlurmCluster) -> None:
    """The sbatch scripts of docs/launching.md: srun per process, and one `ddpkit run` per node."""
    for script in (SBATCH_EXAMPLE, SBATCH_LAUNCHER_EXAMPLE):
        job = slurm.batch(script, timeout=90)
        assert (job.state, job.exit_code) == ("COMPLETED", 0), f"{script.name}: {job.state}\n{job.output}"
        trained_as_one_world_of(2, job.output)


def test_a_batch_script_without_srun_trains_once_and_says_why_not_on_every_task(slurm: SlurmCluster, tmp_path: Path) -> None:
    """Case 2 (once a silent hang: the one process waited for rank 1 of SLURM_NTASKS=2) and case 3
    (`ddpkit run` in the batch step once started nothing and hung): without srun, python trains
    alone and says how to use every task; `ddpkit run` starts its workers itself."""
    alone = tmp_path / "alone.sbatch"
    alone.write_text("#!/bin/bash\n" + " ".join(TRAIN) + "\n")
    job = slurm.batch(alone, ["-N1", "--ntasks-per-node=2"], timeout=60)
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job.output
    trained_as_one_world_of(1, job.output)
    assert "because srun did not start it" in job.output and "srun python" in job.output, job.output

    launcher = tmp_path / "launcher.sbatch"
    launcher.write_text("#!/bin/bash\npython -m ddpkit run --nproc-per-node 2 " + " ".join(TRAIN[1:]) + "\n")
    job = slurm.batch(launcher, ["-N1", "--ntasks-per-node=2"], timeout=60)
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job.output
    trained_as_one_world_of(2, job.output)
    assert "started this process" not in job.output, job.output


@pytest.mark.parametrize("rank", [1, 0], ids=["rank1", "rank0-the-store-host"])
def test_a_task_killed_with_sigkill_ends_the_job_in_seconds_naming_it(slurm: SlurmCluster, rank: int) -> None:
    """A task SIGKILLed (as the out-of-memory killer does) ends the step within seconds with
    nothing left. Case 7: when it is rank 0, the store's host, the survivor names rank 0 and the
    cause in one message, without torch's store warning and its C++ frames."""
    marker = job_marker()
    started = time.monotonic()
    killed = SlurmCluster(slurm.folder, {**slurm.environment, **marker}).run(
        ["srun", "-N1", "--ntasks-per-node=2", "python", str(EXAMPLE), "--epochs", "20", "--samples", "512",
         "--no-check-reference", "--kill-at-step", "3", "--kill-rank", str(rank)], timeout=60)
    took = time.monotonic() - started
    assert killed.returncode != 0, killed.stdout[-2000:]
    assert "samples/s over" not in killed.stdout, "the job went on after the kill"
    assert took < 20, f"the step took {took:.1f} s to end after a task was killed:\n{killed.stderr[-3000:]}"
    time.sleep(0.5)
    assert processes_of_job(marker) == [], "processes of the job outlived it"
    if rank == 0:
        assert re.search(r"rank 0, the host of the process group's store .* is gone", killed.stderr), killed.stderr[-3000:]
        assert "frame #" not in killed.stderr, killed.stderr[-5000:]
