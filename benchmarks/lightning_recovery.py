"""What a rank killed with SIGKILL costs a Lightning ``Trainer``: in-place recovery inside ``Trainer.fit``
beside a restart of every worker (ddpkit's, and torchrun's with Lightning's own strategy).

    python benchmarks/lightning_recovery.py [--runs 3] [--modes in-place restart torchrun] [--steps 40]

A ``LightningModule`` of the 8x1024 MLP of ``ddp_step.py`` (batch 64 per rank, one thread per rank,
SGD with momentum), trained for one epoch of ``--steps`` steps on two ranks by a script this
benchmark writes to a temporary folder, with ``ModelCheckpoint(every_n_train_steps=10,
save_last=True)`` and ``trainer.fit(..., ckpt_path="last")``. A callback appends (step, wall time)
to a file per rank after every step. Per run, one rank (chosen at random) is killed with SIGKILL
right after a random step between 5 and steps - 10 that no checkpoint follows, so that the kill
lands in the next training step (a kill in a save is not in place: tests/test_lightning.py):

- ``in-place``: ``ddpkit run --recovery in-place --max-restarts 1`` with ``ddpkit.lightning.DDPStrategy()``;
- ``restart``: ``ddpkit run --max-restarts 1``, the same strategy: every worker starts again and
  the fit resumes from ``last.ckpt``;
- ``torchrun``: ``torchrun --max-restarts 1`` with ``strategy="ddp"`` (Lightning's, torch's DDP),
  resuming the same way.

Printed per mode, as ``recovery.py`` does: the seconds from the kill to the next step the killed
rank's successor completed, the steps trained twice, the runs that finished, and the largest
difference of the final parameters to a run without the fault (the ``in-place`` command, nothing
killed). Figures, with the command, in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import random
import sys
import textwrap
from typing import Any

from recovery import compare_modes, run_script

from ddpkit.environments import find_free_port

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    steps, strategy_name = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)


    class MLP(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(*[layer for _ in range(8) for layer in (nn.Linear(1024, 1024), nn.ReLU())])

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)


    class Steps(Callback):
        def on_train_start(self, trainer, module):
            with open(f"pid.{trainer.global_rank}", "w") as handle:
                handle.write(str(os.getpid()))
            self.log = open(f"steps.{trainer.global_rank}", "a", buffering=1)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.log.write(f"{trainer.global_step} {time.time()}\\n")


    if strategy_name == "ddpkit":
        import ddpkit.lightning
        strategy = ddpkit.lightning.DDPStrategy()
    else:
        strategy = strategy_name
    rows = torch.randn(steps * 128, 1024, generator=torch.Generator().manual_seed(1))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[Steps(), ModelCheckpoint(dirpath="checkpoints", every_n_train_steps=10,
                                                             save_last=True)])
    module = MLP()
    trainer.fit(module, DataLoader(TensorDataset(rows), batch_size=64), ckpt_path="last")
    if trainer.is_global_zero:
        torch.save(module.state_dict(), "final.pt")
    """
)


def command(mode: str, steps: int) -> list[str]:
    if mode == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
                "--master-port", str(find_free_port()), "train.py", str(steps), "ddp"]
    recovery = ["--recovery", "in-place"] if mode in ("in-place", "fault-free") else []
    return [sys.executable, "-m", "ddpkit", "run", *recovery, "--max-restarts", "1", "--nproc-per-node", "2",
            "train.py", str(steps), "ddpkit"]


def run(mode: str, steps: int, kill: bool, seed: int) -> dict[str, Any] | None:
    """One run; None when it did not finish."""
    chooser = random.Random(seed)
    kill_after = chooser.choice([step for step in range(5, steps - 9) if step % 10])  # no save follows it
    victim = chooser.randrange(2)
    return run_script(f"lightning-{mode}", SCRIPT, command(mode, steps), kill_after if kill else None, victim,
                      timeout=300)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--modes", nargs="+", default=["in-place", "restart", "torchrun"],
                        choices=["in-place", "restart", "torchrun"])
    args = parser.parse_args()
    compare_modes(lambda mode, kill, seed: run(mode, args.steps, kill, seed), args.modes, args.runs, 2000,
                  f"Lightning Trainer, 2 ranks, {args.steps} steps, kill -9 of a random rank after a random step, "
                  f"{args.runs} runs per mode (interleaved)")

if __name__ == "__main__":
    main()
