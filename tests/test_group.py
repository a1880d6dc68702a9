"""The group object (``ddpkit.membership.group``): one owner of the membership, one hook through which what caches
membership follows a new generation.

Each case runs in processes of its own: forming a group under in-place recovery changes how the
process's diagnostics read a failed collective, which must not leak into the test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import ddpkit_messages
from torch import nn

from ddpkit.environments import find_free_port
from ddpkit.process_state import PROCESS
from ddpkit.variables import DDPKIT_RECOVERY, DDPKIT_RECOVERY_TIMEOUT_SECONDS

BOUND_SECONDS = 90

# One process, the launcher's store played by a HashStore: the hook's contract.
HOOK_CONTRACT = textwrap.dedent(
    """
    import gc, json
    from datetime import timedelta
    import torch.distributed as dist
    from ddpkit.membership.group import Group, Membership

    group = Group(Membership(0, 0, 1), "gloo", timedelta(seconds=30), launcher_store=dist.HashStore(), survivors_go_on=True)
    dist.init_process_group("gloo", store=group.store_of(0), rank=0, world_size=1)
    calls = []

    class Follower:
        def __init__(self, name):
            self.name = name
        def follow(self, membership):
            calls.append([self.name, membership.generation, membership.rank, membership.world_size])

    kept, dropped, stopped = Follower("kept"), Follower("dropped"), Follower("stopped")
    group.on_reconfigure(kept.follow)
    group.on_reconfigure(dropped.follow)
    stop = group.on_reconfigure(stopped.follow)
    group.on_reconfigure(lambda membership: calls.append(["function", membership.generation, 0, 1]))
    stop()
    del dropped
    gc.collect()
    first = group.reconfigure()
    second = group.reconfigure()
    print("RESULT " + json.dumps({"calls": calls, "generations": [first.generation, second.generation],
                                  "same_world": dist.get_world_size()}), flush=True)
    """
)


def _result(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert lines, output
    return json.loads(lines[-1][len("RESULT "):])


def test_reactions_run_in_order_once_per_generation_and_a_dropped_or_stopped_follower_is_not_called() -> None:
    run = subprocess.run([sys.executable, "-c", HOOK_CONTRACT], capture_output=True, text=True, timeout=BOUND_SECONDS,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    result = _result(run.stdout)
    assert result["generations"] == [1, 2]
    assert result["calls"] == [["kept", 1, 0, 1], ["function", 1, 0, 1], ["kept", 2, 0, 1], ["function", 2, 0, 1]]
    assert result["same_world"] == 1


# Rank 2 of three (as the launcher started it) waits for generation 1 of the group while ranks 0 and 1
# are lost; a second later the launcher that shrinks the world lays generation 1 out without them, as
# the only member, training every share. It forms the group alone, and a rank the world shrank without
# that comes back finds its place held, and ranks that wait to join when the training ends are told so.
SHRINK = textwrap.dedent(
    """
    import json, threading, time
    from datetime import timedelta
    import torch.distributed as dist
    from ddpkit.membership.generations import REMOVED, Layout, RankTakenError, announce_growth, claim_rank, write_layout
    from ddpkit.membership.group import Group, Membership

    store = dist.HashStore()
    group = Group(Membership(0, 2, 3), "gloo", timedelta(seconds=30), launcher_store=store, survivors_go_on=True)
    layout = Layout.initial(3).shrunk({0, 1})

    def launcher_shrinks():
        time.sleep(1.0)
        for rank in (0, 1):
            claim_rank(store, None, 0, 1, rank, REMOVED)
        write_layout(store, None, 0, 1, layout)

    threading.Thread(target=launcher_shrinks).start()
    started = time.monotonic()
    membership = group.reconfigure()
    waited = time.monotonic() - started
    lost = Group(Membership(0, 1, 3), "gloo", timedelta(seconds=30), launcher_store=store, survivors_go_on=True)
    try:
        lost.meet(1)
        came_back = "met"
    except RankTakenError as error:
        came_back = str(error)
    # A node that asked to join the next generation, whose ranks wait for it, when the training ends first.
    write_layout(store, None, 0, 2, layout.grown({1}))
    announce_growth(store, None, 0, 1, "node 0 joins again")
    group.finish()
    joiner = Group(Membership(0, 1, 3), "gloo", timedelta(seconds=30), launcher_store=store, survivors_go_on=True)
    try:
        joiner.meet(2)
        finished = "met"
    except SystemExit as end:
        finished = f"exit {end.code}"
    print("RESULT " + json.dumps({"membership": [membership.generation, membership.rank, membership.world_size,
                                                 list(membership.shares), membership.data_world_size],
                                  "weight": membership.weight, "torch": [dist.get_rank(), dist.get_world_size()],
                                  "waited": waited, "came_back": came_back, "finished": finished}), flush=True)
    """
)


def test_a_rank_waiting_for_the_next_generation_forms_it_as_the_layout_written_meanwhile_says() -> None:
    run = subprocess.run([sys.executable, "-c", SHRINK], capture_output=True, text=True, timeout=BOUND_SECONDS,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    result = _result(run.stdout)
    assert result["membership"] == [1, 0, 1, [0, 1, 2], 3]  # the only member, every share of the data world of 3
    assert result["weight"] == 1.0 and result["torch"] == [0, 1]
    assert 0.9 < result["waited"] < 10  # it waited for the layout, not for the lost ranks until the timeout
    assert "held by 'removed: the world shrank without this rank'" in result["came_back"]
    # Ranks waiting to join a generation that the training ended before end with 0, not the recovery timeout.
    assert result["finished"] == "exit 0"


# Two ranks; the test process hosts the store, as ddpkit run's store host does under in-place recovery.
RANK = textwrap.dedent(
    """
    import json, os
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from ddpkit.training.agreement import StepAgreement
    from ddpkit.membership.connection import destroy_dist_connection, init_dist_connection
    from ddpkit.training.data import shard
    from ddpkit.environments import LocalEnvironment
    from ddpkit.membership.group import current_group
    from ddpkit.parallel.ddp import DistributedDataParallel

    rank = int(os.environ["RANK"])
    init_dist_connection(LocalEnvironment(), "gloo")
    group = current_group()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.arange(64, dtype=torch.float32).reshape(16, 4) / 64
    targets = torch.arange(32, dtype=torch.float32).reshape(16, 2) / 32
    loader = shard(DataLoader(TensorDataset(inputs, targets), batch_size=2), num_replicas=2, rank=rank, group=group)
    # Rounds read a round late, so that one is on its way when the group is formed again.
    agreement = StepAgreement(wait_at_once_seconds=1e9, round_interval_seconds=0.0)
    seen = []
    group.on_reconfigure(lambda membership: seen.append([membership.generation, membership.rank, membership.world_size]))

    def step(x, y):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    batches = iter(loader)
    step(*next(batches))
    first_decision = agreement.decide(False)
    if rank == 1:
        # A round rank 0 never joins, as when a rank is lost: it cannot complete on the old group.
        agreement.decide(False)
    group.reconfigure()
    step(*next(batches))
    decided_at = None
    for call in range(1, 6):
        if agreement.decide(rank == 1) and decided_at is None:
            decided_at = call
    shares = sorted(loader.sampler)
    print("RESULT " + json.dumps({"seen": seen, "first_decision": first_decision, "decided_at": decided_at,
                                  "shares": shares, "generation": group.generation,
                                  "weight": model.module.weight.tolist(), "bias": model.module.bias.tolist()}),
          flush=True)
    destroy_dist_connection()
    """
)


def _reference() -> tuple[torch.Tensor, torch.Tensor]:
    """One process, the concatenated batches of both ranks (the sampler gives rank r the rows r, r+2, ...)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.arange(64, dtype=torch.float32).reshape(16, 4) / 64
    targets = torch.arange(32, dtype=torch.float32).reshape(16, 2) / 32
    for rows in ([0, 2, 1, 3], [4, 6, 5, 7]):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows]).backward()
        optimizer.step()
    return model.weight.detach(), model.bias.detach()


