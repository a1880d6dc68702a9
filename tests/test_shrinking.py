"""A lost node without a spare: the world shrinks at the same global batch (issue 32, item 1).

`ddpkit run --nnodes 1:2 --rdzv-backend c10d --recovery in-place` on two launchers of two ranks,
the store outside the nodes (`ddpkit store`). Node 1's first rank stops at one point of a step
(forward, the gradients' all-reduce, the optimizer step, or a checkpoint save) and says so; the
test then kills node 1 (its launcher and workers, SIGKILL). Node 0's two ranks keep their
processes, form the next generation alone and train node 1's shares of each global batch too:
the run ends with the parameters of one process trained on the concatenated global batches.
Real launchers and workers on Gloo, loopback."""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launchers import (
    PHASE_JOB,
    assert_as_one_process,
    end_all,
    kill_node,
    node_of,
    start_launcher,
    start_store,
    start_together,
    text,
    wait_for,
)
from torch import nn
from torch.distributed import TCPStore
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddpkit.control_plane import heartbeats as heartbeats_module
from ddpkit.control_plane.nodes import NodeCoordination, Shrinking
from ddpkit.environments import find_free_port
from ddpkit.membership.generations import Layout
from ddpkit.membership.group import Group, Membership, set_current_group
from ddpkit.parallel.batchnorm import SyncBatchNorm
from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.store.client import BoundedStore, connect
from ddpkit.testing import WorkerPool
from ddpkit.training.data import EpochDataLoader, shard
from ddpkit.training.recovery import InPlaceRecovery
from ddpkit.training.resumable_loop import ResumableLoop


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("phase", "lost"), [("forward", 0), ("optimizer", 1), ("save", 0)])
def test_without_a_spare_node_the_world_shrinks_at_the_same_global_batch_and_ends_as_one_process(
        tmp_path: Path, phase: str, lost: int) -> None:
    """Node ``lost`` killed while its first rank is in ``phase``: the other node's ranks go on as
    ranks 0 and 1 of two (node 0's loss renumbers node 1's), and the run ends as one process. Node 0
    lost before its rank 0 wrote the checkpoint of step 5: the new rank 0 writes it. (Node 1 lost in
    the all-reduce: the test below.)"""
    (tmp_path / "job.py").write_text(PHASE_JOB)
    store = start_store(port := find_free_port())
    try:
        launchers = start_together(tmp_path, port, "1:2", 2, rdzv_id="shrink", PHASE=phase,
                                   PAUSED_RANK=str(2 * lost), GATES="7")
        wait_for(lambda: (tmp_path / "paused").exists(), f"node {lost}'s first rank to stop in {phase}")
        lost_launcher = node_of(tmp_path, lost)
        kill_node(launchers[lost_launcher])
        killed = time.monotonic()
        done = max(int(path.name[4:]) for path in tmp_path.glob("step*"))
        wait_for(lambda: (tmp_path / f"step{done + 1}").exists(), "the next step after the loss", timeout=60)
        print(f"node {lost} killed in {phase} after step {done}: step {done + 1} completed "
              f"{time.monotonic() - killed:.2f} s later")
        wait_for(lambda: (tmp_path / "step7").exists(), "step 7")  # held there: the save of step 10 comes later
        assert torch.load(tmp_path / "checkpoint.pt")["steps"] == 5  # written once, whoever was rank 0
        (tmp_path / "go-on7").touch()
        survivor = 1 - lost_launcher
        code = end_all([launchers[survivor]], timeout=120)[0]
        errors = "\n".join(f"--- launcher{n}\n{text(tmp_path, f'launcher{n}.err')[-4000:]}" for n in range(2))
        assert code == 0, errors
        err = text(tmp_path, f"launcher{survivor}.err")
        assert (f"node {lost}'s launcher went silent and no spare node took its place: the world shrank to 2 ranks"
                in err), errors
        out = text(tmp_path, f"launcher{survivor}.out")
        kept = [2 - 2 * lost, 3 - 2 * lost]  # the survivors' ranks as the launcher started them
        assert re.findall(r"rank (\d): rank (\d) of 2 done, recovered True", out) in (
            [(str(kept[0]), "0"), (str(kept[1]), "1")], [(str(kept[1]), "1"), (str(kept[0]), "0")]), out
        assert_as_one_process(tmp_path, errors)
    finally:
        store.kill()
        store.wait()


