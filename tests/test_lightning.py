"""Lightning's Trainer with ``strategy=ddpkit.lightning.DDPStrategy()`` (issue 50): real Trainers on CPU,
two ranks under ``ddpkit run`` on Gloo, compared with one process trained on the concatenated
batches (``tests/lightning_job.py``: batch norm synchronised, AdamW with a per-step schedule,
gradient accumulation and clipping, metrics logged with ``sync_dist``, ``ModelCheckpoint``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("lightning", reason="Lightning is in the test extra: pip install -e '.[test]'")

from launchers import end_all, kill_node, node_of, start_launcher, start_store, start_together, text, wait_for  # noqa: E402
from lightning.fabric.plugins.environments import TorchElasticEnvironment  # noqa: E402

from ddpkit.environments import LocalEnvironment, find_free_port  # noqa: E402
from ddpkit.lightning import DdpkitEnvironment, DDPStrategy  # noqa: E402
from ddpkit.lightning.overlap import the_one_optimizer  # noqa: E402

JOB = Path(__file__).resolve().parent / "lightning_job.py"
QUIET = {"PYTHONWARNINGS": "ignore"}


def run_job(folder: Path, strategy: str, nproc: int = 2, launcher: tuple[str, ...] = (),
            **variables: str) -> subprocess.CompletedProcess[str]:
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(JOB), str(folder), strategy] if strategy == "reference" else [
        sys.executable, "-m", "ddpkit", "run", *launcher, "--nproc-per-node", str(nproc), str(JOB), str(folder), strategy]
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=150,
                          env={**os.environ, **QUIET, **variables})


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    folder = tmp_path_factory.mktemp("reference")
    result = run_job(folder, "reference")
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(folder / "final.pt")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["ddpkit", "plugin"])
def test_a_trainer_with_ddpkits_strategy_ends_as_one_process_on_the_concatenated_batches(
        tmp_path: Path, strategy: str, one_process: dict[str, torch.Tensor]) -> None:
    """``plugin``: the seeds' ``DDPPlugin`` with its Lightning 1.4 arguments, only the import changed."""
    result = run_job(tmp_path, strategy)
    assert result.returncode == 0, result.stderr[-4000:]
    hook = "allreduce_hook" if strategy == "plugin" else "None"  # registered on CPU too (Lightning: CUDA only)
    for rank in (0, 1):
        assert (f"rank {rank} of 2: done with ddpkit.lightning.strategy.DDPStrategy, the model in "
                f"ddpkit.parallel.ddp.DistributedDataParallel with comm hook {hook}, 7 steps timed") in result.stdout, \
            result.stdout  # 8 optimizer steps, each timed from the end of the one before
    trained = torch.load(tmp_path / "final.pt")
    assert sorted(trained) == sorted(one_process)
    largest = max((trained[name].double() - one_process[name].double()).abs().max().item() for name in one_process)
    assert largest < 1e-6, largest
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()  # ModelCheckpoint saved through the strategy


@pytest.mark.timeout(200)
def test_overlap_optimizer_in_a_trainer_defers_its_steps_and_ends_bit_for_bit_as_without_it(tmp_path: Path) -> None:
    """``DDPStrategy(overlap_optimizer=True)`` under Lightning's automatic optimization (the step
    given a closure that runs the forward and backward), with accumulation, SyncBatchNorm, a
    per-step schedule and ``sync_dist`` logging; no clipping, so the steps after the first three
    are deferred to the next forward (still deferred at the end of their batch)."""
    synchronous = run_job(tmp_path / "synchronous", "ddpkit", CLIP="0", CHECKPOINT_EVERY="3")
    overlapped = run_job(tmp_path / "overlapped", "overlap", CLIP="0", CHECKPOINT_EVERY="3")
    assert synchronous.returncode == 0 and overlapped.returncode == 0, synchronous.stderr[-3000:] + overlapped.stderr[-3000:]
    for rank in (0, 1):
        # 5 of 8 (the first three are synchronous); step 6's checkpoint, saved before the module's
        # on_train_batch_end looks, applied it
        assert f"rank {rank} of 2: done" in overlapped.stdout and "7 steps timed, 4 steps deferred" in overlapped.stdout, \
            overlapped.stdout
    expected, trained = (torch.load(tmp_path / run / "final.pt") for run in ("synchronous", "overlapped"))
    assert sorted(trained) == sorted(expected)
    assert all(torch.equal(trained[name], expected[name]) for name in expected)
    # ModelCheckpoint saves the LightningModule (inside the wrapper), at step 6 right after a deferred
    # step: with that step applied
    files = sorted(path.name for path in (tmp_path / "overlapped" / "every").iterdir())
    assert files == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"], files
    for name in files:
        saved, wanted = (torch.load(tmp_path / run / "every" / name, weights_only=False)["state_dict"]
                         for run in ("overlapped", "synchronous"))
        assert sorted(saved) == sorted(wanted) and all(torch.equal(saved[key], wanted[key]) for key in wanted)


