"""What changes at every backward of one DDP module, in a plain object (``Reducer.step``): writing
attributes of an ``nn.Module`` goes through its registration checks, several microseconds each,
and the hooks read and write these on the hot path."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddpkit.parallel.buckets import Bucket

__all__ = ["StepState"]


@dataclass
class StepState:
    """Bookkeeping of the backward in progress (and of buffers since the last sync)."""

    in_backward: bool = False
    overlap: bool = True  # launch buckets during backward
    defer_copies: bool = False  # copy gradients into buckets only at the end (pre-sync hooks change them)
    debug: bool = False  # debug mode (ddpkit.diagnostics.debug) for this backward: fingerprints before reducing
    elementwise: bool = True  # DDP divides while copying in, and the flags travel in the buffer
    factor: float = 1.0  # what a gradient is multiplied by on its way into its bucket (parallel.bucket_fill)
    next_bucket: int = 0  # the next bucket to launch: its place in Reducer.launch_sequence
    in_flight: list[tuple[Bucket, Any]] = field(default_factory=list)
    buckets_missing_grads: set[int] = field(default_factory=set)  # buckets with a parameter lacking .grad here
    buffers_stale: bool = False  # forwards ran since the last buffer broadcast
    synced_backwards: int = 0  # since construction; the rank with most joined last (see join)
    #: Names in the order their gradients arrived, during the first synchronised backward only.
    observed: list[str] | None = field(default_factory=list)

    # When this backward launched its first bucket, its end began and its last reduction landed
    # (perf_counter; with overlap_optimizer, read after the third synchronised backward: wire_measure).
    first_launch: float | None = None
    backward_ended: float = 0.0
    wire_ended: float = 0.0

    def wire_measure(self) -> float | None:
        """The share of the wire's work from the first launch that backward's own time covered
        (1.0: the wire kept up with backward; 0.3: it went on three times as long), from the last
        backward; None when nothing was launched."""
        if self.first_launch is None or self.wire_ended <= self.first_launch:
            return None
        return max(0.0, min(1.0, (self.backward_ended - self.first_launch) / (self.wire_ended - self.first_launch)))

    def end_backward(self) -> None:
        self.in_backward = False
        self.next_bucket = 0
        self.first_launch = None
        self.in_flight = []
        self.buckets_missing_grads = set()

