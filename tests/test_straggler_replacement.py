"""A straggling node replaced by a spare node (issue 49, item 4): `ddpkit run --stragglers replace`
on three launchers (`--nnodes 2:3 --rdzv-backend c10d --recovery in-place`, the store outside the
nodes), one rank each; the rendezvous closes with two nodes and the third waits as a spare. Node 1's
data loader is slow on every batch (its disk, as it were: the spare node's is not), so node 0's
launcher names rank 1 a straggler for its data wait and asks node 1 to step aside; the spare takes
its place while rank 0 keeps its process, node 1's launcher ends its workers and leaves (exit 0),
and the run ends with the parameters of one process on the concatenated batches.
Real launchers and workers on Gloo, loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from launchers import (
    assert_as_one_process,
    end_all,
    node_of,
    one_process_reference,
    start_launcher,
    start_store,
    start_together,
    text,
    wait_for,
)
from torch.distributed import TCPStore

from ddpkit.control_plane.node_claims import launcher_of
from ddpkit.control_plane.nodes import NodeCoordination
from ddpkit.environments import find_free_port
from ddpkit.health.job_health import Straggler
from ddpkit.health.straggler_replacement import StepAside
from ddpkit.store.client import BoundedStore, connect

# The jobs' tests run alone: a straggler is named by its step times, and a test beside them would
# slow some rank. The refusals and the answers on a store time nothing.

STEPS, WORLD = 1500, 2  # slow_node_job.py's steps and ranks (its batch is launchers.BATCH)

JOB = Path(__file__).resolve().parent / "slow_node_job.py"  # SLOW_NODE_SECONDS slows a node's data loader

# The launchers' flags, through their variables (``start_launcher`` gives the spare-node tests' command line).
REPLACE = {"DDPKIT_STRAGGLERS": "replace", "DDPKIT_REPORT_EVERY": "1", "DDPKIT_STRAGGLER_FACTOR": "2"}


def run_slowed_job(folder: Path, nnodes: str, spare: bool) -> tuple[list[int], dict[int, str], str, int, int]:
    """Node 1 slowed, under ``--stragglers replace``: two launchers that form the world (``nnodes``),
    then, with ``spare``, a third that waits as a spare node. Their exit codes, their stderr by
    launcher, all of it for a message, and which launchers the rendezvous made node 0 and node 1."""
    (folder / "job.py").write_text(JOB.read_text())
    store = start_store(port := find_free_port())
    try:
        world = {**REPLACE, "SLOW_NODE_SECONDS": "0.015", "STEPS": str(STEPS)}
        launchers = start_together(folder, port, nnodes, 2, nproc_per_node=1, **world)
        if spare:
            wait_for(lambda: all("complete: this is node" in text(folder, f"launcher{n}.err") for n in range(2)),
                     "the rendezvous to close with two nodes")
            launchers.append(start_launcher(folder, port, "launcher2", nnodes, nproc_per_node=1, **REPLACE,
                                            STEPS=str(STEPS)))
        codes = end_all(launchers, timeout=180)
    finally:
        store.kill()
        store.wait()
    errors = {n: text(folder, f"launcher{n}.err") for n in range(len(codes))}
    everything = "\n".join(f"--- launcher{n}\n{errors[n][-3000:]}" for n in errors)
    return codes, errors, everything, node_of(folder, 0), node_of(folder, 1)


@pytest.mark.alone
@pytest.mark.timeout(240)
def test_a_node_named_a_straggler_steps_aside_for_a_spare_node_and_the_run_ends_as_one_process(tmp_path: Path) -> None:
    codes, errors, everything, zero, one = run_slowed_job(tmp_path, "2:3", spare=True)
    assert codes == [0, 0, 0], everything
    assert "ddpkit run: straggler: rank 1 (node 1, host " in errors[zero] and "its data wait" in errors[zero], everything
    assert "asking a waiting spare node to take node 1's place (named a straggler: rank 1" in errors[zero], everything
    assert "node 1's launcher stepped aside (named a straggler" in errors[zero], everything
    assert "node 1's launcher was asked to step aside (named a straggler" in errors[2], everything
    assert "node 1 stepped aside (named a straggler: rank 1" in errors[one], everything
    assert "rank 0 done, recovered True" in text(tmp_path, f"launcher{zero}.out"), everything
    assert "rank 1 done" in text(tmp_path, "launcher2.out"), everything
    assert_as_one_process(tmp_path, everything, one_process_reference(STEPS, WORLD, lr=0.01))


@pytest.mark.alone
@pytest.mark.timeout(240)
def test_without_a_spare_node_the_world_shrinks_without_a_straggling_node_and_the_run_ends_as_one_process(
        tmp_path: Path) -> None:
    """``--nnodes 1:2`` and no spare: node 0's launcher asks node 1 to step aside, no spare claims its
    place, and the world shrinks without it: rank 0 trains both shares of each global batch."""
    codes, errors, everything, zero, one = run_slowed_job(tmp_path, "1:2", spare=False)
    assert codes == [0, 0], everything
    assert "asking a waiting spare node to take node 1's place (named a straggler: rank 1" in errors[zero], everything
    assert "node 1 stepped aside (named a straggler: rank 1" in errors[zero], everything
    assert "and no spare node took its place: the world shrank to 1 ranks" in errors[zero], everything
    assert "node 1 stepped aside (named a straggler: rank 1" in errors[one], everything
    assert "the world shrank without it" in errors[one], everything
    assert "rank 0 done, recovered True" in text(tmp_path, f"launcher{zero}.out"), everything
    assert_as_one_process(tmp_path, everything, one_process_reference(STEPS, WORLD, lr=0.01))


def test_replace_is_refused_without_in_place_recovery_across_nodes_and_only_named_on_one_node(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "ddpkit", "run"]
    refused = subprocess.run([*run, "--nnodes", "2", "--node-rank", "0", "--master-port", str(find_free_port()),
                              "--max-restarts", "1", "--stragglers", "replace", "job.py"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--stragglers replace with --recovery fail-fast" in refused.stderr, refused.stderr
    no_windows = subprocess.run([*run, "--report-every", "0", "--stragglers", "replace", "job.py"],
                                cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert no_windows.returncode == 2 and "--report-every 0 and no --metrics" in no_windows.stderr, no_windows.stderr
    unknown = subprocess.run([*run, "job.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "DDPKIT_STRAGGLERS": "evict"})
    assert unknown.returncode == 2 and "DDPKIT_STRAGGLERS='evict': give name" in unknown.stderr, unknown.stderr
    (tmp_path / "job.py").write_text("print('trained')\n")
    one_node = subprocess.run([*run, "--nproc-per-node", "1", "--stragglers", "replace", "job.py"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert one_node.returncode == 0 and "--stragglers replace on one node: a straggler's ranks cannot leave" in \
        one_node.stderr, one_node.stderr


@pytest.mark.timeout(60)
def test_node_0_the_store_hosts_node_and_a_spent_budget_are_not_replaced_and_a_node_is_asked_once() -> None:
    """Node 0's launcher's answer to each straggler named (``StepAside``), on a real store with three
    beating launchers: node 0 itself (it reports) and the node that hosts the store (the job would
    end with it) are never asked; node 2 is asked once (per launcher there); none is once the job
    may lose no more nodes."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    nodes = [NodeCoordination(BoundedStore(connect("127.0.0.1", store.port, 10), 10), node, 3, "127.0.0.1", store.port,
                              survivors_go_on=True, node_losses_allowed=1) for node in range(3)]
    for coordination in nodes:
        coordination.beat_through(connect("127.0.0.1", store.port, 10))
    try:
        nodes[1].step_asides.say_store_host()
        zero = nodes[0]
        wait_for(lambda: all(zero.heartbeats.last_beat(node) is not None for node in range(3)), "every launcher's beat")
        step_aside = StepAside(zero)

        def straggler(node: int) -> Straggler:
            return Straggler(rank=node, node=node, host="h", phase="data", factor=3.0, since=0.0)

        assert [step_aside(straggler(node)) for node in (0, 1, 2, 2)] == [False, False, True, False]
        beat = zero.heartbeats.last_beat(2)
        assert beat is not None and "named a straggler: rank 2 (node 2, host h)" in (
            zero.step_asides.request(2, launcher_of(beat)) or "")
        assert zero.step_asides.request(1, launcher_of(zero.heartbeats.last_beat(1) or "")) is None
        zero.world.spend_node_loss()
        assert not StepAside(zero)(straggler(2))
    finally:
        for coordination in nodes:
            coordination.heartbeats.stop()
