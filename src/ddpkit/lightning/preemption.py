"""Preemption inside ``Trainer.fit``: SIGTERM (or ``DDPKIT_PREEMPTION_SIGNAL``) to ``ddpkit run`` stops every
rank after the same optimizer step through ddpkit's agreement, saves a Lightning checkpoint there
and exits with 75; ``trainer.fit(..., ckpt_path="last")`` then goes on from that very batch.

Lightning's own SIGTERM handling is replaced while the Trainer fits: its handler broadcasts from
inside the signal handler, whatever collective the rank was in, and a preempted run resumed from a
checkpoint taken mid-epoch starts the epoch's data again ("your dataloader is not resumable"). Here
the signal only sets a flag (``PreemptionNotice``), the ranks agree on it once per optimizer step
(``StepAgreement``), and the training loader is ``ResumableBatches``: its state in the checkpoint
says how many of the epoch's batches were trained, and a resumed run skips them."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from ddpkit.diagnostics.failures import PeerLostError
from ddpkit.environments.preemption import PREEMPTED_EXIT_CODE
from ddpkit.logs import get_logger
from ddpkit.training.agreement import PreemptionAgreement

__all__ = ["PreemptionStop", "ResumableBatches"]

_log = get_logger("preemption")


class PreemptionStop(Callback):
    """After each optimizer step, the ranks' agreement on a preemption signal; on it, the checkpoint
    and exit 75 (``SystemExit``, which Lightning lets through after its teardown)."""

    def __init__(self, on_peer_lost: Callable[[PeerLostError], bool] | None = None) -> None:
        self._agreement: PreemptionAgreement | None = None
        self._last_step = -1
        # Under in-place recovery, a rank lost in the agreement's round: the strategy recovers at the
        # next training step (True), and this step is no preemption.
        self._on_peer_lost = on_peer_lost

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._agreement = PreemptionAgreement()  # after Lightning installed its handlers: this one wins
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._agreement is None or trainer.global_step == self._last_step:
            return  # between the micro-batches of an accumulated step: no step to stop after
        self._last_step = trainer.global_step
        try:
            preempted = self._agreement.decide()
        except PeerLostError as lost:
            if self._on_peer_lost is None or not self._on_peer_lost(lost):
                raise
            return
        if not preempted:
            return
        path, resume = checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        _log.warning(f"ddpkit: preempted: every rank stopped after step {trainer.global_step} (epoch "
                     f"{trainer.current_epoch}, batch {batch_idx}); saved {path}. Run the same command again with "
                     f"trainer.fit(..., ckpt_path={resume!r}) to go on from there.")
        self.close()
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.close()

    def close(self) -> None:
        """Give the signals back the handlers they had (Lightning's, while the Trainer fits)."""
        if self._agreement is not None:
            self._agreement.close()
            self._agreement = None


def checkpoint_path(trainer: pl.Trainer) -> tuple[str, str]:
    """Where a preempted run saves, and the ``ckpt_path`` that finds it: ``last.ckpt`` in the first
    ``ModelCheckpoint``'s folder (what ``ckpt_path="last"`` reads), else an HPC checkpoint in
    ``default_root_dir`` (``ckpt_path="hpc"``)."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            return os.path.join(callback.dirpath, f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"), "last"
    return trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir), "hpc"


class ResumableBatches:
    """A training loader whose state is how many batches of which epoch were trained, so that a run
    resumed from a checkpoint taken mid-epoch skips them (Lightning restores a loader's state when it
    has ``state_dict``/``load_state_dict``). They are read and dropped: the sampler's order is the
    loader's business, and a loader whose batches cost much to make pays for those once. Anything
    else is the wrapped loader's (its sampler, whose epoch Lightning sets, its length);
    ``trainer.train_dataloader`` is this object, not a ``DataLoader``.

    ``position()`` says (epoch, batches trained in it) as the Trainer counts them."""

    def __init__(self, loader: Any, position: Callable[[], tuple[int, int]]) -> None:
        self.loader = loader
        self._position = position
        self._resume_at: tuple[int, int] | None = None

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "_position", "_resume_at"):  # not set yet (copying, unpickling)
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        resume_at, self._resume_at = self._resume_at, None
        return self._batches(resume_at)

    def _batches(self, resume_at: tuple[int, int] | None) -> Iterator[Any]:
        # A generator: the loader is read from the first batch asked for on, after Lightning set the
        # sampler's epoch (the epoch's order is drawn when its first index is).
        iterator = iter(self.loader)
        if resume_at is not None:
            epoch, trained = resume_at
            if self._position()[0] == epoch and trained < len(self.loader):
                for _ in range(trained):
                    next(iterator)
        yield from iterator

    def state_dict(self) -> dict[str, int]:
        epoch, trained = self._position()
        return {"epoch": epoch, "batches_trained": trained}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume_at = (int(state["epoch"]), int(state["batches_trained"]))
