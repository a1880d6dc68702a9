"""A rank killed with SIGKILL (issue 14, items 1, 2, 4 and 5), in both modes that survive it:
`ddpkit run --max-restarts N` starts every worker again and the example resumes from its last
checkpoint; `ddpkit run --recovery in-place` replaces the rank from a warm spare while the others
keep their processes. Either way the run ends with the parameters of a run without the fault.
Real launchers and workers on Gloo; the example (`examples/train.py --kill-at-step`) kills a rank
the way the out-of-memory killer does."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import example_summary, launcher_workers, waiting_spares
from launchers import text

import ddpkit

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.py"
TRAINING = ("--epochs", "2", "--samples", "1024")  # 8 steps per epoch on 2 ranks


def run_example(folder: Path, *args: str, nproc: int = 2, launcher: tuple[str, ...] = ("--recovery", "in-place",
                "--max-restarts", "1")) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ddpkit", "run", *launcher, "--nproc-per-node", str(nproc), str(EXAMPLE),
               *TRAINING, "--checkpoint", str(folder) + os.sep, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=240)


def final_parameters(folder: Path) -> list[torch.Tensor]:
    return list(torch.load(folder / "checkpoint.pt", weights_only=False)["model"].values())


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[torch.Tensor]]:
    """The final parameters of runs without a fault, by number of ranks (computed when first asked)."""

    class Lazy(dict[int, list[torch.Tensor]]):
        def __missing__(self, nproc: int) -> list[torch.Tensor]:
            folder = tmp_path_factory.mktemp(f"fault_free{nproc}")
            result = run_example(folder, nproc=nproc)
            assert result.returncode == 0, result.stderr[-3000:]
            self[nproc] = final_parameters(folder)
            return self[nproc]

    return Lazy()


def assert_same(parameters: list[torch.Tensor], expected: list[torch.Tensor], tolerance: float = 0.0) -> None:
    assert len(parameters) == len(expected)
    difference = max((a - b).abs().max().item() for a, b in zip(parameters, expected))
    assert difference <= tolerance, f"max difference to the fault-free run {difference:.3e}"


# The forward and the optimizer step of rank 1 are killed in tests/test_real_loops.py, in a real loop.
@pytest.mark.parametrize(("phase", "rank"), [("backward", 1), ("backward", 0)])
def test_a_killed_rank_is_replaced_in_place_and_the_run_ends_as_without_the_fault(
        tmp_path: Path, fault_free: dict[int, list[torch.Tensor]], phase: str, rank: int) -> None:
    result = run_example(tmp_path, "--kill-at-step", "5", "--kill-during", phase, "--kill-rank", str(rank))
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(rf"rank {rank} \(local rank {rank}, pid \d+\) was killed by signal SIGKILL; the spare", result.stderr)
    assert "recovered in place" in result.stderr
    assert "restarting all" not in result.stderr  # no survivor process was started again
    assert example_summary(result.stdout)["identical"] and example_summary(result.stdout)["max_difference"] == 0.0
    assert_same(final_parameters(tmp_path), fault_free[2])


def test_a_spare_killed_before_the_loss_is_started_again_and_the_rank_is_still_replaced_in_place(tmp_path: Path) -> None:
    """The warm spare killed on its own (as the chaos soak does, or the out-of-memory killer): the
    launcher starts another, and a rank lost later is replaced in place, not by a restart of all."""
    command = [sys.executable, "-m", "ddpkit", "run", "--recovery", "in-place", "--max-restarts", "1",
               "--nproc-per-node", "2", str(EXAMPLE), "--epochs", "2", "--samples", "16384", "--checkpoint",
               str(tmp_path) + os.sep, "--kill-at-step", "100"]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (spares := waiting_spares(launcher.pid)):
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.02)
        os.kill(spares[0], signal.SIGKILL)
        out, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    assert "the warm spare was killed by signal SIGKILL; a new one" in err, err[-3000:]
    assert "recovered in place" in err and "restarting all" not in err, err[-3000:]
    assert example_summary(out)["max_difference"] <= 1e-6


@pytest.mark.timeout(180)
def test_a_spare_killed_with_a_rank_in_one_moment_is_started_again_and_takes_the_rank_in_place(tmp_path: Path) -> None:
    """The out-of-memory killer's way: the warm spare and a training rank SIGKILLed together. The
    launcher sees both ends in one look: it starts another spare before it replaces the rank, which
    is then replaced in place, not by a restart of every worker."""
    command = [sys.executable, "-m", "ddpkit", "run", "--recovery", "in-place", "--max-restarts", "1",
               "--nproc-per-node", "2", str(EXAMPLE), "--epochs", "2", "--samples", "65536", "--checkpoint",
               str(tmp_path) + os.sep]
    with open(tmp_path / "launcher.out", "w") as out, open(tmp_path / "launcher.err", "w") as err:
        launcher = subprocess.Popen(command, stdout=out, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        # Both ranks train (their recovery is set up) and the spare waits.
        while not (re.search(r"epoch 1: +[1-9]\d?%", text(tmp_path, "launcher.err"))
                   and (spares := waiting_spares(launcher.pid))):
            assert time.monotonic() < deadline and launcher.poll() is None, text(tmp_path, "launcher.err")[-3000:]
            time.sleep(0.02)
        training = [pid for pid in launcher_workers(launcher.pid) if pid not in spares]
        assert len(spares) == 1 and len(training) == 2, (spares, training)
        # The rank first, the spare a moment after: the launcher sees the rank's end first, and the
        # spare's during the 0.1 s it waits for more losses before it replaces the rank.
        os.kill(training[1], signal.SIGKILL)
        time.sleep(0.02)
        os.kill(spares[0], signal.SIGKILL)
        launcher.wait(timeout=120)
    finally:
        launcher.kill()
    said = text(tmp_path, "launcher.err")
    assert launcher.returncode == 0, said[-3000:]
    assert "the warm spare was killed by signal SIGKILL; a new one" in said, said[-3000:]
    assert "recovered in place" in said and "restarting all" not in said, said[-3000:]
    assert example_summary(text(tmp_path, "launcher.out"))["max_difference"] <= 1e-6


def test_four_ranks_recover_in_place_and_end_as_without_the_fault(tmp_path: Path) -> None:
    # The reference is the example's own: one process trained on every step's global batch (a
    # fault-free run of four ranks ends the same, as the 2-rank tests show against theirs).
    result = run_example(tmp_path, "--kill-at-step", "3", "--kill-rank", "2", nproc=4)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "recovered in place" in result.stderr and "restarting all" not in result.stderr
    summary = example_summary(result.stdout)
    assert summary["world_size"] == 4 and summary["identical"], result.stdout[-2000:]
    assert summary["max_difference"] <= 1e-6


def test_ranks_killed_together_are_replaced_together_in_place(tmp_path: Path) -> None:
    # Two of three ranks die in the same backward (a node's processes, the out-of-memory killer):
    # the warm spare takes one, a new process the other, and rank 0 hands both the state.
    result = run_example(tmp_path, "--kill-at-step", "3", "--kill-rank", "1,2", nproc=3)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("takes over its rank in place (recovery 1 of 1") == 2, result.stderr[-3000:]
    assert "the replacements of rank 1, 2 hold the survivors' state" in result.stderr
    assert "restarting all" not in result.stderr
    summary = example_summary(result.stdout)
    assert summary["world_size"] == 3 and summary["identical"], result.stdout[-2000:]
    assert summary["max_difference"] <= 1e-6


@pytest.mark.parametrize(("step", "rank"), [("8", 1), ("16", 0)])
def test_a_rank_lost_during_a_checkpoint_save_between_epochs_is_replaced_in_place(
        tmp_path: Path, fault_free: dict[int, list[torch.Tensor]], step: str, rank: int) -> None:
    # Killed before its part of the save after epoch 1 (step 8), or rank 0 before it writes the
    # save after the last epoch (step 16): the survivor, waiting in the save's barrier, forms the
    # next generation with the replacement, which starts at the next epoch (or at the end); in
    # the second case the survivor writes the final checkpoint that rank 0 did not.
    result = run_example(tmp_path, "--kill-at-step", step, "--kill-during", "checkpoint-save", "--kill-rank", str(rank))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "recovered in place" in result.stderr and "restarting all" not in result.stderr, result.stderr[-3000:]
    if rank == 0:
        assert "rank 0 was lost during the save of" in result.stderr
    assert example_summary(result.stdout)["identical"] and example_summary(result.stdout)["max_difference"] == 0.0
    assert_same(final_parameters(tmp_path), fault_free[2])


# A restart resumes from the checkpoint wherever the rank was lost in the step: one phase of the step, and the save.
@pytest.mark.parametrize("phase", ["backward", "checkpoint-save"])
def test_a_killed_rank_restarts_every_worker_which_resume_and_end_as_without_the_fault(
        tmp_path: Path, fault_free: dict[int, list[torch.Tensor]], phase: str) -> None:
    # Step 12 is in the second epoch (8 steps each), so the restart resumes from the first epoch's checkpoint;
    # with checkpoint-save, rank 1 dies in the save after the first epoch (step 8), before rank 0's file is complete.
    step = "8" if phase == "checkpoint-save" else "12"
    result = run_example(tmp_path, "--kill-at-step", step, "--kill-during", phase, launcher=("--max-restarts", "1"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"rank 1 \(local rank 1, pid \d+\) was killed by signal SIGKILL", result.stderr), result.stderr[-3000:]
    assert "restarting all 2 workers (restart 1 of 1)" in result.stderr
    if phase != "checkpoint-save":
        assert (example_summary(result.stdout)["resumed"] or {}).get("epoch") == 1, result.stdout[-2000:]
    assert_same(final_parameters(tmp_path), fault_free[2], tolerance=1e-6)


# A small loop with the strategy's helpers; FAULT chooses what goes wrong.
SCRIPT = textwrap.dedent(
    """
    import os, signal, time
    import torch
    from torch import nn
    import ddpkit
    import ddpkit.training.recovery

    FAULT = os.environ["FAULT"]
    generation = int(os.environ.get("DDPKIT_GENERATION", "0"))
    rank = int(os.environ["RANK"])
    if FAULT == "replacement-dies" and generation > 0:
        os.kill(os.getpid(), signal.SIGKILL)
    if FAULT == "survivor-dies-in-transfer" and rank == 2:
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        ddpkit.training.recovery.InPlaceRecovery._send = die
    torch.manual_seed(0)
    strategy = ddpkit.DDPStrategy()
    model, optimizer = strategy.setup(nn.Linear(8, 1), torch.optim.SGD(nn.Linear(8, 1).parameters(), lr=0.1))
    print(f"rank {rank} of generation {generation} is set up", flush=True)
    data = [torch.randn(4, 8) for _ in range(40)]
    for epoch in strategy.epochs(1):
        for x in strategy.batches(data):
            with strategy.step():
                if rank == 1 and strategy.progress.batch == 5 and (generation == 0 or FAULT == "always"):
                    os.kill(os.getpid(), signal.SIGKILL)
                optimizer.zero_grad()
                strategy.backward(model(x).sum())
                optimizer.step()
                time.sleep(0.05)
    strategy.teardown()
    """
)


def run_script(folder: Path, fault: str, nproc: int = 2, *launcher: str,
               script: str = SCRIPT) -> tuple[subprocess.CompletedProcess[str], float]:
    (folder / "loop.py").write_text(script)
    command = [sys.executable, "-m", "ddpkit", "run", "--recovery", "in-place", "--max-restarts", "1", *launcher,
               "--nproc-per-node", str(nproc), "loop.py"]
    start = time.monotonic()
    result = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "FAULT": fault, "DDPKIT_RECOVERY_TIMEOUT_SECONDS": "20"})
    return result, time.monotonic() - start


HOOKED_SCRIPT = textwrap.dedent(
    """
    import os, signal
    import torch
    from torch import nn
    import ddpkit
    from ddpkit.hooks import fp16_compress_hook

    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(8) for layer in (nn.Linear(512, 512), nn.ReLU())])
    strategy = ddpkit.DDPStrategy(ddp_comm_hook=fp16_compress_hook)
    model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    batches = [torch.randn(16, 512, generator=torch.Generator().manual_seed(step)) for step in range(12)]
    for epoch in strategy.epochs(1):
        for x in strategy.batches(batches):
            with strategy.step():
                killed_here = os.environ["FAULT"] == "kill" and int(os.environ.get("DDPKIT_GENERATION", "0")) == 0
                if killed_here and strategy.global_rank == 1 and strategy.progress.batch == 5:
                    os.kill(os.getpid(), signal.SIGKILL)
                optimizer.zero_grad()
                strategy.backward(model(x).square().mean())
                optimizer.step()
    print(f"rank {strategy.global_rank} buckets {[len(bucket.parameters) for bucket in model._reducer.buckets]}",
          flush=True)
    if strategy.is_global_zero:
        torch.save([p.detach() for p in model.parameters()], "final.pt")
    strategy.teardown()
    """
)


def test_a_replacement_under_an_fp16_hook_builds_the_survivors_buckets_and_ends_as_without_the_fault(
        tmp_path: Path) -> None:
    """Registering ``fp16_compress_hook`` lays the buckets out again (ddpkit.parallel.buckets; here
    one 1 MiB layer each): the spare that takes the lost rank registers the hook and adopts the
    survivors' order, and must end with the same buckets, or their all-reduces would not match in size."""
    finals = {}
    for mode in ("none", "kill"):
        folder = tmp_path / mode
        folder.mkdir()
        result, _ = run_script(folder, mode, script=HOOKED_SCRIPT)
        assert result.returncode == 0, result.stderr[-3000:]
        assert ("recovered in place" in result.stderr) == (mode == "kill"), result.stderr[-3000:]
        assert sorted(re.findall(r"rank \d buckets \[[\d, ]+\]", result.stdout)) == [
            "rank 0 buckets [2, 2, 2, 2, 2, 2, 2, 2]", "rank 1 buckets [2, 2, 2, 2, 2, 2, 2, 2]"], result.stdout
        finals[mode] = torch.load(folder / "final.pt")
    assert_same(finals["kill"], finals["none"])


