"""In-place recovery with the loops users write (issue 45): AdamW, a per-step warm-up schedule handed to
``setup``, a per-epoch sequential schedule made after ``setup`` and tracked, ``GradScaler("cpu")``, EMA
weights, synchronised batch norm, the loss all-reduced with ``torch.distributed`` inside the step, a
checkpoint every epoch (``tests/real_loop.py``). A rank killed with SIGKILL in each place a loss
strikes (forward, backward, the user's collective, the optimizer step, the schedule's step, the
checkpoint save), on one node and across nodes (a spare node, a shrink and a grow back): every rank
ends with the state of the run without the fault, model, optimizer and every tracked object. What
cannot be moved is refused before training, and replicas that differ after a recovery end the run
naming what differs. Real launchers and workers on Gloo."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from launchers import (
    EVERY_NODE_LAST_CALL,
    end_all,
    kill_node,
    node_of,
    start_launcher,
    start_store,
    start_together,
    text,
    wait_for,
)

from ddpkit.environments import find_free_port

LOOP = Path(__file__).resolve().parent / "real_loop.py"


def run_loop(folder: Path, nproc: int = 2, launcher: tuple[str, ...] = (), **variables: str) -> subprocess.CompletedProcess[str]:
    """``tests/real_loop.py`` under ``ddpkit run --recovery in-place`` on one node, in ``folder``;
    ``launcher``: more of ``ddpkit run``'s arguments (``--backend gloo``)."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "ddpkit", "run", "--recovery", "in-place", "--max-restarts", "1",
               "--nproc-per-node", str(nproc), *launcher, str(LOOP)]
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "DDPKIT_RECOVERY_TIMEOUT_SECONDS": "30", **variables})


def differences(expected: Any, got: Any, where: str = "") -> list[tuple[str, float]]:
    """(where, how far) for every leaf of two saved states: tensors by their largest difference,
    anything else 0 when equal and infinity when not."""
    if isinstance(expected, torch.Tensor):
        if expected.dtype.is_floating_point:
            return [(where, (expected.double() - got.double()).abs().max().item() if expected.numel() else 0.0)]
        return [(where, 0.0 if torch.equal(expected, got) else float("inf"))]
    if isinstance(expected, dict):
        if set(expected) != set(got):
            return [(f"{where} (keys {sorted(map(str, expected))} and {sorted(map(str, got))})", float("inf"))]
        return [found for key in expected for found in differences(expected[key], got[key], f"{where}.{key}")]
    if isinstance(expected, (list, tuple)):
        if len(expected) != len(got):
            return [(f"{where} (lengths)", float("inf"))]
        return [found for index, (a, b) in enumerate(zip(expected, got)) for found in differences(a, b, f"{where}[{index}]")]
    if isinstance(expected, float):
        return [(where, abs(expected - got))]
    return [(where, 0.0 if expected == got else float("inf"))]


def assert_as_without_the_fault(folder: Path, expected: dict[str, Any], ranks: int, errors: str,
                                tolerance: float = 1e-6) -> None:
    """Every rank's final state (``final<rank>.pt``: model, optimizer, tracked objects) is within
    ``tolerance`` of ``expected``, the run without the fault."""
    finals = sorted(folder.glob("final*.pt"))
    assert len(finals) == ranks, f"{[path.name for path in finals]}\n{errors}"
    for path in finals:
        state = torch.load(path, weights_only=False, map_location="cpu")  # a GPU run saved CUDA tensors
        found = differences({key: expected[key] for key in ("model", "optimizer", "tracked")},
                            {key: state[key] for key in ("model", "optimizer", "tracked")})
        worst = max(found, key=lambda pair: pair[1])
        assert worst[1] <= tolerance, f"{path.name}: {worst[0]} differs by {worst[1]:.3e}\n{errors}"


V = TypeVar("V")


