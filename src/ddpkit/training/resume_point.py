"""Where in-place recovery continues: the loop's place right after the last optimizer step, and what
the loop does after a recovery (hand out the batches from there again; read the loader anew when
this rank's shares of the data changed). ``ResumableLoop`` asks it where to start and tells it
where it got to; ``InPlaceRecovery`` moves it (a commit, a recovery, the state a replacement receives).
"""

from __future__ import annotations

__all__ = ["ResumePoint"]


class ResumePoint:
    """The (epoch, next batch) right after the last optimizer step (``at``), and what a recovery
    asked of the loop: ``rewind`` (hand out the batches from ``at`` again instead of reading on)
    and ``reshard`` (this rank's shares changed: read the loader anew from ``at``). ``joined``: this
    process replaced a lost rank, and its loop starts at ``at``."""

    def __init__(self) -> None:
        self.at = (0, 0)
        self.rewind = False
        self.reshard = False
        self.joined = False

    def first_epoch(self, start: int) -> int:
        """The epoch the loop starts at: the survivors' in a replacement, else ``start``."""
        return self.at[0] if self.joined else start

    def first_batch(self, epoch: int, skip: int) -> int:
        """The batch ``epoch``'s loop starts at: the survivors' in a replacement's first epoch."""
        if self.joined and self.at[0] == epoch:
            skip = max(skip, self.at[1])
        self.reached(epoch, skip)
        return skip

    def reached(self, epoch: int, batch: int) -> None:
        """The loop is at ``batch`` of ``epoch`` (or past the epoch: the next one's batch 0) with
        nothing trained since the last optimizer step: a rank lost from here on is replaced there."""
        self.at = max(self.at, (epoch, batch))

    def replay_from(self, epoch: int) -> int | None:
        """After a recovery: the batch of ``epoch`` to hand out again from (once); None otherwise.
        ``RuntimeError`` when the ranks continue in another epoch (a collective between epochs)."""
        if not self.rewind:
            return None
        self.rewind = False
        resume_epoch, resume_batch = self.at
        if resume_epoch != epoch:
            raise RuntimeError(
                f"in-place recovery: the ranks continue in epoch {resume_epoch}, but this rank iterates epoch "
                f"{epoch}. Keep collectives between epochs outside the steps, or restart from a checkpoint.")
        return resume_batch

    def take_reshard(self) -> bool:
        """Whether this rank's shares of the data changed in the last recovery (asked once, after
        ``replay_from``): the batches kept since the last optimizer step are not its batches now."""
        reshard, self.reshard = self.reshard, False
        return reshard

    def committed(self, epoch: int, applied_at: tuple[int, int] | None = None) -> int:
        """How many of ``epoch``'s batches an optimizer step has committed (0 in a later epoch's
        terms): with ``applied_at`` (where the last applied commit left the loop, when the last step
        is not applied yet: ``overlap_optimizer``), those never trained again; else those a step was
        called on."""
        at = self.at if applied_at is None else applied_at
        return at[1] if at[0] == epoch else 0