def test_a_spare_that_takes_a_rank_writes_as_that_rank(tmp_path: Path) -> None:
    """``--tee``: the spare's console lines carry the rank it took; its files are its own (spare0)."""
    result, _ = run_script(tmp_path, "once", 2, "--tee", "1", "--log-dir", "logs")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "recovered in place" in result.stderr
    assert "[rank1]: rank 1 of generation 0 is set up" in result.stdout
    assert "[rank1]: rank 1 of generation 1 is set up" in result.stdout, result.stdout
    attempt = tmp_path / "logs" / "node0" / "attempt_0"
    assert (attempt / "spare0" / "stdout.log").read_text() == "rank 1 of generation 1 is set up\n"
    assert (attempt / "1" / "stdout.log").read_text() == "rank 1 of generation 0 is set up\n"
    assert_no_process_is_left_behind(tmp_path)


def test_a_replacement_that_dies_during_the_recovery_ends_the_job_naming_it(tmp_path: Path) -> None:
    result, seconds = run_script(tmp_path, "replacement-dies")
    assert result.returncode == 1, result.stderr[-3000:]
    assert re.search(r"during the in-place recovery of rank 1: rank 1 \(local rank 1, pid \d+\) was killed by signal "
                     r"SIGKILL without recording an exception", result.stderr), result.stderr[-3000:]
    assert "no restart left" in result.stderr
    assert seconds < 30, f"the job took {seconds:.1f} s to end"
    assert_no_process_is_left_behind(tmp_path)  # the spares, the store host, the survivors


