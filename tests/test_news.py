"""A group's news (``store.news``, issue 62): a quiet rank's watches (the peer watch, the hang
watch) wait for news instead of reading the store several times a second, and still wake at once
for a peer's published failure. Measured at the store: every byte the ranks send it passes
through a counting proxy in this process."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.distributed import TCPStore

SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
import ddpkit
store = dist.TCPStore("127.0.0.1", int(os.environ["PROXY_PORT"]), is_master=False, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
ddpkit.barrier()  # ddpkit's first collective: the peer and hang watches run from here
time.sleep(1.0)  # their start
print(f"quiet from {time.time()}", flush=True)
time.sleep(4.0)
print(f"quiet until {time.time()}", flush=True)
if dist.get_rank() == 0:
    with ddpkit.guard():  # published: the other rank, blocked in its own all_reduce, is ended by its peer watch
        print(f"failing at {time.time()}", flush=True)
        raise ValueError("rank 0 fails on purpose")
dist.all_reduce(torch.ones(1))
"""


class CountingProxy:
    """Forwards TCP connections to ``port``, noting when each byte a client sent arrived."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.sent: list[tuple[float, int]] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def bytes_between(self, start: float, end: float) -> int:
        return sum(size for moment, size in list(self.sent) if start <= moment <= end)

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            server = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, counted: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if counted:
                    self.sent.append((time.time(), len(data)))
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.mark.timeout(90)
def test_quiet_ranks_watches_leave_the_store_alone_and_a_published_failure_still_ends_a_blocked_peer_at_once(
        tmp_path: Path) -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    proxy = CountingProxy(store.port)
    (tmp_path / "job.py").write_text(SCRIPT)
    result = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", "job.py"], cwd=tmp_path,
                            env={**os.environ, "PROXY_PORT": str(proxy.port)}, text=True, capture_output=True, timeout=60)
    ended = time.time()
    starts = [float(value) for value in re.findall(r"quiet from (\d+\.\d+)", result.stdout)]
    ends = [float(value) for value in re.findall(r"quiet until (\d+\.\d+)", result.stdout)]
    assert len(starts) == len(ends) == 2, result.stdout + result.stderr
    quiet = proxy.bytes_between(max(starts), min(ends))
    # Before, each rank's peer watch read the failure record 4 times a second and its hang watch
    # counted the requests and published its progress: about 3 kB in these 4 s of two ranks.
    assert quiet < 600, f"{quiet} bytes sent to the store by two quiet ranks in {min(ends) - max(starts):.1f} s"
    assert result.returncode == 1 and "rank 0 (local rank 0" in result.stderr, result.stderr
    assert "failed first with ValueError: rank 0 fails on purpose" in result.stderr, result.stderr
    assert ended - float(re.findall(r"failing at (\d+\.\d+)", result.stdout)[0]) < 5
