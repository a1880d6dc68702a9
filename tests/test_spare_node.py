"""A lost node taken over in place by a spare node (issue 32, item 1): `ddpkit run --nnodes 2:3
--rdzv-backend c10d --recovery in-place` on three launchers, the store outside the nodes
(`ddpkit store`); the rendezvous closes with two nodes and the third launcher waits as a spare.
Node 1's launcher and workers are killed with SIGKILL together (a node lost) in the middle of
training; the spare takes its ranks while node 0's workers keep their processes, and the run ends
with the parameters of the run without the fault. Real launchers and workers on Gloo, loopback."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import ddpkit_messages
from launchers import (
    PHASE_JOB,
    SECRET,
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
from torch.distributed import TCPStore

from ddpkit.control_plane import heartbeats as heartbeats_module
from ddpkit.control_plane import nodes as nodes_module
from ddpkit.control_plane.nodes import NodeCoordination
from ddpkit.environments import find_free_port
from ddpkit.launching.spare_node import wait_as_spare
from ddpkit.membership.generations import announce_node_lost, claim_rank, generation_prefix, node_lost
from ddpkit.process_state import PROCESS
from ddpkit.store.client import BoundedStore, GaveUpWaiting, connect
from ddpkit.store.job_secret import JobSecret

# Two ranks a node; rank 0 marks each step it finished, and every step takes a moment, so that the
# test can kill a node in the middle of training.
JOB = textwrap.dedent(
    """
    import os, time, torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import ddpkit

    STEPS, BATCH = int(os.environ.get("STEPS", "24")), 4
    strategy = ddpkit.DDPStrategy()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    generator = torch.Generator().manual_seed(1)
    samples = STEPS * BATCH * 4
    data = TensorDataset(torch.randn(samples, 8, generator=generator), torch.randn(samples, 2, generator=generator))
    loader = strategy.setup_dataloader(DataLoader(data, batch_size=BATCH))
    while os.environ.get("GATE") and not os.path.exists("go"):  # the test opens it once the spares wait
        time.sleep(0.05)
    for _ in strategy.epochs(1):
        for x, y in strategy.batches(loader):
            with strategy.step():
                optimizer.zero_grad()
                strategy.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
            if strategy.global_rank == 0:
                open(f"step{strategy.progress.steps}", "w").close()
            time.sleep(float(os.environ.get("STEP_SECONDS", "0.15")))
    if strategy.global_rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], "final.pt")
    print(f"rank {strategy.global_rank} of {strategy.world_size} done, recovered {strategy.recovered_in_place}",
          flush=True)
    strategy.teardown()
    """
)


def start_world_and_spares(folder: Path, port: int, spares: int = 1, **variables: str) -> list[subprocess.Popen[bytes]]:
    """Two launchers that form the world, then ``spares`` more that wait as spare nodes (launcher0, 1, ...)."""
    folder.mkdir()
    (folder / "job.py").write_text(JOB)
    nnodes = f"2:{2 + spares}"
    launchers = start_together(folder, port, nnodes, 2, **variables)
    wait_for(lambda: all("complete: this is node" in text(folder, f"launcher{n}.err") for n in range(2)),
             "the rendezvous to close with two nodes")
    for n in range(2, 2 + spares):
        launchers.append(start_launcher(folder, port, f"launcher{n}", nnodes, **variables))
        wait_for(lambda n=n: "waits as a spare node" in text(folder, f"launcher{n}.err"), f"launcher {n} to wait as a spare")
    return launchers


def fault_free(folder: Path) -> list[torch.Tensor]:
    """The run without a fault, with two spare nodes: one stopped by SIGTERM while it waits, which
    ends it alone, and one that ends with the job, not needed."""
    store = start_store(port := find_free_port())
    try:
        launchers = start_world_and_spares(folder, port, spares=2, STEP_SECONDS="0", GATE="1")
        launchers[3].send_signal(signal.SIGTERM)
        launchers[3].wait(timeout=30)  # before the job ends: stopped while it waits
        (folder / "go").touch()
        codes = end_all(launchers, timeout=120)
        assert codes == [0, 0, 0, 128 + signal.SIGTERM], "\n".join(text(folder, f"launcher{n}.err")[-3000:]
                                                                   for n in range(4))
        assert "this spare node was not needed" in text(folder, "launcher2.err")
        assert "received SIGTERM while waiting as a spare node: stopping (the job goes on" in text(folder, "launcher3.err")
    finally:
        store.kill()
        store.wait()
    parameters: list[torch.Tensor] = torch.load(folder / "final.pt")
    return parameters


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> list[torch.Tensor]:
    """The final parameters of the run without a fault (``fault_free``), for every test here."""
    return fault_free(tmp_path_factory.mktemp("spare") / "fault_free")


def compare(parameters: list[torch.Tensor], expected: list[torch.Tensor], errors: str) -> None:
    difference = max((a - b).abs().max().item() for a, b in zip(parameters, expected, strict=True))
    assert difference <= 1e-6, f"{difference:.3e} from the run without the fault\n{errors}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("phases", [("forward", "allreduce"), ("optimizer", "save")], ids="-then-".join)
def test_a_node_lost_in_a_step_or_a_save_is_taken_over_by_a_spare_node_and_the_run_ends_as_one_process(
        tmp_path: Path, phases: tuple[str, str]) -> None:
    """Node 1 killed while its first rank is in the forward or the gradients' all-reduce (the others
    wait in the all-reduce), its optimizer step (they are a step ahead) or before a checkpoint save
    (they wait in the save): a spare node takes its ranks. Two of these in each job: in step 6 (the
    save after step 5), then, with another spare waiting, the first spare's in step 10 (the save
    after step 10). The run ends with one process's parameters on the concatenated batches. (Two
    phases a job: each job of launchers costs seconds of start-up on two cores. Lost while its link
    is down, between steps: the test after.)"""
    (tmp_path / "job.py").write_text(PHASE_JOB)
    store = start_store(port := find_free_port())
    at = dict(zip(phases, (5, 9 if phases[1] != "save" else 10), strict=True))
    job = {"rdzv_id": "spare-phase", "max_restarts": 2, "PAUSED_RANK": "2",
           "PHASE": ",".join(f"{phase}:{step}" for phase, step in at.items())}
    try:
        # --nnodes 2:3: the second spare arrives as the fourth launcher, beyond MAX, and waits because
        # the lost node's launcher is gone (the job recovered from one lost node).
        first = [start_launcher(tmp_path, port, f"launcher{n}", "2:3", **job) for n in range(2)]
        lost: subprocess.Popen[bytes] | None = None
        for n, (phase, step) in enumerate(at.items(), start=2):
            wait_for(lambda step=step: (tmp_path / f"paused{step}").exists(), f"node 1's first rank to stop in {phase}")
            if lost is None:
                node1 = node_of(tmp_path, 1)
                survivor, lost = first[1 - node1], first[node1]
            spare = start_launcher(tmp_path, port, f"launcher{n}", "2:3", **job)
            wait_for(lambda n=n: "waits as a spare node" in text(tmp_path, f"launcher{n}.err"), "the spare node to wait")
            kill_node(lost)
            killed = time.monotonic()
            done = max(int(path.name[4:]) for path in tmp_path.glob("step*"))
            wait_for(lambda done=done: (tmp_path / f"step{done + 1}").exists(), "the next step after the loss", timeout=60)
            print(f"node 1 killed in {phase} after step {done}: step {done + 1} completed "
                  f"{time.monotonic() - killed:.2f} s later")
            assert lost.wait() == -signal.SIGKILL
            lost = spare
        codes = end_all([survivor, lost], timeout=150)
        errors = "\n".join(f"--- launcher{n}\n{text(tmp_path, f'launcher{n}.err')[-4000:]}" for n in range(4))
        assert codes == [0, 0], errors
        for n in (2, 3):
            assert "node 1's launcher went silent; this spare node takes its place" in text(tmp_path, f"launcher{n}.err"), errors
        # The survivor's launcher says why it went on, each time.
        assert text(tmp_path, f"launcher{1 - node1}.err").count(
            "node 1's launcher went silent; a spare node (spare launcher pid") == 2, errors
        out = text(tmp_path, f"launcher{1 - node1}.out") + text(tmp_path, "launcher3.out")
        assert sorted(re.findall(r"rank (\d): rank \d of 4 done", out)) == ["0", "1", "2", "3"], out
        assert "rank 0: rank 0 of 4 done, recovered True" in out  # the survivor kept its process and recovered
        assert_as_one_process(tmp_path, errors)
    finally:
        store.kill()
        store.wait()


@pytest.mark.timeout(300)
def test_a_node_whose_link_went_down_is_taken_over_and_fenced_when_the_link_comes_back(
        two_namespaces: list[tuple[str, str]], tmp_path: Path, expected: list[torch.Tensor]) -> None:
    """Node 1's network goes down in the middle of training (its processes live on, and no
    connection to them is closed): the spare node takes its place and the other node's workers,
    blocked in a collective with node 1's ranks, are told by the spare and go on. When the link
    comes back seconds later, node 1's launcher finds its place taken: it ends its workers (which
    never meet the job's group again) and exits 1 saying so; the run ends as without the fault."""
    (namespace0, address0), (namespace1, _) = two_namespaces
    link1 = subprocess.run(["ip", "-n", namespace1, "-o", "link", "show", "type", "veth"], capture_output=True,
                           text=True, check=True).stdout.split(":")[1].strip().split("@")[0]
    folder = tmp_path / "link_down"
    folder.mkdir()
    (folder / "job.py").write_text(JOB)
    port = find_free_port()
    store = start_store(port, namespace0, address0)
    node = {"address": address0, "GATE": "1"}
    try:
        launchers = [start_launcher(folder, port, "launcher0", "2:3", namespace0, **node)]
        wait_for(lambda: "waiting for 1 more node" in text(folder, "launcher0.err"), "node 0 to arrive")
        launchers.append(start_launcher(folder, port, "launcher1", "2:3", namespace1, **node))
        wait_for(lambda: "this is node 1 of 2" in text(folder, "launcher1.err"), "the rendezvous to close")
        launchers.append(start_launcher(folder, port, "launcher2", "2:3", namespace0, **node))
        wait_for(lambda: "waits as a spare node" in text(folder, "launcher2.err"), "the spare node to wait")
        (folder / "go").touch()
        wait_for(lambda: (folder / "step6").exists(), "six steps")
        subprocess.run(["ip", "-n", namespace1, "link", "set", link1, "down"], check=True)
        down = time.monotonic()
        try:
            done = max(int(path.name[4:]) for path in folder.glob("step*"))
            wait_for(lambda: (folder / f"step{done + 1}").exists(), "the next step after the link went down", 60)
            print(f"node 1's link down after step {done}: step {done + 1} completed {time.monotonic() - down:.2f} s later")
        finally:
            subprocess.run(["ip", "-n", namespace1, "link", "set", link1, "up"], check=True)
        codes = end_all(launchers, timeout=150)
        errors = "\n".join(f"--- launcher{n}\n{text(folder, f'launcher{n}.err')[-4000:]}" for n in range(3))
        assert codes == [0, 1, 0], errors
        assert "a spare node (spare launcher pid" in text(folder, "launcher1.err"), errors
        assert "took its place and its ranks: this node's workers are ended" in text(folder, "launcher1.err"), errors
        out = text(folder, "launcher0.out") + text(folder, "launcher2.out")
        assert sorted(re.findall(r"rank (\d) of 4 done", out)) == ["0", "1", "2", "3"], out
        assert "rank 0 of 4 done, recovered True" in out
        assert "done" not in text(folder, "launcher1.out")  # node 1's workers never trained on
        compare(torch.load(folder / "final.pt"), expected, errors)
    finally:
        store.kill()
        store.wait()