class MadeOnFirstUse(dict[str, V]):
    """The runs of a module's tests by their features, each made by ``make`` when first read."""

    def __init__(self, make: Callable[[str], V]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, features: str) -> V:
        made = self[features] = self._make(features)
        return made


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The final state of the loop with every feature and no fault (two ranks; every rank's the same)."""
    folder = tmp_path_factory.mktemp("fault_free")
    result = run_loop(folder)
    assert result.returncode == 0, result.stderr[-3000:]
    expected: dict[str, Any] = torch.load(folder / "final0.pt", weights_only=False, map_location="cpu")
    assert_as_without_the_fault(folder, expected, 2, result.stderr[-2000:], tolerance=0.0)
    assert expected["tracked"]["scaler"]["scale"] > 2.0 ** 8  # the scale grew: its state matters
    assert expected["tracked"]["schedule"]["last_epoch"] == expected["steps"] == 24
    return expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("phase", "rank"), [
    # (the user's collective: test_a_rank_lost_while_the_other_is_in_a_synchronised_batch_norm_or_its_own_collective...)
    ("forward:5", "1"), ("backward:5", "1"), ("optimizer-step:5", "1"),
    ("scheduler-step:5", "1"), ("checkpoint-save:8", "1"), ("backward:11", "0")])
def test_a_rank_killed_anywhere_in_a_real_loop_is_replaced_and_every_rank_ends_as_without_the_fault(
        tmp_path: Path, fault_free: dict[str, Any], phase: str, rank: str) -> None:
    """The whole training state moves (the schedules' positions, the scaler's scale, the EMA weights,
    AdamW's moments), the survivor's collective of its own and its synchronised batch norm turn the
    loss into a recovery, and the run ends exactly as the one without the fault (0 difference)."""
    result = run_loop(tmp_path, KILL=phase, KILL_RANK=rank)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "recovered in place" in result.stderr and "restarting all" not in result.stderr, result.stderr[-4000:]
    assert_as_without_the_fault(tmp_path, fault_free, 2, result.stderr[-3000:], tolerance=0.0)


OVERLAPPED = "schedule,epoch-schedule,collective"  # what the mode takes without settling every step
TINY_BUCKETS = "0.0001"  # a bucket a parameter: with one bucket the mode would not defer the step


@pytest.fixture(scope="module")
def fault_free_synchronous(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """By features: the final state of the loop of the overlap tests, without the mode and without
    a fault (made on first use)."""

    def run(features: str) -> dict[str, Any]:
        folder = tmp_path_factory.mktemp("fault_free_synchronous")
        result = run_loop(folder, FEATURES=features, CLIP="0", BUCKET_CAP_MB=TINY_BUCKETS)
        assert result.returncode == 0, result.stderr[-3000:]
        expected: dict[str, Any] = torch.load(folder / "final0.pt", weights_only=False, map_location="cpu")
        assert expected["steps"] == 24
        return expected

    return MadeOnFirstUse(run)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("features", "phase", "rank"), [
    (OVERLAPPED, "", "1"), (OVERLAPPED, "forward:5", "1"), (f"{OVERLAPPED},syncbn", "forward:5", "1"),
    (OVERLAPPED, "optimizer-step:5", "1"), (OVERLAPPED, "scheduler-step:8", "1"), (OVERLAPPED, "backward:11", "0"),
    (f"{OVERLAPPED},ema", "scheduler-step:6", "1")])
def test_with_overlap_optimizer_a_rank_killed_is_replaced_and_every_rank_ends_as_the_synchronous_run_without_it(
        tmp_path: Path, fault_free_synchronous: dict[str, dict[str, Any]], features: str, phase: str,
        rank: str) -> None:
    """DDPStrategy(overlap_optimizer=True) under in-place recovery: a rank killed while the others
    apply the last step bucket by bucket in their forward (``forward:5``: the buckets in flight are
    applied, then the wait for the next one fails, or with ``syncbn`` the synchronised batch norm
    does), after the step is asked for (``optimizer-step``, and ``scheduler-step:8``: the epoch's
    last, applied at the epoch's end), or in backward; every rank ends bit for bit as the
    synchronous run without a fault: the half-applied step is undone (parameters, AdamW's moments,
    the learning rate, the schedules) and its batch trained again. With ``ema`` (updated after
    ``settle()``) the kill comes between the step asked for and its EMA update: the EMA, kept
    uncopied, is as it was."""
    variables = {"KILL": phase, "KILL_RANK": rank} if phase else {}
    result = run_loop(tmp_path, FEATURES=features, OVERLAP="1", BUCKET_CAP_MB=TINY_BUCKETS, **variables)
    assert result.returncode == 0, result.stderr[-4000:]
    assert ("recovered in place" in result.stderr) == bool(phase), result.stderr[-4000:]
    assert "restarting all" not in result.stderr, result.stderr[-4000:]
    assert_as_without_the_fault(tmp_path, fault_free_synchronous[features], 2, result.stderr[-3000:], tolerance=0.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("features", "phase"), [("syncbn", "forward:5"), ("collective", "collective:5")])