@pytest.mark.timeout(200)
def test_a_node_lost_while_the_ranks_form_the_first_generation_shrinks_the_world_instead_of_hanging(
        tmp_path: Path) -> None:
    """Node 1 killed as its ranks start: its first rank stops before it forms the group (so it never
    writes its address), and node 0's ranks wait for it inside torch's init_process_group. They
    used to wait there for the group's whole timeout after the launchers had shrunk the world (the
    chaos soak's shrink set-up hung); now the first generation is given up and they form the next
    one alone, training node 1's shares too, and the run ends as one process."""
    (tmp_path / "job.py").write_text(PHASE_JOB)
    store = start_store(port := find_free_port())
    try:
        launchers = start_together(tmp_path, port, "1:2", 2, rdzv_id="shrink-at-start",
                                   PHASE="connecting:0", PAUSED_RANK="2")
        wait_for(lambda: (tmp_path / "paused0").exists(), "node 1's first rank to stop before it connects")
        lost_launcher = node_of(tmp_path, 1)
        kill_node(launchers[lost_launcher])
        survivor = 1 - lost_launcher
        code = end_all([launchers[survivor]], timeout=120)[0]
        errors = "\n".join(f"--- launcher{n}\n{text(tmp_path, f'launcher{n}.err')[-4000:]}" for n in range(2))
        assert code == 0, errors
        err = text(tmp_path, f"launcher{survivor}.err")
        assert "the world shrank to 2 ranks" in err and "generation 0 of the group was given up while it formed" in err
        assert_as_one_process(tmp_path, errors)
    finally:
        store.kill()
        store.wait()


@pytest.mark.timeout(240)
def test_a_second_node_lost_while_the_world_shrinks_is_left_out_too_and_the_run_ends_as_one_process(
        tmp_path: Path) -> None:
    """Four nodes of one rank, ``--nnodes 2:4 --max-restarts 2``: node 2 killed while its rank is in the
    all-reduce, node 3 a second later, while the survivors' launchers are still taking node 2 for
    lost. The survivors' ranks wait for the first shrunk generation's members, are told node 3 was
    lost too, and form the one after without either: nodes 0 and 1 train every share, and the run
    ends as one process."""
    (tmp_path / "job.py").write_text(PHASE_JOB)
    store = start_store(port := find_free_port())
    job = {"rdzv_id": "two-lost", "max_restarts": 2, "nproc_per_node": 1, "PHASE": "allreduce", "PAUSED_RANK": "2"}
    try:
        launchers = start_together(tmp_path, port, "2:4", 4, **job)
        wait_for(lambda: (tmp_path / "paused").exists(), "node 2's rank to stop in the all-reduce")
        two, three = node_of(tmp_path, 2, 4), node_of(tmp_path, 3, 4)
        kill_node(launchers[two])
        killed = time.monotonic()
        time.sleep(1.0)
        kill_node(launchers[three])
        done = max(int(path.name[4:]) for path in tmp_path.glob("step*"))
        wait_for(lambda: (tmp_path / f"step{done + 1}").exists(), "the next step after the losses", timeout=60)
        print(f"nodes 2 and 3 killed in the all-reduce: the next step completed {time.monotonic() - killed:.2f} s "
              "after the first kill")
        survivors = [n for n in range(4) if n not in (two, three)]
        codes = end_all([launchers[n] for n in survivors], timeout=150)
        errors = "\n".join(f"--- launcher{n}\n{text(tmp_path, f'launcher{n}.err')[-4000:]}" for n in range(4))
        assert codes == [0, 0], errors
        err = "".join(text(tmp_path, f"launcher{n}.err") for n in survivors)  # each says the removal it made
        for lost in (2, 3):
            assert f"ddpkit run: node {lost}'s launcher went silent and no spare node took its place" in err, errors
        out = "".join(text(tmp_path, f"launcher{n}.out") for n in survivors)
        assert sorted(re.findall(r"rank (\d): rank \1 of 2 done, recovered True", out)) == ["0", "1"], out
        assert_as_one_process(tmp_path, errors)
    finally:
        store.kill()
        store.wait()


