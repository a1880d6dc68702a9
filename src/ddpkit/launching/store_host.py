"""The job's store in a process of its own: the one a launcher hosts (``python -m
ddpkit.launching.store_host ADDRESS PORT``) with the launcher's handle on it (``StoreHost``), and
the one a user runs outside the training nodes (``ddpkit store``: ``serve_outside_nodes``).

``ddpkit run --recovery in-place`` starts this process beside the workers so that the store (a
``torch.distributed.TCPStore``) outlives any one of them: without it, the store lives in rank 0,
and losing rank 0 would lose the group's only meeting point. With ``--nnodes N --max-restarts M``
node 0's launcher starts it, and the launchers of every node agree on restarts through it
(``control_plane.nodes``). It is a process of its own so that the launcher need not import torch
to host it (see docs/architecture.md; torchrun's agent hosts it itself). Under torchrun's c10d
rendezvous the launcher on the endpoint's host hands it the socket it bound (``--listen-fd``).

The workers are its clients: ddpkit's connection keeps its keys under a prefix per attempt, and a
plain torch script's ``env://`` does too once told so (``TORCHELASTIC_USE_AGENT_STORE=True``, as
torchrun's agent tells it) but keeps no keys per attempt. So before the workers start again the
launcher has the host delete every key but the launchers' own (``StoreHost.clear_worker_keys``):
a restarted rank never reads a peer's address from the attempt before.

The process reads one command per line on its standard input (``clear``: answered on its
standard output with ``cleared N``) and ends when that pipe closes, on SIGTERM, or with the
launcher (``PR_SET_PDEATHSIG``). Its standard error goes to a file, whose last line names the
cause when it ends early (``StoreHost.failure``: a port taken, say).

``ddpkit store [--host ADDRESS] [--port PORT]`` keeps the store on a machine that trains nothing
(a head node), for a c10d rendezvous at that address: every training launcher is then its client
(none can claim the endpoint), so that losing any training node, node 0 included, leaves the
meeting point. It serves one job (one ``--rdzv-id``) until it is stopped (SIGINT or SIGTERM);
the launchers clear the workers' keys through their clients between attempts
(``clear_worker_keys``), as they do with a launcher's store across nodes.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import IO, Any

from ddpkit._collector import collector_paused
from ddpkit._network import listen_on
from ddpkit.control_plane.launcher_records import clear_worker_keys
from ddpkit.variables import DDPKIT_LAUNCHER_PID
from ddpkit.workers.linux_process import die_with_parent
from ddpkit.workers.processes import describe_exit

__all__ = ["StoreHost", "StoreHostError", "main", "serve_outside_nodes"]

_CLEAR = "clear"
_SERVING = "serving"
# How long the launcher waits for the host to clear the keys; a host that takes longer is stuck.
_CLEAR_TIMEOUT_SECONDS = 30.0


class StoreHostError(RuntimeError):
    """The store host ended, or did not answer the launcher."""


class StoreHost:
    """The launcher's handle on the process that keeps the job's store at ``address:port``."""

    def __init__(self, address: str, port: int, environment: Mapping[str, str], listen_fd: int | None = None) -> None:
        """Start the process (on the listening socket ``listen_fd`` when given, which it inherits)."""
        self.where = f"{address}:{port}"
        self._errors = tempfile.NamedTemporaryFile(prefix="ddpkit-store-host-", suffix=".log", delete=False)
        handed = [] if listen_fd is None else ["--listen-fd", str(listen_fd)]
        quiet = {} if "TORCH_CPP_LOG_LEVEL" in environment else {"TORCH_CPP_LOG_LEVEL": "ERROR"}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "ddpkit.launching.store_host", address, str(port), *handed],
            env={**environment, **quiet, DDPKIT_LAUNCHER_PID: str(os.getpid())}, start_new_session=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._errors,
            pass_fds=[] if listen_fd is None else [listen_fd])

    @property
    def pid(self) -> int:
        return self._process.pid

    def failure(self) -> str | None:
        """None while the process runs; once it ended, what ended it, for the job's summary."""
        code = self._process.poll()
        if code is None:
            return None
        last = _last_line(self._errors.name)
        return (f"the job's store host (pid {self._process.pid}, {self.where}) {describe_exit(code)}"
                + (f": {last}" if last else "") + ". Every worker reaches its peers through it, so the job ends.")

    def wait_serving(self, timeout: float) -> None:
        """Return once the process serves the store (it imports torch first: seconds on a loaded
        host), so that a launcher that joins its own rendezvous does not spend the other nodes'
        ``join_timeout`` on it. Raises ``StoreHostError`` when it ended, or did not serve within ``timeout``."""
        if not self._answer(_SERVING, timeout):
            raise StoreHostError(self.failure() or f"the job's store host (pid {self._process.pid}, {self.where}) did "
                                 f"not serve within {timeout:g} s.")

    def clear_worker_keys(self) -> int:
        """Delete every key but the launchers' (``launcher_key_prefixes``) before the workers start
        again; the number deleted. Raises ``StoreHostError`` when the host ended or does not answer."""
        stdin = self._process.stdin
        if stdin is None:  # made by __init__: a pipe
            raise StoreHostError("the store host has no command pipe")
        try:
            stdin.write(f"{_CLEAR}\n".encode())
            stdin.flush()
        except OSError:
            pass  # the host ended: ``_answer`` finds no answer
        answer = self._answer("cleared ", _CLEAR_TIMEOUT_SECONDS)
        if not answer:
            raise StoreHostError(self.failure() or f"the job's store host (pid {self._process.pid}, {self.where}) did "
                                 f"not clear the workers' keys within {_CLEAR_TIMEOUT_SECONDS:g} s.")
        return int(answer.split()[1])

    def _answer(self, start: str, timeout: float) -> str:
        """The first line of the process's standard output that starts with ``start`` within
        ``timeout`` seconds (other lines, torch's, are passed over); "" when none came."""
        stdout = self._process.stdout
        deadline = time.monotonic() + timeout
        answer: str | None = ""
        while stdout is not None and answer is not None and not answer.startswith(start):
            try:
                answer = _read_line(stdout, deadline - time.monotonic())
            except OSError:
                answer = None
        if not answer and time.monotonic() < deadline:  # the pipe closed: the process is ending, let ``failure`` see it
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=max(0.0, deadline - time.monotonic()))
        return answer or ""

    def stop(self) -> None:
        """End the process (it keeps nothing worth a graceful end) and forget its error file."""
        with contextlib.suppress(ProcessLookupError):
            self._process.kill()
        self._process.wait()
        for pipe in (self._process.stdin, self._process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self._errors.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._errors.name)