def test_after_the_group_is_formed_again_ddp_the_sampler_and_the_agreement_follow_it() -> None:
    port = find_free_port()
    store = dist.TCPStore("127.0.0.1", port, world_size=3, is_master=True,  # type: ignore[attr-defined]
                          timeout=timedelta(seconds=BOUND_SECONDS), wait_for_workers=False)
    processes = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
               "RANK": str(rank), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1", DDPKIT_RECOVERY: "in-place"}
        processes.append(subprocess.Popen([sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=BOUND_SECONDS)[0])
    finally:
        for process in processes:
            process.kill()
        del store
    assert [p.returncode for p in processes] == [0, 0], outputs
    results = [_result(output) for output in outputs]
    weight, bias = _reference()
    for rank, result in enumerate(results):
        assert result["seen"] == [[1, rank, 2]]
        assert result["generation"] == 1
        assert result["first_decision"] is False
        assert result["shares"] == list(range(rank, 16, 2))
        torch.testing.assert_close(torch.tensor(result["weight"]), weight, rtol=0, atol=1e-6)
        torch.testing.assert_close(torch.tensor(result["bias"]), bias, rtol=0, atol=1e-6)
    # Every rank decides at the same call, though only rank 1 raised the flag.
    assert results[0]["decided_at"] == results[1]["decided_at"] is not None


def test_a_sharded_loader_takes_its_share_anew_when_the_membership_changes() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from ddpkit.membership.group import Membership
    from ddpkit.training.data import shard

    loader = shard(DataLoader(TensorDataset(torch.arange(10)), batch_size=2, shuffle=True), num_replicas=2, rank=1)
    loader.sampler.set_epoch(3)  # type: ignore[attr-defined]
    before = list(loader.sampler)
    loader.follow_membership(Membership(generation=1, rank=0, world_size=1))  # type: ignore[attr-defined]
    after = list(loader.sampler)
    assert len(before) == 5 and sorted(after) == list(range(10))
    assert loader.sampler.epoch == 3  # type: ignore[attr-defined]
    assert set(before) <= set(after)


# A member that died after it was counted into a generation, while the others form it (a joining node
# killed in its takeover): before it wrote its address, or after (then the others' connections to it are
# refused, or they wait for it to connect to them, for the recovery timeout at most: 5 s here). The test
# process hosts the store and plays the launcher that shrinks the world again.
SURVIVOR = textwrap.dedent(
    """
    import json, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from ddpkit.membership.group import Group, Membership

    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=60))
    group = Group(Membership(0, 0, 2), "gloo", timedelta(minutes=30), launcher_store=store, survivors_go_on=True)
    started = time.monotonic()
    membership = group.reconfigure()
    print("RESULT " + json.dumps({"membership": [membership.generation, membership.rank, membership.world_size,
                                                 list(membership.shares)],
                                  "seconds": time.monotonic() - started, "torch": dist.get_world_size()}), flush=True)
    dist.destroy_process_group()
    """
)

# The joining member: counted in, then it writes its address and dies before it connects.
DYING_JOINER = textwrap.dedent(
    """
    import os, sys
    from datetime import timedelta
    import torch.distributed as dist
    from ddpkit.membership.generations import claim_rank, generation_prefix, member_identity
    from ddpkit.membership.group import Group, Membership

    class DiesOnceItsAddressIsOut(dist.Store):
        def __init__(self, store):
            super().__init__()
            self.store = store
        def set(self, key, value):
            self.store.set(key, value)
        def wait(self, keys, timeout=None):
            os._exit(9)

    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=60))
    group = Group(Membership(0, 1, 2), "gloo", timedelta(minutes=30), launcher_store=store, survivors_go_on=True)
    claim_rank(store, None, 0, 1, 1, member_identity())  # counted in, as ``Group.meet`` does
    store.add(f"{generation_prefix(None, 0, 1)}arrived", 1)
    dist.init_process_group("gloo", store=DiesOnceItsAddressIsOut(group.store_of(1)), rank=1, world_size=2)
    """
)


@pytest.mark.parametrize("died", ["before its address", "after its address"])
def test_a_member_that_died_while_its_generation_formed_leaves_it_to_the_next_one(died: str) -> None:
    from ddpkit.membership.generations import REMOVED, Layout, announce_node_lost, claim_rank, generation_prefix, write_layout

    port = find_free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True,  # type: ignore[attr-defined]
                          timeout=timedelta(seconds=BOUND_SECONDS), wait_for_workers=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if died == "after its address":  # dead before the survivor forms the group (not while it connects to it)
        env[DDPKIT_RECOVERY_TIMEOUT_SECONDS] = "5"
        joiner = subprocess.run([sys.executable, "-c", DYING_JOINER, str(port)], env=env, capture_output=True,
                                text=True, timeout=BOUND_SECONDS)
        assert joiner.returncode == 9, joiner.stdout + joiner.stderr
    else:
        claim_rank(store, None, 0, 1, 1, "joiner:1")
        store.add(f"{generation_prefix(None, 0, 1)}arrived", 1)
    survivor = subprocess.Popen([sys.executable, "-c", SURVIVOR, str(port)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + BOUND_SECONDS
        while store.add(f"{generation_prefix(None, 0, 1)}arrived", 0) < 2:  # the survivor counted in too
            assert time.monotonic() < deadline and survivor.poll() is None, survivor.stdout.read()  # type: ignore[union-attr]
            time.sleep(0.05)
        time.sleep(1.0)  # the survivor is forming the group now, or failed to connect
        # The launchers find the joining node silent and shrink the world again (``NodeWorld.remove``).
        claim_rank(store, None, 0, 2, 1, REMOVED)
        write_layout(store, None, 0, 2, Layout.initial(2).shrunk({1}))
        announce_node_lost(store, None, 0, 1, "node 1's launcher went silent")
        announced = time.monotonic()
        output = survivor.communicate(timeout=BOUND_SECONDS)[0]
        formed_after = time.monotonic() - announced
    finally:
        survivor.kill()
        del store
    assert survivor.returncode == 0, output
    result = _result(output)
    assert result["membership"] == [2, 0, 1, [0, 1]] and result["torch"] == 1, output
    assert formed_after < 10, output  # not the group's timeout (30 minutes), nor (before) the recovery timeout (60 s)
    assert "generation 1 of the group was given up while it formed (node 1's launcher went silent)" in output, output


def test_an_abandoned_group_still_referenced_elsewhere_is_named_and_one_that_is_not_is_freed_quietly() -> None:
    """``Group.abort`` frees the group it leaves from a thread; a group that something else still
    holds (an autograd graph that saved it) keeps its connections open, which holds a survivor
    blocked on this rank: the thread says so, and says nothing when the group was freed."""
    from ddpkit.membership.abandoned import free_in_background

    class Standin:  # what the thread sees of a torch group: an object it holds the only reference to, or not
        pass

    with ddpkit_messages() as messages:
        kept = Standin()
        free_in_background([kept], 3)
        free_in_background([Standin()], 4)
        for thread in PROCESS.connection.freeing[-2:]:
            thread.join(5)
    said = [message for message in messages if "still referenced" in message]
    assert len(said) == 1 and said[0].startswith("ddpkit: the torch group of generation 3, which this rank left"), said


class CountedStore:
    """A launcher's store that counts the requests made of it, by method (the store's own is a HashStore)."""

    def __init__(self) -> None:
        self.store = dist.HashStore()  # type: ignore[attr-defined]
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> object:
        method = getattr(self.store, name)

        def counted(*args: object) -> object:
            self.calls[name] = self.calls.get(name, 0) + 1
            return method(*args)
        return counted


@pytest.mark.parametrize(("members", "fewest", "most"), [(2, 60, 400), (4096, 1, 12)])
def test_a_rank_waiting_for_its_generations_members_asks_the_store_less_often_the_bigger_the_world(
        members: int, fewest: int, most: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank waits a second for the others of generation 1 (they never come): in a world of two it
    counts the arrivals every 5 ms, in a world of 4,096 every 0.82 s and looks at the launchers'
    records every 3.3 s, so that all its members together ask the store at most 10,000 times a
    second (counting every 5 ms and looking every 50 ms, they asked 6e5 times)."""
    from ddpkit.membership.generations import Layout, write_layout
    from ddpkit.membership.group import Group, Membership

    monkeypatch.setenv(DDPKIT_RECOVERY_TIMEOUT_SECONDS, "1")
    store = CountedStore()
    write_layout(store, None, 0, 1, Layout.initial(members))
    group = Group(Membership(0, 0, members), "gloo", timedelta(seconds=30), launcher_store=store, survivors_go_on=True)
    store.calls.clear()
    with pytest.raises(TimeoutError, match=f"only 1 of the {members} ranks arrived for generation 1"):
        group.meet(1)
    requests = sum(store.calls.values())
    assert fewest <= requests <= most, store.calls


def test_a_generations_layout_is_read_back_to_the_last_generation_known_not_to_generation_1() -> None:
    """A rank of generation 40 reads the layout of 41 in two requests (41, then its own 40's known),
    not 41; a layout written for a generation after the known one is still the one read."""
    from ddpkit.membership.generations import Layout, layout_at, write_layout

    store = CountedStore()
    shrunk = Layout.initial(4).shrunk({3})
    write_layout(store, None, 0, 7, shrunk)
    assert layout_at(store, None, 0, 41, 4) == shrunk and store.calls["get"] + store.calls.get("check", 0) >= 35
    store.calls.clear()
    assert layout_at(store, None, 0, 41, 4, known=(40, shrunk)) == shrunk
    assert sum(store.calls.values()) <= 2, store.calls
    grown = shrunk.grown({3})
    write_layout(store, None, 0, 41, grown)
    assert layout_at(store, None, 0, 42, 4, known=(40, shrunk)) == grown
    assert layout_at(store, None, 0, 39, 4, known=(40, shrunk)) == shrunk  # a known generation after it is no help


@pytest.mark.parametrize("world", [4, 8192])
def test_a_layout_is_recorded_in_a_size_of_its_changes_not_of_its_world_and_read_back_the_same(world: int) -> None:
    """Every rank of a generation reads its layout when it counts itself in and at each look: with
    8,192 ranks a record of the whole list (112 KB) made the store serve 900 MB per round and the
    group took 40 s to form at 1,024 simulated nodes. Recorded as runs of members and the shares that
    moved, it stays a few hundred bytes whatever the world, and reads back equal after shrinks
    anywhere in the world and a grow."""
    from ddpkit.membership.generations import Layout

    node = set(range(world // 2, min(world, world // 2 + 8)))  # a node of 8 ranks in the middle
    layouts = [Layout.initial(world), Layout.initial(world).shrunk({world - 1}),
               Layout.initial(world).shrunk(node | {0})]
    layouts.append(layouts[-1].shrunk({world - 1}).grown(node))
    for layout in layouts:
        text = layout.to_json()
        assert Layout.from_json(text) == layout
        assert len(text) <= 600, f"{len(text)} bytes for {len(layout.members)} members"


def test_in_a_big_world_the_last_arrival_reaches_the_waiting_ranks_through_their_launchers_relayed_news(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With 8,192 members a waiting rank counts the arrivals every 1.6 s (``meet_periods``). Under a
    launcher that relays the job's news (``DDPKIT_NEWS_FILE``), the last rank to count itself in
    raises the news, and the waiting rank counts again once its launcher's file changes: here the
    generation forms within a second of the wait's start, not at the next count 1.6 s in."""
    import threading

    from ddpkit.diagnostics.relayed_news import write_news_file
    from ddpkit.membership.generations import Layout, write_layout
    from ddpkit.membership.group import Group, Membership
    from ddpkit.store import keys as store_keys
    from ddpkit.store.job_secret import RecordSigner, job_secret

    members = 8192
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    news_file = tmp_path / "news"
    write_news_file(str(news_file), 0)
    monkeypatch.setenv("DDPKIT_NEWS_FILE", str(news_file))
    write_layout(store, None, 0, 1, Layout.initial(members))
    news_key = store_keys.launchers_news(RecordSigner(job_secret()).namespace)
    group = Group(Membership(0, 0, members), "gloo", timedelta(seconds=30), launcher_store=store, survivors_go_on=True)

    def the_others_arrive_and_the_launcher_relays() -> None:
        time.sleep(0.2)
        store.add(group._prefix(1) + store_keys.ARRIVED, members - 2)  # noqa: SLF001
        # The last of them counts itself in as Group.meet does: it finds itself last and raises the news.
        last = Group(Membership(0, members - 1, members), "gloo", timedelta(seconds=30), launcher_store=store,
                     survivors_go_on=True)
        assert last.meet(1).rank == members - 1
        time.sleep(0.1)  # the launcher's look
        write_news_file(str(news_file), int(store.add(news_key, 0)))

    others = threading.Thread(target=the_others_arrive_and_the_launcher_relays)
    started = time.monotonic()
    others.start()
    membership = group.meet(1)
    waited = time.monotonic() - started
    others.join(10)
    assert membership.rank == 0 and membership.world_size == members
    assert int(store.add(news_key, 0)) == 1  # raised once, by the last arrival
    assert waited < 1.0, f"the generation formed {waited:.2f} s into the wait"