# -- what batch-dependent layers see -------------------------------------------------------------------
# The world of three ranks shrank to two: rank 0 trains the shares 0 and 2 of each global batch, rank 1
# the share 1 (a Membership as ddpkit.membership.group forms it). Each survivor's batch is its shares' rows together.
SHARES, SHARE_ROWS, SHRUNK_STEPS = [(0, 2), (1,)], 4, 4


def batchnorm_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(50 + step)
    rows = SHARE_ROWS * 3
    return torch.randn(rows, 8, generator=generator) * 2 + 1, torch.randn(rows, 2, generator=generator)


def rows_of(shares: tuple[int, ...]) -> list[int]:
    return [share * SHARE_ROWS + i for share in shares for i in range(SHARE_ROWS)]


def shrunk_run(synchronised: bool) -> list[torch.Tensor]:
    """In a pool of two ranks: DDP that follows the shrunk membership, each rank trained on its shares."""
    rank = dist.get_rank()
    # The group as Group.reconfigure forms it after the loss (the pool's connection has none of ddpkit's).
    set_current_group(Group(Membership(1, rank, 2, SHARES[rank], 3), "gloo", timedelta(seconds=60)))
    try:
        model = batchnorm_model()
        if synchronised:
            model = SyncBatchNorm.convert_sync_batchnorm(model)
        ddp = DistributedDataParallel(model)  # as a replacement's: it reads the group's membership
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for step in range(SHRUNK_STEPS):
            x, y = global_batch(step)
            mine = rows_of(SHARES[rank])
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
            optimizer.step()
    finally:
        set_current_group(None)
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def one_process(batches: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """One process: each step, one forward per group of shares in ``batches`` (BatchNorm's statistics
    over that group's rows), the gradients weighted by the rows each group holds."""
    model = batchnorm_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(SHRUNK_STEPS):
        x, y = global_batch(step)
        optimizer.zero_grad()
        sum(len(shares) / 3 * nn.functional.mse_loss(model(x[rows_of(shares)]), y[rows_of(shares)])
            for shares in batches).backward()  # type: ignore[union-attr]
        optimizer.step()
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.timeout(120)
def test_after_a_shrink_synchronised_batchnorm_is_exact_and_plain_batchnorm_normalises_each_survivors_batch(
        pool2: WorkerPool) -> None:
    """What the README says of batch-dependent layers in a shrunk world. SyncBatchNorm's statistics are
    over the whole global batch, wherever its rows are: parameters and running statistics equal one
    process on the concatenated batch. Plain BatchNorm's are over each forward's rows, and a survivor's
    forward holds its shares together: the result is that of one process normalising each survivor's
    rows, not each starting rank's (the run without the loss), from which it differs."""
    synchronised = pool2.run(shrunk_run, True, timeout=60)
    everything = one_process([(0, 1, 2)])
    for result in synchronised:
        assert largest_difference(result, everything) <= 1e-6
    plain = pool2.run(shrunk_run, False, timeout=60)
    parameters = len(list(batchnorm_model().parameters()))
    survivors, starting_ranks = one_process(SHARES), one_process([(0,), (1,), (2,)])
    for result in plain:
        assert largest_difference(result[:parameters], survivors[:parameters]) <= 1e-6
        assert largest_difference(result[:parameters], starting_ranks[:parameters]) > 1e-3


# -- the loop's side ---------------------------------------------------------------------------------------


def shrink_after_two_steps(loader: object) -> list[list[int]]:
    """The batches ``DDPStrategy.batches`` hands out when, after two optimizer steps, the world of four
    shrinks in the third and this rank (rank 0 of four) trains the shares 0 and 2 from then on."""
    loop = ResumableLoop()
    recovery = loop.recovery = InPlaceRecovery(loop.progress, loop.tracked)
    seen = []
    for number, batch in enumerate(loop.batches(loader)):  # type: ignore[arg-type]
        seen.append(batch[0].tolist())
        if number < 2:
            recovery._keep_the_commit()  # the optimizer stepped on it
        elif number == 2:  # the step's all-reduce failed: recover() formed the shrunk group
            if isinstance(loader, EpochDataLoader):
                loader.follow_membership(Membership(1, 0, 2, (0, 2), 4))
            recovery.position.rewind = recovery.position.reshard = True
        else:
            recovery._keep_the_commit()
    return seen


def test_after_a_shrink_the_loop_reads_the_new_shares_from_the_last_step_and_refuses_a_loader_ddpkit_did_not_shard(
) -> None:
    data = TensorDataset(torch.arange(32))
    seen = shrink_after_two_steps(shard(DataLoader(data, batch_size=2), num_replicas=4, rank=0))
    # Rank 0 of 4 reads the rows 0, 4, 8, ...; rank 2 the rows 2, 6, 10, ...: two rows each per step.
    assert seen == [[0, 4], [8, 12], [16, 20], [16, 20, 18, 22], [24, 28, 26, 30]]
    with pytest.raises(RuntimeError, match="was not sharded by DDPStrategy.setup_dataloader"):
        shrink_after_two_steps(DataLoader(data, batch_size=2))


def shuffled_order(epoch: int, shares: tuple[int, ...], world: int, rows: int, batch: int) -> list[list[int]]:
    """The batches of ``epoch`` that the ranks ``shares`` of ``world`` read together, step after step
    (``DistributedSampler`` shuffled for that epoch): the global batch of the run without a loss."""
    lists = []
    for share in shares:
        sampler = DistributedSampler(range(rows), num_replicas=world, rank=share, shuffle=True)
        sampler.set_epoch(epoch)
        lists.append(list(sampler))
    return [[i for order in lists for i in order[step * batch:(step + 1) * batch]]
            for step in range(len(lists[0]) // batch)]


@pytest.mark.parametrize("lost_in", ["the save between the epochs", "the first step of the next epoch"])
def test_a_shrink_at_an_epoch_boundary_reads_the_next_epochs_shuffle_with_the_new_shares(lost_in: str) -> None:
    """Rank 0 of two, data shuffled: the world shrinks before any batch of epoch 1 was committed (a
    rank lost in the save after epoch 0, or in epoch 1's first step). The loop must read epoch 1's
    shuffle, both shares of it, from batch 0: what the starting world would have read. (The loader
    counts its passes to know the next epoch; re-reading from batch 0 once took epoch 2's order.)"""
    data = TensorDataset(torch.arange(32))
    loader = shard(DataLoader(data, batch_size=2, shuffle=True), num_replicas=2, rank=0)
    loop = ResumableLoop()
    recovery = loop.recovery = InPlaceRecovery(loop.progress, loop.tracked)

    def shrink() -> None:  # what recover() does to the loop's side once the shrunk group is formed
        loader.follow_membership(Membership(0, 0, 1, (0, 1), 2))  # type: ignore[attr-defined]
        recovery.position.rewind = recovery.position.reshard = True

    seen: dict[int, list[list[int]]] = {0: [], 1: []}
    for epoch in loop.epochs(2):
        if epoch == 1 and lost_in == "the save between the epochs":
            shrink()
        for number, (batch,) in enumerate(loop.batches(loader)):
            seen[epoch].append(batch.tolist())
            if epoch == 1 and number == 0 and lost_in == "the first step of the next epoch":
                shrink()  # the step's all-reduce failed: nothing of epoch 1 committed
            else:
                recovery._keep_the_commit()
    assert seen[0] == shuffled_order(0, (0,), 2, 32, 2)
    expected_first = [] if lost_in == "the save between the epochs" else shuffled_order(1, (0,), 2, 32, 2)[:1]
    assert seen[1] == expected_first + shuffled_order(1, (0, 1), 2, 32, 2)


@pytest.mark.timeout(60)
def test_after_the_world_shrank_a_restart_of_every_node_is_refused_saying_why() -> None:
    """A restart starts every node's workers as the rendezvous formed them: after a shrink the launchers
    end the job instead of waiting for a node that is gone."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    shrinking = Shrinking(min_nodes=1, nproc_per_node=2, spares_possible=False)
    zero, one = (NodeCoordination(BoundedStore(connect("127.0.0.1", store.port, 10), 10), rank, 2, "127.0.0.1",
                                  store.port, survivors_go_on=True, shrinking=shrinking) for rank in (0, 1))
    one.world.remove(0)  # node 1's launcher shrank the world without node 0
    zero.looks.look()  # the news read, and with it the world's removals
    assert zero.world.nodes() == [1] and one.world.nodes() == [1]
    with pytest.raises(TimeoutError, match="the world shrank without node\\(s\\) 0"):
        one.meet(1, 5.0)
    layout_key = next(key for key in store.list_keys() if key.endswith("generation/1/layout"))
    # What the workers read: node 1's ranks are the members, each with its own share and one of node 0's.
    assert Layout.from_json(store.get(layout_key).decode()) == Layout((2, 3), ((0, 2), (1, 3)))


@pytest.mark.timeout(60)
def test_a_restart_waiting_for_the_nodes_is_refused_as_soon_as_the_world_shrinks_without_one() -> None:
    """A node lost in a collective between steps fails the survivors' workers at once, and their
    launcher goes to the restart barrier; the world shrinks without the lost node a heartbeat's
    silence later. The launcher waiting there ends as soon as it does, saying why, instead of
    waiting for the gone node until the recovery timeout."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    shrinking = Shrinking(min_nodes=1, nproc_per_node=2, spares_possible=False)
    zero, one = (NodeCoordination(BoundedStore(connect("127.0.0.1", store.port, 10), 10), rank, 2, "127.0.0.1",
                                  store.port, survivors_go_on=True, shrinking=shrinking) for rank in (0, 1))
    # Node 1 lost: the world's shrink without it, as the launcher that sees it silent writes it to the store.
    shrink = threading.Timer(0.5, lambda: one.world.remove(1))
    shrink.start()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="the world shrank without node\\(s\\) 1"):
        zero.meet(1, 30.0)  # node 0's launcher restarts its failed workers
    shrink.join()
    assert time.monotonic() - started < 5.0


class BeatingLaunchers:
    """Three launchers' coordination under in-place recovery (``--max-restarts 1``) on a real store,
    each beating through a client of its own, as ``ddpkit run`` makes them; silent after 0.5 s."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, shrinking: Shrinking) -> None:
        monkeypatch.setattr(heartbeats_module, "_SURVIVORS_WAIT_SILENT_SECONDS", 0.5)
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.nodes = [NodeCoordination(self._client(), rank, 3, "127.0.0.1", self.store.port, survivors_go_on=True,
                                       shrinking=shrinking, node_losses_allowed=1) for rank in range(3)]
        for coordination in self.nodes:
            coordination.beat_through(self._client())
        time.sleep(0.5)

    def _client(self) -> BoundedStore:
        return BoundedStore(connect("127.0.0.1", self.store.port, 10), 10)

    def shrink_without(self, lost: int, seen_by: NodeCoordination, deadline: float) -> None:
        """Silence node ``lost``'s launcher and wait until ``seen_by``'s world is without it (its
        silent_node saying nothing all the while: the world shrinks, no loss is declared)."""
        self.nodes[lost].heartbeats.stop()
        expected = [node for node in seen_by.world.nodes() if node != lost]
        while seen_by.world.nodes() != expected and time.monotonic() < deadline:
            assert seen_by.silent_node() is None
            time.sleep(0.05)
        assert seen_by.world.nodes() == expected and not seen_by.world.node_losses_left()

    def stop(self) -> None:
        for coordination in self.nodes:
            coordination.heartbeats.stop()
        time.sleep(0.3)  # the last beats done before the store goes


@pytest.mark.timeout(60)
def test_each_lost_node_spends_one_restart_and_once_none_is_left_the_next_loss_ends_the_job_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three launchers, ``--nnodes 1:3 --max-restarts 1``: node 1 goes silent and the world shrinks
    without it (one node loss spent); node 2 goes silent next, and node 0's launcher takes it for lost,
    saying that the budget is spent, instead of shrinking again (no claim waited for either)."""
    launchers = BeatingLaunchers(monkeypatch, Shrinking(min_nodes=1, nproc_per_node=1, spares_possible=True))
    zero, _, two = launchers.nodes
    assert zero.silent_node() is None
    deadline = time.monotonic() + 10
    launchers.shrink_without(1, seen_by=zero, deadline=deadline)  # node 1's launcher killed
    two.heartbeats.stop()  # node 2's, next
    lost_at = time.monotonic()
    while (why := zero.silent_node()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert why is not None and why.startswith("node 2's launcher went silent"), why
    assert "recovered from 1 lost node(s) already, all that --max-restarts=1 allows, so it ends" in why
    assert time.monotonic() - lost_at < 1.5  # the silence alone: no spare's claim is waited for
    assert zero.world.nodes() == [0, 2]
    launchers.stop()


@pytest.mark.timeout(60)
def test_a_survivor_that_looks_at_a_lost_node_after_another_removed_it_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three launchers, ``--nnodes 2:3 --max-restarts 1``: node 2 goes silent and node 0's launcher
    shrinks the world without it (to MIN). Node 1's launcher, which read the world before that
    removal and then looks at node 2, must find the world shrunk, not a second loss below MIN: it
    ended the job saying the budget was spent (``benchmarks/recovery.py --nodes 3``, its first run)."""
    launchers = BeatingLaunchers(monkeypatch, Shrinking(min_nodes=2, nproc_per_node=1, spares_possible=False))
    zero, one, _ = launchers.nodes
    assert one.world.nodes() == [0, 1, 2]  # node 1's launcher read the world before the loss
    launchers.shrink_without(2, seen_by=zero, deadline=time.monotonic() + 10)  # node 2's launcher killed
    # Node 1's look at node 2, as its silent_node makes it while going through the world it read before.
    beat = one.heartbeats.last_beat(2)
    assert beat is not None and one.world.shrinks_without(2, beat)
    assert one.silent_node() is None and one.world.nodes() == [0, 1]
    launchers.stop()


@pytest.mark.timeout(300)
def test_after_a_shrink_joining_nodes_lost_in_their_takeover_shrink_it_again_and_the_next_one_joins(
        tmp_path: Path) -> None:
    """Node 1 is lost in the gradients' all-reduce and the world shrinks. Then, the job held at each
    gate (after steps 7, 9 and 11), a launcher started later for the same job arrives (beyond MAX:
    admitted since the world shrank) to take node 1's place and is killed: once it has asked the
    survivors to grow (they then wait for its ranks at the step boundary); once the survivors let go
    and its first rank, counted into the new generation, is connecting to them; and once that rank is
    receiving the training state. Each time the survivors are told it was lost and form the generation
    after without it (well before the recovery timeout). Held after step 13, a fourth late launcher
    takes node 1's place; let go, the survivors agree on a step boundary and form the next generation
    with its ranks, which take their shares of the data back. The run ends with one process's
    parameters on the concatenated batches. (One job for the three moments: each job of launchers
    costs seconds of start-up on two cores.)"""
    (tmp_path / "job.py").write_text(PHASE_JOB)
    store = start_store(port := find_free_port())
    job = {"rdzv_id": "grow", "max_restarts": 4,  # node 1 and the three joiners
           "PHASE": "allreduce", "PAUSED_RANK": "2", "GATES": "7,9,11,13"}
    # Two steps from one gate to the next: the survivors form the generation without a lost joiner
    # at the step boundary after its gate, so a gate right after it could be passed in that step.
    moments = {7: "asking", 9: "connecting", 11: "receiving"}
    try:
        launchers = start_together(tmp_path, port, "1:2", 2, **job)
        wait_for(lambda: (tmp_path / "paused").exists(), "node 1's first rank to stop in the all-reduce")
        lost = node_of(tmp_path, 1)
        survivor = launchers[1 - lost]
        kill_node(launchers[lost])
        killed = time.monotonic()
        wait_for(lambda: (tmp_path / "step6").exists(), "the next step after the loss", timeout=60)
        print(f"node 1 killed in the all-reduce: the next step completed {time.monotonic() - killed:.2f} s later")
        for n, (gate, moment) in enumerate(moments.items(), start=2):
            wait_for(lambda gate=gate: (tmp_path / f"step{gate}").exists(), f"the shrunk world to train up to gate {gate}")
            name = f"launcher{n}"
            pause = {} if moment == "asking" else {"JOINER_PAUSE": moment}
            doomed = start_launcher(tmp_path, port, name, "1:2", **job, **pause)
            wait_for(lambda name=name: "joins the world again" in text(tmp_path, f"{name}.err"),
                     f"the joiner's request at gate {gate}")
            if moment != "asking":
                (tmp_path / f"go-on{gate}").touch()
                wait_for(lambda moment=moment: (tmp_path / f"joiner-paused-{moment}").exists(),
                         f"the joiner's first rank to stop {moment}")
            kill_node(doomed)
            (tmp_path / f"go-on{gate}").touch()
            let_go = time.monotonic()
            wait_for(lambda gate=gate: (tmp_path / f"step{gate + 2}").exists(),
                     f"the world to shrink again after the joiner lost {moment} and train on")
            assert time.monotonic() - let_go < 30, moment  # not the 60 s recovery timeout
        joiner = start_launcher(tmp_path, port, "launcher5", "1:2", **job)
        wait_for(lambda: "joins the world again" in text(tmp_path, "launcher5.err"), "the last joiner's request")
        (tmp_path / "go-on13").touch()
        codes = end_all([survivor, joiner], timeout=150)
        errors = "\n".join(f"--- launcher{n}\n{text(tmp_path, f'launcher{n}.err')[-4000:]}" for n in range(6))
        assert codes == [0, 0], errors
        err = text(tmp_path, f"launcher{1 - lost}.err")
        assert err.count("ddpkit run: node 1's launcher went silent and no spare node took its place: the world shrank"
                         ) == 4, errors
        assert "was given up while it formed" in err and "was lost while the training state was sent" in err, errors
        assert "the world shrank without node 1; this spare node takes its place" in text(tmp_path, "launcher5.err")
        assert "a node joins; forming generation" in err and "grew in place" in err, errors
        out = text(tmp_path, f"launcher{1 - lost}.out") + text(tmp_path, "launcher5.out")
        assert sorted(re.findall(r"rank (\d): rank \1 of 4 done", out)) == ["0", "1", "2", "3"], out
        assert_as_one_process(tmp_path, errors)
    finally:
        store.kill()
        store.wait()


def test_a_loader_ddpkit_sharded_starts_at_the_batch_asked_for_without_reading_the_ones_before() -> None:
    """``batches(loader, skip)`` (a resumed run, a replacement, a survivor reading new shares): the
    sampler starts there, so a large dataset is not read up to that point."""

    class Counting(TensorDataset):
        read: list[int] = []

        def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
            Counting.read.append(index)
            return super().__getitem__(index)

    loader = shard(DataLoader(Counting(torch.arange(16)), batch_size=2), num_replicas=2, rank=1)
    seen = [batch[0].tolist() for batch in ResumableLoop().batches(loader, skip=3)]
    assert seen == [[13, 15]]  # rank 1 of 2 reads rows 1, 3, 5, ...: its fourth batch is its last
    assert Counting.read == [13, 15]