def _read_line(stream: IO[bytes], timeout: float) -> str | None:
    """One line from ``stream`` within ``timeout`` seconds (None when none came, or the pipe closed)."""
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([stream], [], [], remaining)[0]:
            return None
        chunk = os.read(stream.fileno(), 1)
        if not chunk:
            return None
        line += chunk
    return line.decode(errors="replace").strip()


def _last_line(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            lines = [line.strip() for line in handle if line.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _serve(address: str, port: int, listen_fd: int | None) -> Any:
    """The job's store, served from this process (on the listening socket ``listen_fd`` when given).
    wait_for_workers=False: the clients connect when they are ready; the store just listens."""
    with collector_paused():
        import torch.distributed as dist

    return dist.TCPStore(address, port, is_master=True, timeout=timedelta(minutes=10),  # type: ignore[attr-defined]
                         wait_for_workers=False, master_listen_fd=listen_fd)


def serve_outside_nodes(host: str, port: int) -> int:
    """``ddpkit store``: keep a job's store on ``host`` ("" for every interface) and ``port`` until
    SIGINT or SIGTERM; the exit code (2 when it cannot listen there)."""
    from ddpkit.store.client import import_distributed  # torch's C++ logging quiet: this process is a server

    try:
        listener = listen_on(host, port)
    except OSError as error:
        where = host or "every interface"
        print(f"ddpkit store: cannot listen on {where} port {port} ({error.strerror or error}): give --port a free "
              "port, and --host an address of this machine (or leave it out for every interface).", file=sys.stderr)
        return 2
    import_distributed()
    # The store listens on this socket (bound here so that --host is honoured: torch's own bind is on every interface).
    store = _serve(host or "0.0.0.0", port, listener.fileno())
    where = f"{host or socket.gethostname()}:{port}"
    print(f"ddpkit store: serving a job's store on {host or 'every interface'} port {port}. Start each node with "
          f"`ddpkit run --rdzv-backend c10d --rdzv-endpoint {where} --rdzv-id ID ...`; stop this with Ctrl-C once "
          "the job ended (it serves one --rdzv-id).", flush=True)
    stopped = threading.Event()
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, lambda *_: stopped.set())
    while not stopped.wait(1.0):
        pass
    print(f"ddpkit store: stopped ({store.num_keys()} keys were held)", flush=True)
    listener.close()
    return 0


def main(argv: list[str]) -> None:
    handed = len(argv) == 4 and argv[2] == "--listen-fd" and argv[3].isdigit()
    if not (len(argv) == 2 or handed) or not argv[1].isdigit():
        raise SystemExit("usage: python -m ddpkit.launching.store_host ADDRESS PORT [--listen-fd FD]")
    # With --listen-fd, the launcher's socket, bound and listening already (``launching.rendezvous``).
    listen_fd = int(argv[3]) if handed else None
    die_with_parent(int(os.environ.get(DDPKIT_LAUNCHER_PID, "0")), signal.SIGTERM)  # the launcher's child
    store = _serve(argv[0], int(argv[1]), listen_fd)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(_SERVING, flush=True)  # ``StoreHost.wait_serving``
    for line in sys.stdin:  # the launcher's commands; the pipe closes when the launcher ends
        if line.strip() == _CLEAR:
            print(f"cleared {clear_worker_keys(store)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