@pytest.mark.timeout(200)
def test_overlap_optimizer_under_manual_optimization_defers_the_users_steps_and_ends_bit_for_bit(
        tmp_path: Path) -> None:
    """Lightning's manual optimization: ``training_step`` calls ``manual_backward``, the optimizer's
    step, ``zero_grad`` and the schedule's step itself, inside the wrapper's forward; the steps after
    the first three are deferred to the next forward, and the run ends as the synchronous one. A layer
    no forward reaches has its step applied before the next backward (else that backward is refused)."""
    runs = {name: run_job(tmp_path / name, name, MANUAL="1", UNUSED="1", CHECKPOINTS="0") for name in ("ddpkit", "overlap")}
    assert all(run.returncode == 0 for run in runs.values()), runs["ddpkit"].stderr[-3000:] + runs["overlap"].stderr[-3000:]
    # 16 steps, the first three synchronous: every later one still deferred at its batch's end
    assert runs["overlap"].stdout.count("15 steps timed, 13 steps deferred") == 2, runs["overlap"].stdout
    expected, trained = (torch.load(tmp_path / name / "final.pt") for name in ("ddpkit", "overlap"))
    assert sorted(trained) == sorted(expected)
    assert all(torch.equal(trained[name], expected[name]) for name in expected)
    sums = {name: re.findall(r"weights summing to (\S+) at on_train_end", run.stdout) for name, run in runs.items()}
    assert sums["overlap"] == sums["ddpkit"], sums


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("where", "named"), [("module", "LoggingGradientNorms.on_before_optimizer_step"),
                                              ("callback", "GradientNormsCallback.on_after_backward")])
def test_overlap_optimizer_awaits_the_gradients_for_a_hook_that_may_read_them_and_ends_bit_for_bit(
        tmp_path: Path, where: str, named: str) -> None:
    """A gradient norm logged in the module's ``on_before_optimizer_step`` (Lightning's docs' recipe)
    or read in a callback's ``on_after_backward``: the strategy awaits the gradients after each
    backward, saying for which hook, so the hook reads the averaged gradients (the same norms as
    without the mode) and the steps are exact, not deferred."""
    runs = {name: run_job(tmp_path / name, name, GRAD_NORM=where, CLIP="0", CHECKPOINTS="0")
            for name in ("ddpkit", "overlap")}
    assert all(run.returncode == 0 for run in runs.values()), runs["ddpkit"].stderr[-3000:] + runs["overlap"].stderr[-3000:]
    assert f"the gradients are awaited after each backward for {named}, which may read them" in runs["overlap"].stderr
    assert runs["overlap"].stdout.count("7 steps timed, 0 steps deferred") == 2, runs["overlap"].stdout
    # Each rank prints its own (under gradient accumulation a micro-batch's gradients are its rank's
    # own), in whichever order the ranks reach their output: compared as a set.
    summed = r"(\d+) gradient norms summing to (\d+\.\d+(?:e[+-]\d+)?)"  # (a rank's line may run into the other's)
    norms = {name: sorted(re.findall(summed, run.stdout)) for name, run in runs.items()}
    assert len(norms["overlap"]) == 2 and norms["overlap"] == norms["ddpkit"], norms
    expected, trained = (torch.load(tmp_path / name / "final.pt") for name in ("ddpkit", "overlap"))
    assert all(torch.equal(trained[name], expected[name]) for name in expected)


