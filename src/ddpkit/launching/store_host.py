"""The store a launcher hosts for its job: ``python -m ddpkit.launching.store_host ADDRESS PORT``.

``ddpkit run --recovery in-place`` starts this process beside the workers so that the store (a
``torch.distributed.TCPStore``) outlives any one of them: without it, the store lives in rank 0,
and losing rank 0 would lose the group's only meeting point. With ``--nnodes N --max-restarts M``
node 0's launcher starts it, and the launchers of every node agree on restarts through it
(``launching.nodes``). It is a process of its own so that the launcher need not import torch
to host it (see docs/architecture.md; torchrun's agent hosts it itself). Under torchrun's c10d
rendezvous the launcher on the endpoint's host hands it the socket it bound (``--listen-fd``). It
dies with the launcher (``PR_SET_PDEATHSIG``) and otherwise sleeps.
"""

from __future__ import annotations

import signal
import sys
from datetime import timedelta

from ddpkit.launching.worker import die_with_launcher

__all__ = ["main"]


def main(argv: list[str]) -> None:
    handed = len(argv) == 4 and argv[2] == "--listen-fd" and argv[3].isdigit()
    if not (len(argv) == 2 or handed) or not argv[1].isdigit():
        raise SystemExit("usage: python -m ddpkit.launching.store_host ADDRESS PORT [--listen-fd FD]")
    # With --listen-fd, the launcher's socket, bound and listening already (``launching.rendezvous``).
    listen_fd = int(argv[3]) if handed else None
    die_with_launcher()
    import torch.distributed as dist

    # wait_for_workers=False: the workers connect when they are ready; the store just listens.
    store = dist.TCPStore(argv[0], int(argv[1]), is_master=True, timeout=timedelta(minutes=10),  # type: ignore[attr-defined]
                          wait_for_workers=False, master_listen_fd=listen_fd)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while store is not None:
        signal.pause()


if __name__ == "__main__":
    main(sys.argv[1:])