def test_a_rank_lost_while_the_other_is_in_a_synchronised_batch_norm_or_its_own_collective_is_replaced(
        tmp_path: Path, features: str, phase: str) -> None:
    """The issue's two findings on their own: the survivor's ``SyncBatchNorm`` all-gather, or its
    ``torch.distributed.all_reduce`` of the loss, fails when rank 1 dies; it used to end the job with
    Gloo's "Connection closed by peer" (spending the restart), and is now a recovery."""
    result = run_loop(tmp_path, FEATURES=features, KILL=phase)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "recovered in place" in result.stderr and "Connection" not in result.stderr.split("recovered in place")[-1]
    first, second = (torch.load(tmp_path / f"final{rank}.pt", weights_only=False) for rank in (0, 1))
    worst = max(differences(first, second), key=lambda pair: pair[1])
    assert worst[1] == 0.0, worst


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("feature", "collective"), [("epoch-collective", "a collective of its own"),
                                                     ("epoch-reduce", "a collective between steps")])
def test_a_rank_lost_in_a_collective_outside_the_step_restarts_every_worker_naming_the_loss_not_the_survivors_connection(
        tmp_path: Path, feature: str, collective: str) -> None:
    """A collective between epochs cannot be redone (the replacement starts at a step): the survivor
    fails while the killed rank's replacement starts, and its record, which the launcher names as
    the cause, says that a rank was lost and why this collective is not recovered. The script's own
    ``torch.distributed.all_reduce`` used to give the survivor's "RuntimeError: ... Connection closed
    by peer"; ``strategy.reduce`` (an epoch's metrics) a PeerLostError promising "in-place recovery
    replaces it" while the job ended. The replacement, cut short, gives back the restart it took:
    every worker is restarted (``--max-restarts 1``), as when the launcher sees the survivor's
    failure first, and the job ends 0; it used to end with "no restart left"."""
    result = run_loop(tmp_path, FEATURES=f"collective,{feature}", KILL=f"{feature}:8")
    assert result.returncode == 0, result.stderr[-3000:]
    causes = [line for line in result.stderr.splitlines() if line.startswith("ddpkit run: during the in-place")]
    assert causes, result.stderr[-3000:]
    assert re.match(r"ddpkit run: during the in-place recovery of rank 1: rank 0 \(local rank 0, pid \d+\) failed first "
                    r"with PeerLostError: a rank of the group vanished \(its collective failed on rank 0: ", causes[0])
    assert (f"while this rank was in {collective} that in-place recovery cannot redo: one outside "
            "`with strategy.step():` and outside `strategy.between_steps(function)`") in causes[0], causes[0]
    assert "replaces it" not in causes[0], causes[0]
    assert "the in-place recovery of rank 1 is given up" in result.stderr, result.stderr[-3000:]
    assert "restarting all 2 workers (restart 1 of 1)" in result.stderr, result.stderr[-3000:]


BLOCKS = "schedule,epoch-schedule,ema,syncbn,collective"  # what the block tests train with, besides the block


@pytest.fixture(scope="module")
def fault_free_blocks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """By features: the folder of the fault-free run of two ranks and two epochs with an evaluation
    block (made on first use: the rank's and the node's tests of one block compare with the same run)."""

    def run(features: str) -> Path:
        folder = tmp_path_factory.mktemp("fault_free_blocks")
        result = run_loop(folder, FEATURES=features, EPOCHS="2")
        assert result.returncode == 0, result.stderr[-3000:]
        return folder

    return MadeOnFirstUse(run)


def evaluations_of(folder: Path, rank: int) -> list[tuple[int, float]]:
    """(optimizer step, mean held-out loss) of each evaluation the process started as ``rank`` ran."""
    state = torch.load(folder / f"final{rank}.pt", weights_only=False, map_location="cpu")
    return [(step, mean) for step, mean, _ in state["evaluations"]]