@pytest.mark.timeout(200)
def test_the_fits_last_deferred_step_is_applied_before_the_modules_on_train_end_reads_the_weights(
        tmp_path: Path) -> None:
    """No validation and no checkpoint, whose forward and state_dict would apply it: the strategy
    applies the last step before any on_train_end (the module's reads a weight)."""
    runs = {name: run_job(tmp_path / name, name, CLIP="0", VALIDATE="0", CHECKPOINTS="0") for name in ("ddpkit", "overlap")}
    assert all(run.returncode == 0 for run in runs.values()), runs["overlap"].stderr[-3000:]
    sums = {name: re.findall(r"weights summing to (\S+) at on_train_end", run.stdout) for name, run in runs.items()}
    assert len(sums["overlap"]) == 2 and sums["overlap"] == sums["ddpkit"], sums


@pytest.mark.timeout(200)
def test_overlap_optimizer_in_a_trainer_that_clips_waits_for_the_gradients_and_ends_as_one_process(
        tmp_path: Path, one_process: dict[str, torch.Tensor]) -> None:
    """``Trainer(gradient_clip_val=0.5)``: Lightning's clip reads every gradient after the backward,
    so the strategy awaits them there and the steps are not deferred, and exact."""
    result = run_job(tmp_path, "overlap")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "7 steps timed, 0 steps deferred" in result.stdout, result.stdout
    trained = torch.load(tmp_path / "final.pt")
    largest = max((trained[name].double() - one_process[name].double()).abs().max().item() for name in one_process)
    assert largest < 1e-6, largest


def test_overlap_optimizer_is_refused_with_what_it_cannot_take() -> None:
    with pytest.raises(TypeError, match="takes True or False, got str"):
        DDPStrategy(overlap_optimizer="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="drop use_torch_ddp=True"):
        DDPStrategy(overlap_optimizer=True, use_torch_ddp=True)
    two = [torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1) for _ in range(2)]  # manual optimization's
    with pytest.raises(ValueError, match="configure_optimizers returned 2. Return one optimizer"):
        the_one_optimizer(two)


