"""Rank 0, which hosts the process group's store, killed without a word (SIGKILL): every other rank
raises within 2 s an error that says so (issue 13, item 3), and its process ends.

Bare processes with torchrun's variables (rank 0 hosts the store, as with `ddpkit run` and
`init_dist_connection`), each other rank blocked in one of ddpkit's collectives, a DDP backward
or a barrier when rank 0 dies; a process-group timeout far longer than the bound.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from helpers import start_bare_ranks, wait_then_end_all

BOUND_SECONDS = 2.0

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    import torch.distributed as dist
    import ddpkit

    blocked_in = sys.argv[1]
    folder = os.path.dirname(os.path.abspath(__file__))
    ddpkit.init_dist_connection(ddpkit.detect_environment(), timeout=60)
    rank = dist.get_rank()
    model = ddpkit.DistributedDataParallel(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    if rank == 0:
        time.sleep(0.5)  # the others are blocked by now
        with open(os.path.join(folder, "killed"), "w") as handle:
            handle.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        if blocked_in == "collective":
            ddpkit.sync_ddp(torch.ones(1))
        elif blocked_in == "backward":
            model(torch.randn(8, 4)).sum().backward()
        else:
            ddpkit.barrier()
    except ddpkit.PeerFailedError as error:
        with open(os.path.join(folder, f"freed{rank}"), "w") as handle:
            handle.write(f"{time.time()!r} {type(error).__name__} {error.rank}")
        raise
    """
)


@pytest.mark.parametrize(("world_size", "blocked_in"), [
    (2, "collective"), (2, "backward"), (3, "barrier"),
])
def test_every_rank_says_that_rank_0_is_gone_within_two_seconds(
        tmp_path: Path, world_size: int, blocked_in: str) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    ranks = start_bare_ranks(tmp_path, world_size, blocked_in)
    results = wait_then_end_all(ranks, ranks[1:])
    killed = float((tmp_path / "killed").read_text())
    for rank, (err, ended) in enumerate(results, start=1):
        assert ranks[rank].returncode == 1, (rank, ranks[rank].returncode, err)
        assert "StoreHostGoneError: rank 0, the host of the process group's store at 127.0.0.1:" in err, err
        freed, kind, named = (tmp_path / f"freed{rank}").read_text().split()
        assert (kind, named) == ("StoreHostGoneError", "0")
        assert float(freed) - killed <= BOUND_SECONDS, f"rank {rank} raised {float(freed) - killed:.2f} s after the kill"
        # and its process ends soon after (bounded by the order the test waits in, rank 1 first)
        assert ended - killed <= BOUND_SECONDS + 2, f"rank {rank} ended {ended - killed:.2f} s after the kill"
