"""News relayed by the launcher (``diagnostics.relayed_news``, issue 62): with a launcher that
relays the job's count of news, quiet ranks' peer and hang watches leave the store alone, and a
failure a rank publishes still ends a peer blocked in its own collective within about a second.

This test plays the launcher's relay itself (it reads the count in the store, as
``control_plane.nodes`` does, and writes the file the workers were given), and every byte the ranks
send the store passes through a counting proxy in this process. The launchers' side runs in every
test across nodes (tests/test_node_restarts.py, tests/test_spare_node.py, ...)."""

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

from ddpkit.diagnostics.relayed_news import write_news_file
from ddpkit.store import keys
from ddpkit.store.job_secret import RecordSigner, job_secret

SECRET = "ab" * 32

SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
import ddpkit
store = dist.TCPStore("127.0.0.1", int(os.environ["PROXY_PORT"]), is_master=False, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
ddpkit.barrier()  # ddpkit's first collective: the peer and hang watches run from here
time.sleep(1.5)  # their first looks
print(f"quiet from {time.time()}", flush=True)
time.sleep(4.0)
print(f"quiet until {time.time()}", flush=True)
if dist.get_rank() == 0:
    kept = dist.distributed_c10d._get_default_group()  # held, so its connections stay open (rank 1 stays blocked)
    try:
        with ddpkit.guard():  # published; this rank catches it and lives on
            print(f"failing at {time.time()}", flush=True)
            raise ValueError("rank 0 fails on purpose")
    except ValueError:
        time.sleep(20)
else:
    dist.all_reduce(torch.ones(1))  # blocked: rank 0 never comes; its peer watch must end this rank
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


def _relay(store: TCPStore, path: str, stop: threading.Event) -> None:
    """What a launcher across nodes does for its workers: the job's count of news, to their file."""
    key = keys.launchers_news(RecordSigner(job_secret({"DDPKIT_JOB_SECRET": SECRET})).namespace)
    relayed = None
    while not stop.wait(0.1):
        count = store.add(key, 0)
        if count != relayed:
            write_news_file(path, count)
            relayed = count


@pytest.mark.timeout(90)
def test_quiet_ranks_leave_the_store_alone_and_a_published_failure_ends_a_blocked_peer_within_a_second(
        tmp_path: Path) -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    proxy = CountingProxy(store.port)
    news_file = str(tmp_path / "news")
    write_news_file(news_file, 0)
    stop = threading.Event()
    threading.Thread(target=_relay, args=(store, news_file, stop), daemon=True).start()
    (tmp_path / "job.py").write_text(SCRIPT)
    environment = {**os.environ, "PROXY_PORT": str(proxy.port), "DDPKIT_NEWS_FILE": news_file,
                   "DDPKIT_JOB_SECRET": SECRET}
    try:
        result = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", "job.py"],
                                cwd=tmp_path, env=environment, text=True, capture_output=True, timeout=60)
        ended = time.time()
    finally:
        stop.set()
    starts = [float(value) for value in re.findall(r"quiet from (\d+\.\d+)", result.stdout)]
    ends = [float(value) for value in re.findall(r"quiet until (\d+\.\d+)", result.stdout)]
    assert len(starts) == len(ends) == 2, result.stdout + result.stderr
    quiet = proxy.bytes_between(max(starts), min(ends))
    # Without the relay each rank's peer watch reads the failure record four times a second and
    # its hang watch counts the requests every second: about 2.3 kB from two ranks in these 4 s.
    assert quiet < 400, f"{quiet} bytes sent to the store by two quiet ranks in {min(ends) - max(starts):.1f} s"
    failing = float(re.findall(r"failing at (\d+\.\d+)", result.stdout)[0])
    assert result.returncode == 1 and "rank 0 fails on purpose" in result.stderr, result.stderr
    assert re.search(r"ending rank 1 \(exit code 69\)", result.stderr), result.stderr
    # The relay (0.1 s) and the watch's look (0.25 s), then the second the watch gives ddpkit to raise
    # in the main thread, and the launcher's end of the job: without news, the watch's next read of
    # the store would come only after relayed_news.FALLBACK_SECONDS (5 s).
    assert ended - failing < 4.0, f"the job ended {ended - failing:.1f} s after rank 0 failed"
