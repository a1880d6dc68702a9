"""A failed rank that catches its exception and lives on still frees its peers within a second.

The failed rank raises inside ``ddpkit.guard()`` (or inside the DDP module's forward), catches
the exception as a script that logs it would, and stays alive: its process group stays alive
too (its optimizer imported ``torch._dynamo``, which holds it). Each peer is already blocked in
a collective: one of ddpkit's, a DDP backward, or a barrier. The bound is measured from the
raise on the failed rank to ``PeerFailedError`` on every peer (one machine, one clock), with a
process-group timeout far longer, so only ddpkit's propagation can meet it. Every rank keeps a
reference to the group, as user code does (torch's DDP, a metrics object): then tearing the
group down on the failed rank frees nobody.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import start_bare_ranks, wait_then_end_all
from torch import nn

import ddpkit
from ddpkit.comm.collectives import barrier, sync_ddp
from ddpkit.diagnostics.failures import PeerFailedError
from ddpkit.diagnostics.peer_watch import PEER_FAILED_EXIT_CODE
from ddpkit.hooks import fp16_compress_hook
from ddpkit.testing import WorkerPool

PG_TIMEOUT = 20.0
BOUND_SECONDS = 1.0
LIVES_ON_SECONDS = 2.0  # twice the bound: the peers are freed while it lives


class FailsOnRequest(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 2)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise ValueError(f"rank {dist.get_rank()} broke on purpose")
        return self.layer(x)


def fail_and_live_on(failing_rank: int, where: str, blocked_in: str) -> tuple[str, int | None, float, str]:
    """(what ended this rank's call, the rank it names, the wall-clock time, the text)."""
    kept = dist.group.WORLD  # user code keeps the group, as torch's DDP or a metrics object does  # noqa: F841
    module = FailsOnRequest()
    model = ddpkit.DistributedDataParallel(module)
    if blocked_in == "hooked backward":  # the bucket's reduction is the hook's future, not a Work
        model.register_comm_hook(None, fp16_compress_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # imports torch._dynamo: the group stays referenced
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
    if dist.get_rank() == failing_rank:
        time.sleep(0.5)  # the peers are blocked by now
        raised_at = time.time()
        try:
            if where == "guard":
                with ddpkit.guard():
                    raise ValueError(f"rank {failing_rank} broke on purpose")
            else:
                module.fail = True
                model(torch.randn(8, 4))
        except ValueError as error:
            text = str(error)  # logged, and the script goes on: a finally block, a retry loop, a notebook
        time.sleep(LIVES_ON_SECONDS)
        return "raised", None, raised_at, text
    try:
        if blocked_in == "collective":
            sync_ddp(torch.ones(3))
        elif blocked_in == "hooked backward":
            model(torch.randn(8, 4)).sum().backward()
        elif blocked_in == "backward":
            model(torch.randn(8, 4)).sum().backward()
        else:
            barrier()
    except PeerFailedError as error:
        return "peer", error.rank, time.time(), str(error)
    except Exception as error:  # noqa: BLE001 - reported to the test
        return type(error).__name__, None, time.time(), str(error)
    return "none", None, time.time(), ""


def check(results: list[tuple[str, int | None, float, str]], failing_rank: int) -> None:
    raised_at = results[failing_rank][2]
    assert results[failing_rank][0] == "raised"
    for rank, (kind, named, when, text) in enumerate(results):
        if rank == failing_rank:
            continue
        assert kind == "peer" and named == failing_rank, (rank, kind, text)
        assert text.startswith(f"rank {failing_rank} failed: ValueError: rank {failing_rank} broke on purpose"), text
        assert when - raised_at <= BOUND_SECONDS, f"rank {rank} was freed {when - raised_at:.2f} s after the raise"


@pytest.mark.parametrize(("world_size", "failing_rank", "where", "blocked_in"), [
    (2, 1, "guard", "collective"),
    (2, 0, "guard", "barrier"),
    (2, 0, "forward", "backward"),
    (3, 1, "guard", "backward"),
    (2, 1, "guard", "hooked backward"),
])
def test_peers_are_freed_within_a_second_while_the_failed_rank_lives_on(
        world_size: int, failing_rank: int, where: str, blocked_in: str) -> None:
    with WorkerPool(world_size, timeout=60, pg_timeout=PG_TIMEOUT) as pool:
        check(pool.run(fail_and_live_on, failing_rank, where, blocked_in), failing_rank)


# The same as a user's script, run by `ddpkit run` and as bare processes with torchrun's variables.
SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import torch.distributed as dist
    import ddpkit

    blocked_in, failing_rank = sys.argv[1], int(sys.argv[2])
    folder = os.path.dirname(os.path.abspath(__file__))
    ddpkit.init_dist_connection(ddpkit.detect_environment(), timeout=30)
    rank = dist.get_rank()
    kept = dist.group.WORLD  # held by user code: tearing the group down frees nobody
    model = ddpkit.DistributedDataParallel(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    if rank == failing_rank:
        time.sleep(0.5)  # the others are blocked by now
        with open(os.path.join(folder, "raised"), "w") as handle:
            handle.write(repr(time.time()))
        try:
            with ddpkit.guard():
                raise ValueError(f"rank {rank} broke on purpose")
        except ValueError as error:
            print(f"rank {rank} logged: {error}", flush=True)
        time.sleep(float(os.environ.get("LIVES_ON", "8")))  # alive: a finally block, DataLoader workers, a retry loop
        sys.exit(1)
    try:
        if blocked_in == "torch":
            dist.all_reduce(torch.ones(1))  # the user's own call: out of ddpkit's reach
        else:
            ddpkit.sync_ddp(torch.ones(1))
    except ddpkit.PeerFailedError as error:
        with open(os.path.join(folder, f"freed{rank}"), "w") as handle:
            handle.write(repr(time.time()))
        raise
    """
)


def raised_at(folder: Path) -> float:
    return float((folder / "raised").read_text())


@pytest.mark.parametrize("failing_rank", [1, 0])
def test_without_a_launcher_a_ddpkit_collective_is_freed_within_a_second(tmp_path: Path, failing_rank: int) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    ranks = start_bare_ranks(tmp_path, 2, "ddpkit", str(failing_rank))
    peer = ranks[1 - failing_rank]
    [(err, ended)] = wait_then_end_all(ranks, [peer])
    assert f"PeerFailedError: rank {failing_rank} failed: ValueError: rank {failing_rank} broke on purpose" in err, err
    freed = float((tmp_path / f"freed{1 - failing_rank}").read_text())
    assert freed - raised_at(tmp_path) <= BOUND_SECONDS, freed - raised_at(tmp_path)
    # The uncaught error ends the peer's process too, although the collective it stopped waiting
    # for is still pending in Gloo (finalising would wait for it until the failed process exits).
    assert peer.returncode == 1, (peer.returncode, err)
    assert ended - raised_at(tmp_path) <= 2.0, f"the peer ended {ended - raised_at(tmp_path):.2f} s after the raise"


@pytest.mark.parametrize("failing_rank", [1, 0])
def test_without_a_launcher_the_users_own_blocked_call_ends_its_rank_within_two_seconds(
        tmp_path: Path, failing_rank: int) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    ranks = start_bare_ranks(tmp_path, 2, "torch", str(failing_rank))
    peer = ranks[1 - failing_rank]
    [(err, ended)] = wait_then_end_all(ranks, [peer])
    assert peer.returncode == PEER_FAILED_EXIT_CODE, (peer.returncode, err)
    assert f"rank {failing_rank} failed: ValueError: rank {failing_rank} broke on purpose" in err, err
    assert f"ending rank {1 - failing_rank} (exit code {PEER_FAILED_EXIT_CODE})" in err, err
    assert ended - raised_at(tmp_path) <= 2.0, ended - raised_at(tmp_path)


@pytest.mark.parametrize("blocked_in", ["ddpkit", "torch"])
def test_under_ddpkit_run_the_job_ends_in_seconds_naming_the_failed_rank(tmp_path: Path, blocked_in: str) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    launcher = subprocess.Popen([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", "script.py",
                                 blocked_in, "1"], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
    _, err = launcher.communicate(timeout=60)
    ended = time.time()
    assert launcher.returncode == 1, err
    assert "rank 1 (local rank 1" in err and "failed first with ValueError: rank 1 broke on purpose" in err, err
    # rank 0 ends within 1 s (ddpkit's collective) or 2 s (the user's own), then the launcher stops rank 1
    assert ended - raised_at(tmp_path) <= 3.0, ended - raised_at(tmp_path)


def test_the_watch_can_be_told_to_let_a_blocked_rank_wait(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    ranks = start_bare_ranks(tmp_path, 2, "torch", "1", DDPKIT_PEER_FAILURE_EXIT_SECONDS="0", LIVES_ON="3")
    [(err, ended)] = wait_then_end_all(ranks, [ranks[0]])
    assert ranks[0].returncode not in (0, PEER_FAILED_EXIT_CODE), (ranks[0].returncode, err)
    assert "ending rank 0" not in err, err
    assert ended - raised_at(tmp_path) >= 3.0  # freed only when the failed process exited


def test_a_malformed_exit_setting_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpkit.diagnostics import peer_watch

    monkeypatch.setenv("DDPKIT_PEER_FAILURE_EXIT_SECONDS", "soon")
    with pytest.raises(ValueError, match="DDPKIT_PEER_FAILURE_EXIT_SECONDS='soon' is not a number of seconds"):
        peer_watch._exit_seconds()