def assert_same_evaluations(expected: list[tuple[int, float]], got: list[tuple[int, float]], errors: str) -> None:
    assert [step for step, _ in got] == [step for step, _ in expected], f"{got} against {expected}\n{errors}"
    for (step, mean), (_, reference) in zip(got, expected):
        assert mean == pytest.approx(reference, rel=1e-5), f"step {step}: {mean} against {reference}\n{errors}"


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("block", "strike"), [("epoch-block", "evaluation:8"), ("step-block", "evaluation:6"),
                                                 ("top-block", "evaluation:6")])
def test_a_rank_lost_in_an_evaluation_between_steps_is_replaced_and_every_rank_ends_as_without_the_fault(
        tmp_path: Path, fault_free_blocks: dict[str, Path], block: str, strike: str) -> None:
    """Issue 61, item 2: an evaluation between steps inside ``strategy.between_steps`` (after an
    epoch, after the step every 3 steps, at the top of the loop's body), rank 1 killed inside it just
    before the evaluation's own ``torch.distributed.all_reduce``. The survivor's collective fails;
    it runs the evaluation again from its start without the replacement, reading the lost rank's
    share of the held-out loader too, and the replacement joins at the next step boundary. Every
    rank ends with the state of the run without the fault, bit for bit, and the survivor's
    evaluations (each the mean over every rank's held-out rows) are that run's. Before, the job
    restarted every worker (or, without budget, ended)."""
    features = f"{BLOCKS},{block}"
    reference = fault_free_blocks[features]
    expected = torch.load(reference / "final0.pt", weights_only=False)
    result = run_loop(tmp_path, FEATURES=features, KILL=strike, KILL_RANK="1", EPOCHS="2")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "runs again from its start without rank(s) [1], which join at the next step boundary" in result.stderr, \
        result.stderr[-4000:]
    assert "restarting all" not in result.stderr, result.stderr[-4000:]
    assert_as_without_the_fault(tmp_path, expected, 2, result.stderr[-3000:], tolerance=0.0)
    assert_same_evaluations(evaluations_of(reference, 0), evaluations_of(tmp_path, 0), result.stderr[-2000:])


@pytest.mark.timeout(120)
def test_a_schedule_and_a_scaler_not_handed_over_are_refused_before_training_naming_them(tmp_path: Path) -> None:
    """A replacement would start them afresh: the ranks would diverge and the job exit 0 (the
    issue's LambdaLR ended 0.12 from the run without the fault). Refused at the first step."""
    result = run_loop(tmp_path, FEATURES="untracked-schedule,untracked-scaler", KILL="forward:5")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "UntrackedStateError: in-place recovery would leave state behind: a GradScaler (scale 256) is enabled; " \
           "a learning-rate schedule (LambdaLR) steps the optimizer" in result.stderr, result.stderr[-3000:]
    assert "strategy.setup(model, optimizer, scheduler=..., scaler=...)" in result.stderr
    assert not (tmp_path / "step1").exists()  # before the first step
    assert "recovered in place" not in result.stderr


@pytest.mark.timeout(120)
def test_state_that_nothing_marks_and_that_was_not_tracked_ends_the_run_at_the_first_step_after_the_recovery(
        tmp_path: Path) -> None:
    """A warm-up set by hand from a counter of the loop's own: the replacement's counter starts at 0,
    so its learning rate differs from the survivor's once the step after the recovery has run. The
    replica check compares the ranks there and raises on every rank, naming the optimizer's 'lr'."""
    result = run_loop(tmp_path, FEATURES="counted-warmup", KILL="forward:5")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "recovered in place" in result.stderr
    assert ("ReplicaMismatchError: the replicas differ at optimizer step 6, the first after the in-place recovery "
            "that formed generation 1 of the group: the optimizer's 'lr' of parameter group 0: ranks [0] hold one "
            "value, ranks [1] another") in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("ReplicaMismatchError: the replicas differ") >= 2  # raised on both ranks
    assert not (tmp_path / "step7").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("features", ["collective", "collective,syncbn"])