def _coordinations(port: int, *node_ranks: int) -> list[NodeCoordination]:
    def client() -> BoundedStore:
        return BoundedStore(connect("127.0.0.1", port, 10), 10)

    return [NodeCoordination(client(), rank, 2, "127.0.0.1", port, survivors_go_on=True) for rank in node_ranks]


def _silent_node_within(coordination: NodeCoordination, seconds: float) -> str | None:
    deadline = time.monotonic() + seconds
    while (why := coordination.silent_node()) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return why


@pytest.mark.timeout(60)
def test_a_silent_node_is_lost_for_the_others_unless_a_spare_claims_its_place_and_beats_as_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The launchers' side, with a real store: node 1's launcher stops beating (killed); node 0's
    takes it for lost after the silence and the wait for a claim; when a spare claims its place
    (one spare only: the first claim written wins) and beats as node 1, node 0 never does."""
    monkeypatch.setattr(heartbeats_module, "_SURVIVORS_WAIT_SILENT_SECONDS", 0.5)
    monkeypatch.setattr(nodes_module, "_CLAIM_SECONDS", 1.0)
    monkeypatch.setattr(nodes_module, "_TAKEOVER_SECONDS", 2.0)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    zero, one = _coordinations(store.port, 0, 1)
    one.beat_through(connect("127.0.0.1", store.port, 10))
    assert _silent_node_within(zero, 1.0) is None
    one.heartbeats.stop()  # node 1's launcher killed: no more beats, no word
    started = time.monotonic()
    assert "node 1's launcher went silent" in str(_silent_node_within(zero, 5.0))
    assert time.monotonic() - started >= 1.0  # the silence (less the last beat's age), then the wait for a claim

    second_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store2 = second_store.port
    zero, one = _coordinations(store2, 0, 1)
    one.beat_through(connect("127.0.0.1", store2, 10))
    spare, other_spare = _coordinations(store2, -1, -1)
    assert _silent_node_within(zero, 0.3) is None and not spare.looks.silent_launchers()
    one.heartbeats.stop()  # node 1's launcher killed: no more beats, no word
    deadline = time.monotonic() + 5
    # The spare reads no beat of its own: node 0's launcher, which watches node 1, reports it silent.
    while (beat := spare.looks.silent_launchers().get(1)) is None and time.monotonic() < deadline:
        zero.silent_node()
        time.sleep(0.02)
    assert beat is not None
    assert spare.world.claim(1, beat, "spare A") and not other_spare.world.claim(1, beat, "spare B")
    assert zero.world.claimant(1, beat) == "spare A"
    assert _silent_node_within(zero, 1.5) is None  # claimed: waited for
    spare.world.take_place_of(1)
    spare.beat_through(connect("127.0.0.1", store2, 10))
    assert _silent_node_within(zero, 3.0) is None  # past the takeover's bound: the spare beats as node 1
    spare.leave(0.0)


@pytest.mark.timeout(60)
def test_a_spare_whose_claim_comes_after_the_others_took_the_node_for_lost_does_not_take_its_place(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A spare node that claims a silent node's place after the others' wait for a claim (a spare
    started late, or slow to look) won it before: node 0's launcher had taken node 1 for lost and
    ended its workers without writing anything, the spare took the place, and both sides waited at
    the restart meeting until its time out (60 s). Now the loss is a claim too: written first, the
    spare's loses, it says so and waits on until the others left (node 1's launcher, which never
    says it left, counts as gone once lost), and node 1's launcher, should it answer again, is not
    told a spare replaced it."""
    monkeypatch.setattr(heartbeats_module, "_SURVIVORS_WAIT_SILENT_SECONDS", 0.5)
    monkeypatch.setattr(nodes_module, "_CLAIM_SECONDS", 1.0)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    zero, one, spare, other_spare = _coordinations(store.port, 0, 1, -1, -1)
    one.beat_through(connect("127.0.0.1", store.port, 10))
    assert _silent_node_within(zero, 0.3) is None
    one.heartbeats.stop()  # node 1's launcher killed
    assert "node 1's launcher went silent" in str(_silent_node_within(zero, 5.0))
    beat = str(zero.heartbeats.last_beat(1))

    stopped = threading.Event()
    taken: list[Any] = []

    def wait() -> None:
        with contextlib.suppress(GaveUpWaiting):
            taken.append(wait_as_spare(spare, lambda: SimpleNamespace(process=SimpleNamespace(poll=lambda: None)), 2,
                                       lambda: "the test ends" if stopped.is_set() else None))

    waiter = threading.Thread(target=wait, daemon=True)
    with ddpkit_messages() as messages:
        waiter.start()
        deadline = time.monotonic() + 10
        while not any("before this spare node claimed" in message for message in messages) \
                and waiter.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        waited_on = waiter.is_alive()
        zero.leave(0.0)  # node 0's launcher ends the job without node 1: the spare is not needed
        waiter.join(timeout=5)
        stopped.set()  # (had it waited on, the test ends it)
        waiter.join(timeout=5)
    said = [message for message in messages if "before this spare node claimed" in message]
    assert taken == [None] and waited_on and len(said) == 1, (taken, messages)
    assert said[0].startswith("ddpkit run: node 1's launcher went silent, and the other nodes took it for lost"), said
    assert "no spare node claimed its place in time (node 0's launcher" in said[0], said
    assert not other_spare.world.claim(1, beat, "spare B")  # the place is nobody's
    assert not one.world.was_replaced(ask_store=True)
    assert "node 1's launcher went silent" in str(zero.silent_node())  # once lost, always lost