def test_a_second_rank_lost_during_the_state_transfer_ends_the_job(tmp_path: Path) -> None:
    result, seconds = run_script(tmp_path, "survivor-dies-in-transfer", 4)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "during the in-place recovery of rank 1" in result.stderr, result.stderr[-3000:]
    assert seconds < 40, f"the job took {seconds:.1f} s to end"


def test_when_the_budget_is_spent_the_next_loss_ends_the_job(tmp_path: Path) -> None:
    result, seconds = run_script(tmp_path, "always")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "recovery 1 of 1" in result.stderr
    assert len(re.findall(r"rank 1 \(local rank 1, pid \d+\) was killed by signal SIGKILL", result.stderr)) == 2
    assert seconds < 30, f"the job took {seconds:.1f} s to end"


def assert_no_process_is_left_behind(folder: Path) -> None:
    left = subprocess.run(["pgrep", "-f", "ddpkit.launching.(worker|store_host)"], capture_output=True, text=True)
    ours = [pid for pid in left.stdout.split() if str(folder) in _cwd(pid)]
    assert not ours, f"left behind: {ours}"


def _cwd(pid: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""


def test_in_place_recovery_needs_a_budget(tmp_path: Path) -> None:
    (tmp_path / "loop.py").write_text("print('ran')\n")
    result = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--recovery", "in-place", "--nproc-per-node", "2",
                             "loop.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--recovery in-place with --max-restarts=0" in result.stderr and "--max-restarts 1 or more" in result.stderr
    assert "ran" not in result.stdout


def test_the_strategy_refuses_in_place_recovery_without_the_launcher() -> None:
    with pytest.raises(ValueError, match="recovery='nonsense'"):
        ddpkit.DDPStrategy(recovery="nonsense")
    place = ddpkit.LocalEnvironment({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "29999"})
    strategy = ddpkit.DDPStrategy(recovery="in-place", cluster_environment=place)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=r"needs the launcher's part: start the job with `ddpkit run --recovery in-place"):
        strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))  # before connecting: nothing waits