@pytest.mark.timeout(200)
def test_run_directly_lightning_starts_the_ranks_which_connect_through_ddpkit_with_a_job_secret(
        tmp_path: Path, one_process: dict[str, torch.Tensor]) -> None:
    """``python lightning_job.py`` with ``devices=2`` and no launcher: Lightning starts rank 1 itself; the
    ranks connect at the port the strategy chose, with the secret it gave them, and train as one process."""
    tmp_path.mkdir(exist_ok=True)
    result = subprocess.run([sys.executable, str(JOB), str(tmp_path), "ddpkit"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=150, env={key: value for key, value in {**os.environ, **QUIET}.items()
                                                         if not key.startswith("DDPKIT_JOB_SECRET")})
    assert result.returncode == 0, result.stderr[-4000:]
    assert "this job has no secret" not in result.stderr, result.stderr[-3000:]
    assert "rank 1 of 2: done with ddpkit.lightning.strategy.DDPStrategy" in result.stdout, result.stdout
    trained = torch.load(tmp_path / "final.pt")
    largest = max((trained[name].double() - one_process[name].double()).abs().max().item() for name in one_process)
    assert largest < 1e-6, largest


@pytest.mark.timeout(120)
def test_a_rank_raising_in_training_step_is_named_on_every_rank_and_the_job_ends_in_seconds(tmp_path: Path) -> None:
    """Rank 1 raises in ``training_step``: rank 0, waiting for it in a collective (the synchronised batch
    norm's here), raises ``PeerFailedError`` naming rank 1 and its exception, and ``ddpkit run`` names
    rank 1 as the first failure; nothing waits for the group's timeout."""
    started = time.monotonic()
    result = run_job(tmp_path, "ddpkit", FAIL_AT="1:3")
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert "PeerFailedError: rank 1 failed: ValueError: boom in training_step at batch 3" in result.stderr, \
        result.stderr[-4000:]
    assert "ddpkit run: rank 1 (local rank 1, pid " in result.stderr
    assert ") failed first with ValueError: boom in training_step at batch 3" in result.stderr
    assert elapsed < 60, elapsed  # two Trainers start, and end within seconds of the failure


@pytest.mark.timeout(200)
def test_sigterm_to_ddpkit_run_stops_every_rank_after_one_step_and_the_resumed_fit_ends_as_one_process(
        tmp_path: Path, one_process: dict[str, torch.Tensor]) -> None:
    """Rank 0 sends SIGTERM to ``ddpkit run`` at batch 2 of the first epoch: every rank stops after the
    same optimizer step (an accumulated one: two batches), ``last.ckpt`` is saved there, ``ddpkit run``
    exits 75; ``trainer.fit(..., ckpt_path="last")`` goes on from the next batch of that epoch (not
    from the epoch's first, as Lightning does with a plain loader) and ends as one process."""
    preempted = run_job(tmp_path, "ddpkit", PREEMPT_AT="2")
    assert preempted.returncode == 75, preempted.stderr[-4000:]
    stopped = re.search(r"ddpkit: preempted: every rank stopped after step (\d+) \(epoch (\d+), batch (\d+)\)",
                        preempted.stderr)
    assert stopped is not None, preempted.stderr[-4000:]
    step, epoch, batch = map(int, stopped.groups())
    assert batch % 2 == 1 and step == (epoch * 8 + batch + 1) // 2 and (epoch, batch) != (1, 7), stopped.group(0)
    assert not (tmp_path / "final.pt").exists()
    resumed = run_job(tmp_path, "ddpkit", RESUME="1")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "not resumable" not in resumed.stderr
    trained = torch.load(tmp_path / "final.pt")
    largest = max((trained[name].double() - one_process[name].double()).abs().max().item() for name in one_process)
    assert largest < 1e-6, (largest, stopped.group(0))


def test_a_trainer_whose_world_is_not_the_launchers_is_refused_naming_both() -> None:
    launched = LocalEnvironment({"DDPKIT_LAUNCHED": "1", "WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1",
                                 "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    environment = DdpkitEnvironment(launched)
    assert environment.creates_processes_externally and environment.world_size() == 4
    environment.validate_settings(num_devices=2, num_nodes=2)
    with pytest.raises(ValueError, match=r"Trainer\(devices=2, num_nodes=1\) makes a world of 2 processes, but "
                                         r"LocalEnvironment started 4 \(WORLD_SIZE\)\. Give the Trainer"):
        environment.validate_settings(num_devices=2, num_nodes=1)


def test_the_strategy_takes_ddpkits_environment_unless_given_lightnings() -> None:
    assert isinstance(DDPStrategy().cluster_environment, DdpkitEnvironment)
    lightnings = TorchElasticEnvironment()
    assert DDPStrategy(cluster_environment=lightnings).cluster_environment is lightnings
    assert DDPStrategy(num_nodes=3).num_nodes == 3  # the seeds' DDPPlugin argument


def test_a_number_of_nodes_the_trainer_does_not_have_is_refused_naming_both() -> None:
    """Lightning 2 sets the strategy's nodes from ``Trainer(num_nodes=...)``: the seeds' argument is checked."""
    strategy = DDPStrategy(num_nodes=2, parallel_devices=[torch.device("cpu")])
    strategy.num_nodes = 1  # what Trainer(num_nodes=1), the default, does to it
    with pytest.raises(ValueError, match=r"DDPStrategy\(num_nodes=2\) but Trainer\(num_nodes=1\).*Pass "
                                         r"Trainer\(num_nodes=2\)"):
        strategy.setup_distributed()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("rank", "batch", "phase", "own"), [(0, 5, "backward", ""), (1, 4, "forward", "1"),
                                                          (1, 7, "batch_end", ""), (1, 1, "validation", "")])
def test_a_rank_killed_inside_trainer_fit_is_replaced_in_place_and_the_fit_ends_as_one_process(
        tmp_path: Path, one_process: dict[str, torch.Tensor], rank: int, batch: int, phase: str, own: str) -> None:
    """Batches 4 and 5 are one window of ``accumulate_grad_batches=2``. Killed in batch 5's forward:
    the survivor loses it in the synchronised batch norm inside ``optimizer_step`` and trains batch 4
    again; in batch 4's backward: outside ``optimizer_step``, in the batch norm's backward; in batch
    5's backward: in the gradients' all-reduce, with rank 0 (the one that saves) replaced; in batch
    4's forward with a collective of the user's own first: Gloo's error in the user's call; after the
    epoch's last step: the survivor loses it between steps (the DDP module's buffer broadcast in
    validation; its metrics and the epoch's checkpoint then its own) and recovers at the next
    epoch's first step; in validation: the same."""
    result = run_job(tmp_path, "ddpkit", launcher=("--recovery", "in-place", "--max-restarts", "1"),
                     KILL_AT=f"{rank}:{batch}:{phase}", OWN_COLLECTIVE=own)
    assert result.returncode == 0, result.stderr[-4000:]
    assert re.search(rf"rank {rank} \(local rank {rank}, pid \d+\) was killed by signal SIGKILL; the spare", result.stderr), \
        result.stderr[-4000:]
    assert "recovered in place" in result.stderr and "restarting all" not in result.stderr, result.stderr[-4000:]
    assert ("a collective of the step's own code failed" in result.stderr) == bool(own), result.stderr[-4000:]
    for survivor in (0, 1):
        assert f"rank {survivor} of 2: done with ddpkit.lightning.strategy.DDPStrategy" in result.stdout, result.stdout
    trained = torch.load(tmp_path / "final.pt")
    largest = max((trained[name].double() - one_process[name].double()).abs().max().item() for name in one_process)
    assert largest < 1e-6, largest


@pytest.mark.timeout(240)
def test_a_rank_lost_in_validation_inside_trainer_fit_runs_the_validation_again_and_its_loss_is_the_fault_frees(
        tmp_path: Path, one_process: dict[str, torch.Tensor]) -> None:
    """Issue 61, item 2, inside ``Trainer.fit``: rank 1 killed in the first epoch's validation, in
    ``validation_step`` before its ``self.log(..., sync_dist=True)``. The survivor's collective fails;
    it runs Lightning's validation loop again from its start without the replacement, over every
    rank's rows (its loader set up again for a world of one), and the replacement joins at the next
    epoch's first training step. The epoch's logged validation loss is the run's without the fault
    (it used to be the survivor's own rows from the lost batch on), and the fit ends as one process."""
    fault_free = run_job(tmp_path / "fault_free", "ddpkit", SANITY="0")
    assert fault_free.returncode == 0, fault_free.stderr[-4000:]
    expected = torch.load(tmp_path / "fault_free" / "validation0.pt")
    result = run_job(tmp_path, "ddpkit", launcher=("--recovery", "in-place", "--max-restarts", "1"),
                     KILL_AT="1:1:validation", SANITY="0")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "validation loop runs again from its start without rank(s) [1]" in result.stderr, result.stderr[-4000:]
    assert "joined generation 1 of the group at the training step after validation" in result.stderr
    got = torch.load(tmp_path / "validation0.pt")
    assert [epoch for epoch, _ in got] == [epoch for epoch, _ in expected] == [0, 1], (got, expected)
    for (epoch, loss), (_, reference) in zip(got, expected):
        assert loss == pytest.approx(reference, rel=1e-5), (epoch, loss, reference)
    trained = torch.load(tmp_path / "final.pt")
    largest = max((trained[name].double() - one_process[name].double()).abs().max().item() for name in one_process)
    assert largest < 1e-6, largest


@pytest.mark.timeout(240)
def test_a_replacement_draws_the_random_numbers_the_lost_rank_would_have_drawn(tmp_path: Path) -> None:
    """With dropout the run equals no single process: it must equal the same job without the fault,
    which it does only when the replacement's random state is the lost rank's at the batch it starts
    at: mid-epoch (killed in batch 5, batch 4 trained again), and at the first batch of an epoch."""
    fault_free = run_job(tmp_path / "fault_free", "ddpkit", DROPOUT="1")
    assert fault_free.returncode == 0, fault_free.stderr[-4000:]
    expected = torch.load(tmp_path / "fault_free" / "final.pt")
    for where in ("5:backward:0", "0:forward:1"):
        folder = tmp_path / where.replace(":", "_")
        result = run_job(folder, "ddpkit", launcher=("--recovery", "in-place", "--max-restarts", "1"),
                         KILL_AT=f"1:{where}", DROPOUT="1")
        assert result.returncode == 0 and "recovered in place" in result.stderr, result.stderr[-4000:]
        trained = torch.load(folder / "final.pt")
        largest = max((trained[name].double() - expected[name].double()).abs().max().item() for name in expected)
        assert largest < 1e-6, (where, largest)


@pytest.mark.timeout(240)
def test_a_rank_lost_after_the_last_step_leaves_the_job_ending_with_zero(
        tmp_path: Path, one_process: dict[str, torch.Tensor]) -> None:
    """No training step is left to recover at. Without validation the survivors finish, and the
    replacement, waiting for a generation that will not form, is told that nothing is left to train;
    with it, the loss lands in the last validation, which the survivors run again without the
    replacement, waiting outside, which is then told the same."""
    result = run_job(tmp_path, "ddpkit", launcher=("--recovery", "in-place", "--max-restarts", "1"),
                     KILL_AT="1:7:batch_end:1", VALIDATE="0")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "the training ended before generation 1 of the group formed" in result.stderr, result.stderr[-4000:]
    validated = run_job(tmp_path / "validated", "ddpkit", launcher=("--recovery", "in-place", "--max-restarts", "1"),
                        KILL_AT="1:7:batch_end:1")
    assert validated.returncode == 0, validated.stderr[-4000:]
    assert "validation loop runs again from its start without rank(s) [1]" in validated.stderr
    assert "the training ended while this rank (1) waited to join the others" in validated.stderr, validated.stderr[-4000:]
    trained = torch.load(tmp_path / "final.pt")
    largest = max((trained[name].double() - one_process[name].double()).abs().max().item() for name in one_process)
    assert largest < 1e-6, largest


@pytest.mark.timeout(240)
def test_a_rank_lost_in_the_users_own_collective_between_steps_restarts_every_worker_which_resume(
        tmp_path: Path, one_process: dict[str, torch.Tensor]) -> None:
    """What in place does not cover: a ``torch.distributed`` call of the user's own outside the
    step (``on_train_epoch_end``, at the end of the second epoch; no validation, which would take
    the loss first and run again). The survivor ends, the launcher restarts every worker, and the
    fit resumes from the first epoch's checkpoint. Whichever the launcher sees first, the killed
    rank (a replacement starts, then is given up with the budget it took) or the survivor's failure:
    the replacement first used to spend the one restart, and the job ended (CI, now and then)."""
    result = run_job(tmp_path, "ddpkit", launcher=("--recovery", "in-place", "--max-restarts", "1"),
                     KILL_AT="1:7:batch_end:1", OWN_COLLECTIVE_AT_EPOCH_END="1", RESUME="1", VALIDATE="0")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "restarting all 2 workers" in result.stderr and "Restored all states" in result.stderr, result.stderr[-4000:]
    trained = torch.load(tmp_path / "final.pt")
    largest = max((trained[name].double() - one_process[name].double()).abs().max().item() for name in one_process)
    assert largest < 1e-6, largest


# The script each node's launcher runs (tests/launchers.py starts ``job.py`` in the test's folder).
NODE_JOB = (f"import os, runpy, sys\nimport lightning.pytorch\n"
            f"sys.argv = [{str(JOB)!r}, os.getcwd(), 'ddpkit']\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")


def start_two_nodes(folder: Path, port: int, nnodes: str, **variables: str) -> list[subprocess.Popen[bytes]]:
    """Two launchers of one rank each that form the job (``Trainer(devices=1, num_nodes=2)``)."""
    (folder / "job.py").write_text(NODE_JOB)
    job = {"rdzv_id": "lightning-nodes", "nproc_per_node": 1, **QUIET, **variables}
    launchers = start_together(folder, port, nnodes, 2, **job)
    wait_for(lambda: all("complete: this is node" in text(folder, f"launcher{n}.err") for n in range(2)),
             "the rendezvous to close with two nodes")
    return launchers


@pytest.mark.timeout(300)
def test_a_spare_node_takes_over_a_node_lost_inside_trainer_fit_and_the_fit_ends_as_one_process(
        tmp_path: Path, one_process: dict[str, torch.Tensor]) -> None:
    """Two nodes of one rank and a spare node (``--nnodes 2:3 --recovery in-place``): node 1 is
    killed, its launcher with its rank, while the rank is in batch 5's forward (the other waits in
    the synchronised batch norm); the spare node's warm spare takes rank 1, receives the Trainer's
    state from rank 0, which kept its process, and the fit ends as one process."""
    store = start_store(port := find_free_port())
    try:
        first = start_two_nodes(tmp_path, port, "2:3", PAUSE_AT="1:5")
        spare = start_launcher(tmp_path, port, "launcher2", "2:3", rdzv_id="lightning-nodes", nproc_per_node=1,
                               **QUIET, PAUSE_AT="1:5")
        wait_for(lambda: "waits as a spare node" in text(tmp_path, "launcher2.err"), "the spare node to wait")
        wait_for(lambda: (tmp_path / "paused").exists(), "rank 1 to stop in batch 5", timeout=120)
        node1 = node_of(tmp_path, 1)
        kill_node(first[node1])
        codes = end_all([first[1 - node1], spare], timeout=150)
        errors = "\n".join(f"--- launcher{n}\n{text(tmp_path, f'launcher{n}.err')[-4000:]}" for n in range(3))
        assert codes == [0, 0], errors
        assert "node 1's launcher went silent; this spare node takes its place" in text(tmp_path, "launcher2.err"), errors
        assert "recovered in place" in text(tmp_path, f"launcher{1 - node1}.err"), errors
        out = text(tmp_path, f"launcher{1 - node1}.out") + text(tmp_path, "launcher2.out")
        for rank in (0, 1):
            assert f"rank {rank} of 2: done with ddpkit.lightning.strategy.DDPStrategy" in out, out
    finally:
        store.kill()
        store.wait()
    trained = torch.load(tmp_path / "final.pt")
    largest = max((trained[name].double() - one_process[name].double()).abs().max().item() for name in one_process)
    assert largest < 1e-6, largest


@pytest.mark.timeout(300)
def test_a_world_that_may_shrink_is_refused_before_trainer_fit_trains_saying_why_and_what_to_do(tmp_path: Path) -> None:
    """``--nnodes 1:2`` with two nodes: a lost node would shrink the world, which Lightning's sampler
    cannot follow (it would deal a lost rank's shares to nobody), so the job is refused before its
    first batch, naming the world, its MIN and the two ways that work, not in the middle of a recovery."""
    store = start_store(port := find_free_port())
    try:
        codes = end_all(start_two_nodes(tmp_path, port, "1:2", PAUSE_AT="0:0"), timeout=90)
    finally:
        store.kill()
        store.wait()
    err = text(tmp_path, "launcher0.err") + text(tmp_path, "launcher1.err")
    assert codes == [1, 1], err[-4000:]
    assert "--nnodes 1:MAX --recovery in-place started a world of 2 nodes, which shrinks to 1 when a node is lost" \
        in err and "Start the job with --nnodes 2:3 and a spare node" in err, err[-4000:]
    assert not (tmp_path / "paused").exists(), "a batch was trained before the refusal"


@pytest.mark.parametrize(("imports", "expected"), [("import lightning.pytorch as pl", "warm"),
                                                 ("from pytorch_lightning import Trainer", "warm"),
                                                 ("import torch", "cold")])
def test_the_warm_spare_of_a_script_that_imports_lightning_has_imported_it_before_the_script_runs(
        tmp_path: Path, imports: str, expected: str) -> None:
    """Importing Lightning takes longer than the rest of a replacement's way back into the step."""
    script = tmp_path / "train.py"
    script.write_text(f"import sys\nprint('warm' if 'lightning.pytorch' in sys.modules else 'cold')\n"
                      f"if False:\n    {imports}\n")
    spare = subprocess.run([sys.executable, "-m", "ddpkit.workers.worker", "--spare", str(script)], input="{}\n",
                           capture_output=True, text=True, timeout=120)
    assert spare.returncode == 0, spare.stderr[-3000:]
    assert spare.stdout.strip() == expected


def test_in_place_recovery_inside_trainer_fit_refuses_what_it_cannot_carry_before_connecting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"DDPKIT_LAUNCHED": "1", "DDPKIT_RECOVERY": "in-place", "WORLD_SIZE": "2", "RANK": "0",
                        "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    strategy = DDPStrategy(parallel_devices=[torch.device("cpu")] * 2, use_torch_ddp=True)
    with pytest.raises(ValueError, match="cannot recover a rank inside Trainer.fit with use_torch_ddp=True"):
        strategy.setup_distributed()
    strategy = DDPStrategy(parallel_devices=[torch.device("cpu")] * 2, ddp_comm_state=object())
    with pytest.raises(ValueError, match="a comm hook's state"):
        strategy.setup_distributed()
    strategy = DDPStrategy(parallel_devices=[torch.device("cpu")] * 2, overlap_optimizer=True)
    with pytest.raises(ValueError, match="overlap_optimizer=True: the Trainer's recovery cannot undo"):
        strategy.setup_distributed()