@pytest.mark.timeout(60)
def test_a_spare_node_claims_a_silent_nodes_place_in_time_while_its_warm_spares_cannot_start_yet(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A spare node's warm spares are forked from its template, which imports what the script needs
    first (Lightning: seconds on a loaded machine). Its wait started them first, so a node lost in
    those seconds was claimed too late: the other nodes had taken it for lost and ended the attempt
    while the spare took its place (the Lightning takeover test, now and then: the survivors' SIGTERM
    became a preemption). Now it claims at once and starts the spares when they can start without
    waiting, or when it takes the place."""
    monkeypatch.setattr(heartbeats_module, "_SURVIVORS_WAIT_SILENT_SECONDS", 0.5)
    monkeypatch.setattr(nodes_module, "_CLAIM_SECONDS", 1.0)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    zero, one, spare = _coordinations(store.port, 0, 1, -1)
    one.beat_through(connect("127.0.0.1", store.port, 10))
    imported = threading.Event()  # the template's imports done

    def start_spare() -> Any:
        imported.wait(20)  # a fork waits for the template's imports
        return SimpleNamespace(process=SimpleNamespace(poll=lambda: None))

    taken: list[Any] = []
    waiter = threading.Thread(target=lambda: taken.append(
        wait_as_spare(spare, start_spare, 2, lambda: None, imported.is_set)), daemon=True)
    waiter.start()
    assert _silent_node_within(zero, 0.3) is None
    one.heartbeats.stop()  # node 1's launcher killed
    assert _silent_node_within(zero, 4.0) is None  # claimed within the second the others wait for a claim
    imported.set()
    waiter.join(timeout=20)
    assert taken and taken[0].node_rank == 1 and len(taken[0].spares) == 2


@pytest.mark.timeout(200)
def test_without_a_spare_node_a_lost_node_ends_the_other_within_seconds_naming_it(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(JOB)
    store = start_store(port := find_free_port())
    try:
        launchers = [start_launcher(tmp_path, port, f"launcher{n}", "2:3") for n in range(2)]
        wait_for(lambda: (tmp_path / "step3").exists(), "three steps")
        node1 = next(n for n in range(2) if "this is node 1 of 2" in text(tmp_path, f"launcher{n}.err"))
        kill_node(launchers[node1])
        killed = time.monotonic()
        code = end_all([launchers[1 - node1]], timeout=60)[0]
        took = time.monotonic() - killed
        err = text(tmp_path, f"launcher{1 - node1}.err")
        assert code == 1 and "node 1's launcher went silent" in err, err[-3000:]
        assert took < 20, f"{took:.1f} s"
    finally:
        store.kill()
        store.wait()


@pytest.mark.timeout(60)
def test_a_spare_stopped_as_the_job_ends_says_it_was_stopped() -> None:
    """A signal that reaches a waiting spare when every node's launcher has just left is still a stop
    (128 + the signal, from the launcher), not "this spare node was not needed" (0)."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    zero, one, spare = _coordinations(store.port, 0, 1, -1)
    zero.leave(0.0)
    one.leave(0.0)
    assert spare.world.job_over()
    with pytest.raises(GaveUpWaiting, match="received SIGTERM"):
        wait_as_spare(spare, lambda: pytest.fail("no warm spare is needed"), 0, lambda: "received SIGTERM")


def test_a_rank_of_the_next_generation_is_held_by_the_first_process_of_the_job_that_claims_it() -> None:
    """What fences a lost node's workers out (``ddpkit.membership.generations``): the spare's launcher holds the
    lost ranks for its workers before it says the node was lost; a claim by any other process then
    returns the holder, and a stranger's value (without the job secret) holds nothing."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    secret = JobSecret(SECRET["DDPKIT_JOB_SECRET"].encode(), "a test")
    assert node_lost(store, secret, 0, 3) is None
    prefix = generation_prefix(secret, 0, 4)
    store.set(f"{prefix}member/2", "stranger:1")
    assert claim_rank(store, secret, 0, 4, 2, "spare:10") == "spare:10"  # the stranger's value replaced
    assert claim_rank(store, secret, 0, 4, 2, "lost:20") == "spare:10"
    assert claim_rank(store, secret, 0, 4, 3, "lost:21") == "lost:21"  # each rank on its own
    store.set(f"{generation_prefix(secret, 0, 3)}node_lost", "node 0's launcher went silent")  # forged
    assert node_lost(store, secret, 0, 3) is None
    announce_node_lost(store, secret, 0, 3, "node 1's launcher went silent")
    assert node_lost(store, secret, 0, 3) == "node 1's launcher went silent"
    assert node_lost(store, secret, 0, 4) is None and node_lost(store, secret, 1, 3) is None


def test_a_launchers_announcement_of_lost_ranks_is_what_the_survivors_read_as_a_loss() -> None:
    """On NCCL a killed rank breaks nothing the survivors see: the launcher that replaces it says
    so in the store (``joining.announce_loss``), signed with the job's secret, under the attempt and
    generation the survivors are in; their ``announced_loss`` (read by the peer watch) is then a
    ``PeerLostError`` naming it."""
    from ddpkit.diagnostics import failures
    from ddpkit.environments import Recovery
    from ddpkit.launching.config import LaunchConfig
    from ddpkit.launching.joining import announce_loss

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    secret = JobSecret(SECRET["DDPKIT_JOB_SECRET"].encode(), "a test")
    config = LaunchConfig(nproc_per_node=2, backend="nccl", recovery=Recovery.IN_PLACE, max_restarts=1)
    announce_loss(config, store.port, SECRET, 2, 5, "rank 1 (pid 7) was killed by SIGKILL")
    assert node_lost(store, secret, 2, 5) == "rank 1 (pid 7) was killed by SIGKILL"
    assert node_lost(store, secret, 2, 6) is None and node_lost(store, None, 2, 5) is None  # unsigned: none
    try:
        assert failures.announced_loss(store) is None  # outside in-place recovery nothing is read
        failures.expect_vanished_peers(lambda: node_lost(store, secret, 2, 5))
        lost = failures.announced_loss(store)
        assert isinstance(lost, failures.PeerLostError) and "rank 1 (pid 7) was killed by SIGKILL" in str(lost)
    finally:
        PROCESS.reset()  # this test process expects no lost peers again