def test_without_in_place_recovery_the_loop_helpers_are_range_and_the_loader() -> None:
    strategy = ddpkit.DDPStrategy()
    seen = []
    for epoch in strategy.epochs(3, start=1):
        for batch in strategy.batches(list(range(5)), skip=2 if epoch == 1 else 0):
            with strategy.step():
                seen.append((epoch, strategy.progress.batch, batch))
    assert seen == [(1, 2, 2), (1, 3, 3), (1, 4, 4)] + [(2, i, i) for i in range(5)]
    with pytest.raises(ddpkit.PeerLostError):  # nothing to recover with: the error goes on up
        with strategy.step():
            raise ddpkit.PeerLostError("a rank vanished")


def test_the_state_transfer_sends_tensors_as_bytes_and_rebuilds_the_state_exactly() -> None:
    # What a survivor sends a replacement: a model's state_dict (an OrderedDict carrying _metadata),
    # an optimizer's state, the RNG state; tensors of several dtypes, odd sizes, one not contiguous.
    from ddpkit.training.state_transfer import _pack, _packed_size, _put_tensors_back, _set_tensors_apart, _unpack

    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
             "odd": [torch.arange(3, dtype=torch.uint8), torch.ones(2, 3, dtype=torch.float64).t(), torch.tensor(True)],
             "resume": (1, 7)}
    tensors: list[torch.Tensor] = []
    skeleton = _set_tensors_apart(state, tensors)
    layout = [(t.shape, t.dtype, False) for t in tensors]
    flat = _pack(tensors, torch.device("cpu"))
    assert flat.dtype == torch.uint8 and flat.numel() == _packed_size(layout)
    assert len(skeleton) < 4096  # the data travels in the flat buffer, not in the pickle
    received = _put_tensors_back(skeleton, _unpack(flat.clone(), layout))

    assert received["resume"] == (1, 7)
    assert received["model"]._metadata == state["model"]._metadata  # load_state_dict reads its versions
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5))
    fresh.load_state_dict(received["model"])
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    again = torch.optim.Adam(fresh.parameters())
    again.load_state_dict(received["optimizer"])
    for index, slot in optimizer.state_dict()["state"].items():
        for key, value in slot.items():
            assert torch.equal(again.state_dict()["state"][index][key], value), (index, key)
    assert torch.equal(received["rng"], state["rng"])
    for sent, got in zip(state["odd"], received["odd"]):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    assert received["odd"][0].data_ptr() != flat.data_ptr()  # tensors of their own, not views of the buffer
