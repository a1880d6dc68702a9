"""Scripts under `torchrun --max-restarts`: the restarted attempt forms its group (issue 14).

torchrun's static rendezvous keeps one store for every attempt, and torch's env:// connection
keeps no keys per attempt, so a rank of the restarted attempt could read its peer's address
from the attempt before and fail to connect. ddpkit's connection gives each attempt keys of its
own. Real torchrun, real processes, Gloo.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from ddpkit.environments import find_free_port

SCRIPT = textwrap.dedent(
    """
    import os, signal, time
    import torch
    import torch.distributed as dist
    import ddpkit

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 1 and os.environ["RANK"] == "1":
        time.sleep(6)  # rank 0 looks up rank 1's address first (Gloo's rank 0 connects to rank 1): the attempt before left one
    strategy = ddpkit.DDPStrategy()
    strategy.setup_environment()
    total = torch.ones(1)
    dist.all_reduce(total)
    if attempt == 0 and strategy.global_rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # lost after the group formed: torchrun restarts both
    dist.all_reduce(total)
    print(f"attempt {attempt} rank {strategy.global_rank} total {total.item():g}", flush=True)
    strategy.teardown()
    """
)


def test_a_restarted_attempt_under_torchrun_forms_its_group(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
               "--master-port", str(find_free_port()), str(script)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "attempt 1 rank 0 total 4" in result.stdout and "attempt 1 rank 1 total 4" in result.stdout, result.stdout
