"""A pool of worker processes for testing multi-rank code, public so users can test theirs.

    from ddpkit.testing import WorkerPool

    def allreduce_ones() -> float:          # module level, so workers can import it
        t = torch.ones(1)
        torch.distributed.all_reduce(t)
        return t.item()

    with WorkerPool(2) as pool:
        assert pool.run(allreduce_ones) == [2.0, 2.0]

The workers start once, meet through a ``FileStore`` in a private temporary folder (no ports, so
parallel test runs cannot collide), run with one thread each and a short process-group timeout,
and stay up between calls. ``run`` is bounded in time: when a rank raises, dies, or does not
answer within ``timeout`` seconds, the whole pool is killed at once (the other ranks are likely
stuck in a collective), ``RankFailedError`` or ``RankTimeoutError`` carries the traceback of the
rank whose failure came first (a rank that died comes before the ranks that only lost their
connection to it) or the stacks of the ranks that hung, and the next ``run`` starts a fresh pool.
The pool is ``launch(fn)``'s engine (``ddpkit.workers.pool``), and its workers are started,
watched and ended like ``ddpkit run``'s (``ddpkit.workers.processes``).
"""

from __future__ import annotations

from ddpkit.workers.pool import RankFailedError, RankTimeoutError, WorkerPool

__all__ = ["RankFailedError", "RankTimeoutError", "WorkerPool"]