def test_survivors_blocked_in_their_own_collective_on_a_survivor_that_recovered_recover_too(
        tmp_path: Path, features: str) -> None:
    """Four ranks in ``torch.distributed.all_reduce`` of their own, rank 3 killed: only some survivors'
    calls fail at once; the others wait on them in Gloo, where ddpkit cannot interrupt them. The first
    to recover frees the group it leaves, which closes its connections, so theirs fail too and all
    recover (before: they waited until the recovery timeout and the job ended). With ``syncbn`` the
    step's graph, which the loop's ``loss`` keeps alive, holds ddpkit's synchronised batch norm's
    backward: it used to hold the group too, so that no survivor's connections closed."""
    result = run_loop(tmp_path, nproc=4, FEATURES=features, WORLD="4", KILL="collective:3", KILL_RANK="3")
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stderr.count("ddpkit: recovered in place") == 3, result.stderr[-4000:]
    finals = [torch.load(path, weights_only=False) for path in sorted(tmp_path.glob("final*.pt"))]
    assert len(finals) == 4
    for other in finals[1:]:
        worst = max(differences(finals[0]["model"], other["model"]), key=lambda pair: pair[1])
        assert worst[1] == 0.0, worst


def start_nodes(folder: Path, port: int, nnodes: str, count: int, **variables: str) -> list[subprocess.Popen[bytes]]:
    """``count`` launchers of one rank each running ``tests/real_loop.py`` as a job of ``nnodes`` nodes."""
    shutil.copy(LOOP, folder / "job.py")
    return start_together(folder, port, nnodes, count, nproc_per_node=1, **variables)


@pytest.mark.timeout(240)
def test_a_node_lost_in_the_users_collective_is_taken_over_by_a_spare_node_and_every_rank_ends_as_without_it(
        tmp_path: Path, fault_free: dict[str, Any]) -> None:
    """Two nodes of one rank and a spare node: node 1 stopped in the loss's all-reduce of its own and
    killed; the survivor's ``torch.distributed.all_reduce`` fails, the spare node's rank takes the
    state, and the run ends as the one without the fault."""
    store = start_store(port := find_free_port())
    job = {"rdzv_id": "real-spare", "PAUSE": "collective:5", "KILL_RANK": "1"}
    try:
        launchers = start_nodes(tmp_path, port, "2:3", 2, **job)
        wait_for(lambda: (tmp_path / "paused").exists(), "node 1's rank to stop in its all-reduce")
        spare = start_launcher(tmp_path, port, "launcher2", "2:3", nproc_per_node=1, **job)
        wait_for(lambda: "waits as a spare node" in text(tmp_path, "launcher2.err"), "the spare node to wait")
        lost = node_of(tmp_path, 1)
        kill_node(launchers[lost])
        codes = end_all([launchers[1 - lost], spare], timeout=150)
        errors = "\n".join(f"--- launcher{n}\n{text(tmp_path, f'launcher{n}.err')[-3000:]}" for n in range(3))
        assert codes == [0, 0], errors
        assert "node 1's launcher went silent; this spare node takes its place" in text(tmp_path, "launcher2.err")
        assert_as_without_the_fault(tmp_path, fault_free, 2, errors, tolerance=0.0)
    finally:
        store.kill()
        store.wait()


@pytest.mark.timeout(240)
def test_three_nodes_shrink_when_a_node_is_lost_in_the_users_collective_and_both_survivors_end_as_without_it(
        tmp_path: Path) -> None:
    """Three nodes of one rank, ``--nnodes 2:3``, no spare: node 2 stopped just before the loss's
    ``torch.distributed.all_reduce`` of its own and killed, while the other two wait in it. Only the
    survivor whose Gloo pair was node 2's fails at once; the other is freed when the first leaves
    the group. Both form the shrunk generation and train node 2's share between them, ending within
    1e-6 of the run of three ranks without the fault (before: the step's graph, kept by the loop's
    ``loss``, held the group through the synchronised batch norm, the second survivor waited in its
    all-reduce, and the first waited for it in vain until the recovery timeout ended the job)."""
    three = {"WORLD": "3", "EPOCHS": "2"}
    reference = tmp_path / "fault_free"
    result = run_loop(reference, nproc=3, **three)
    assert result.returncode == 0, result.stderr[-3000:]
    expected: dict[str, Any] = torch.load(reference / "final0.pt", weights_only=False)
    store = start_store(port := find_free_port())
    job = {"rdzv_id": "real-shrink-three", "PAUSE": "collective:5", "KILL_RANK": "2", **three}
    try:
        launchers = start_nodes(tmp_path, port, "2:3", 3, **job)
        wait_for(lambda: (tmp_path / "paused").exists(), "node 2's rank to stop before its all-reduce")
        lost = node_of(tmp_path, 2, launchers=3)
        kill_node(launchers[lost])
        survivors = [launcher for n, launcher in enumerate(launchers) if n != lost]
        codes = end_all(survivors, timeout=150)
        errors = "\n".join(f"--- launcher{n}\n{text(tmp_path, f'launcher{n}.err')[-3000:]}" for n in range(3))
        assert codes == [0, 0], errors
        for n in range(3):
            if n != lost:
                assert "recovered in place: generation 1" in text(tmp_path, f"launcher{n}.err"), errors
        assert_as_without_the_fault(tmp_path, expected, 2, errors)
    finally:
        store.kill()
        store.wait()


@pytest.mark.timeout(300)
def test_the_world_shrinks_when_a_node_is_lost_in_a_synchronised_batch_norm_and_grows_back_as_without_the_fault(
        tmp_path: Path, fault_free: dict[str, Any]) -> None:
    """Two nodes of one rank, ``--nnodes 1:2``: node 1 stopped in the backward (the others wait in its
    synchronised batch norm's all-reduce, ddpkit's own) and killed. The survivor trains both shares
    alone, and, held after step 10, a launcher started later joins: the world grows back at a step
    boundary, the joiner receives the whole training state, and both end within 1e-6 of the run
    without the fault (one rank on both shares rounds a little differently)."""
    store = start_store(port := find_free_port())
    job = {"rdzv_id": "real-shrink", "PAUSE": "backward:5", "KILL_RANK": "1", "HOLD_AT": "10", "STEP_SECONDS": "0.05"}
    try:
        launchers = start_nodes(tmp_path, port, "1:2", 2, **job)
        wait_for(lambda: (tmp_path / "paused").exists(), "node 1's rank to stop in its backward")
        lost = node_of(tmp_path, 1)
        kill_node(launchers[lost])
        killed = time.monotonic()
        wait_for(lambda: (tmp_path / "step10").exists(), "the shrunk world to train up to step 10", timeout=90)
        print(f"node 1 killed in the backward: step 10 reached {time.monotonic() - killed:.2f} s later, alone")
        joiner = start_launcher(tmp_path, port, "launcher2", "1:2", nproc_per_node=1, **job)
        wait_for(lambda: "joins the world again" in text(tmp_path, "launcher2.err"), "the joiner's request")
        (tmp_path / "go-on").touch()
        codes = end_all([launchers[1 - lost], joiner], timeout=150)
        errors = "\n".join(f"--- launcher{n}\n{text(tmp_path, f'launcher{n}.err')[-3000:]}" for n in range(3))
        assert codes == [0, 0], errors
        survivor = text(tmp_path, f"launcher{1 - lost}.err")
        assert "no spare node took its place: the world shrank to 1 ranks" in survivor, errors
        assert "grew in place" in survivor, errors
        assert_as_without_the_fault(tmp_path, fault_free, 2, errors)
    finally:
        store.kill()
        store.wait()


@pytest.mark.timeout(240)
def test_across_network_namespaces_a_node_lost_in_the_users_collective_shrinks_the_world_as_without_it(
        two_namespaces: list[tuple[str, str]], tmp_path: Path, fault_free: dict[str, Any]) -> None:
    """The same loop on two nodes in network namespaces joined by a veth (Gloo over a real interface,
    the store in node 0's namespace), ``--nnodes 1:2``: node 1 stopped in its own all-reduce of the
    loss and killed; node 0's ``torch.distributed.all_reduce`` fails over the veth, it trains both
    shares, and ends within 1e-6 of the run without the fault."""
    (namespace0, address0), (namespace1, _) = two_namespaces
    store = start_store(port := find_free_port(), namespace0, address0)
    shutil.copy(LOOP, tmp_path / "job.py")
    job = {"rdzv_id": "real-netns", "PAUSE": "collective:5", "KILL_RANK": "1"}
    try:
        # Both at once: the rendezvous waits for both (MAX) before it closes.
        launchers = [start_launcher(tmp_path, port, f"launcher{n}", "1:2", namespace, address0, nproc_per_node=1,
                                    last_call=EVERY_NODE_LAST_CALL, **job)
                     for n, namespace in enumerate((namespace0, namespace1))]
        wait_for(lambda: (tmp_path / "paused").exists(), "node 1's rank to stop in its all-reduce")
        lost = node_of(tmp_path, 1)
        kill_node(launchers[lost])
        code = end_all([launchers[1 - lost]], timeout=150)[0]
        errors = "\n".join(f"--- launcher{n}\n{text(tmp_path, f'launcher{n}.err')[-3000:]}" for n in range(2))
        assert code == 0, errors
        assert "no spare node took its place: the world shrank to 1 ranks" in text(tmp_path, f"launcher{1 - lost}.err")
        assert_as_without_the_fault(tmp_path, fault_free, 1, errors)
    finally:
        store.kill()
        store.wait()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("block", "strike"), [("epoch-block", "evaluation:8"), ("top-block", "evaluation:6")])
def test_a_node_lost_in_an_evaluation_between_steps_shrinks_the_world_and_the_evaluation_runs_again(
        tmp_path: Path, fault_free_blocks: dict[str, Path], block: str, strike: str) -> None:
    """Two nodes of one rank, ``--nnodes 1:2``, no spare: node 1 stopped inside an evaluation block
    (after an epoch, or at the top of the loop's body) before its all-reduce, and killed. The survivor
    runs the evaluation again alone over both shares of the held-out rows, then trains both shares:
    its evaluations are those of the run without the fault, and it ends within 1e-6 of it. At the
    top of the body the batch in hand was read with the survivor's own share only: it is read again
    with both before its step trains it (a step on it would leave node 1's rows out)."""
    features = f"{BLOCKS},{block}"
    reference = fault_free_blocks[features]
    expected = torch.load(reference / "final0.pt", weights_only=False)
    store = start_store(port := find_free_port())
    job = {"rdzv_id": f"real-{block}", "FEATURES": features, "PAUSE": strike, "KILL_RANK": "1", "EPOCHS": "2"}
    try:
        launchers = start_nodes(tmp_path, port, "1:2", 2, **job)
        wait_for(lambda: (tmp_path / "paused").exists(), "node 1's rank to stop inside the evaluation")
        lost = node_of(tmp_path, 1)
        kill_node(launchers[lost])
        code = end_all([launchers[1 - lost]], timeout=150)[0]
        errors = "\n".join(f"--- launcher{n}\n{text(tmp_path, f'launcher{n}.err')[-3000:]}" for n in range(2))
        assert code == 0, errors
        assert "no spare node took its place: the world shrank to 1 ranks" in text(tmp_path, f"launcher{1 - lost}.err")
        assert_as_without_the_fault(tmp_path, expected, 1, errors)
        assert_same_evaluations(evaluations_of(reference, 0), evaluations_of(tmp_path, 0), errors)
    finally:
        store.kill()
        store.wait()



def test_survivors_that_met_the_loss_in_different_places_end_the_job_naming_each_place() -> None:
    """A survivor that had finished a block between steps (the lost rank completed its last
    collective for it) meets the loss in its next collective, while another is still in the block:
    the block cannot be run again by one of them only. Every rank raises, naming each survivor's place."""
    from ddpkit.training.resumable_loop import BlockPlace
    from ddpkit.training.state_transfer import Places

    evaluation = BlockPlace("evaluate", 0, 1, 16)
    Places([False, False, True], [16, 16, -1], [evaluation, evaluation, None]).check_same_block()  # the same: fine
    with pytest.raises(RuntimeError, match=re.escape(
            "the surviving ranks met the loss in different places (rank 0: the block between steps 'evaluate' "
            "(after optimizer step 16, in epoch 1), rank 1: not in a block)")):
        Places([False, False, True], [16, 16, -1], [evaluation, None, None]).check_same_block()
