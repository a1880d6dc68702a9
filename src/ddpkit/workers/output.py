"""Where the workers' standard output and error go: ``ddpkit run``'s ``--log-dir``, ``--redirects``,
``--tee`` and ``--local-ranks-filter``, with torchrun's names and meanings.

By default a worker writes to the launcher's own stdout and stderr, untouched (no pipe, so a
progress bar and a crash's last words behave as in a plain ``python``). For each local rank:

- ``--redirects`` (``-r``) sends the named streams to log files only;
- ``--tee`` (``-t``) sends them to log files and to the console, each console line prefixed with
  the worker's global rank (``[rank1]: ...``), so that interleaved output stays readable;
- ``--local-ranks-filter 0,2`` shows only those local ranks on the console (the others' log files
  are written as usual; what is neither redirected nor teed is dropped).

A stream value is torchrun's: ``0`` none, ``1`` stdout, ``2`` stderr, ``3`` both, for every local
rank; or per local rank, ``0:1,1:2`` (stdout of local rank 0, stderr of local rank 1).

The files are ``<log-dir>/node<N>/attempt_<A>/<local rank>/stdout.log`` and ``stderr.log``
(torchrun's ``attempt_<A>/<local rank>`` tail, under the node's folder rather than a random run
folder: the path is known before the run, and nodes sharing a file system do not clash). A warm
spare of in-place recovery writes under ``spare<K>`` and, once it took a rank, is prefixed with
that rank. Without ``--log-dir`` the files go to a new temporary folder, named in a message.
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import IO, Any

from ddpkit.logs import get_logger
from ddpkit.variables import DDPKIT_STDERR_PREFIXED

__all__ = ["OutputPlan", "Routing", "Streams", "WorkerOutput", "parse_local_ranks", "parse_streams"]

_log = get_logger("launching")


class Streams(enum.IntFlag):
    """Which of a worker's standard streams a setting applies to (torchrun's ``Std``)."""

    NONE = 0
    OUT = 1
    ERR = 2
    BOTH = 3


_STREAM_NAMES = {Streams.OUT: "stdout", Streams.ERR: "stderr"}


def parse_streams(flag: str, value: str, nproc_per_node: int) -> dict[int, Streams]:
    """``--redirects``/``--tee``'s value, for each local rank: ``3``, or ``0:1,1:2``."""
    value = value.strip()
    hint = (f"{flag}={value!r} is not a stream setting. Give 0 (none), 1 (stdout), 2 (stderr) or 3 (both) "
            f"for every local rank, or LOCAL_RANK:VALUE pairs such as 0:3,1:2.")
    try:
        if ":" not in value:
            return dict.fromkeys(range(nproc_per_node), _streams(value or "0"))
        settings = dict.fromkeys(range(nproc_per_node), Streams.NONE)
        for pair in value.split(","):
            rank_text, streams_text = pair.split(":")
            settings[_local_rank(flag, rank_text, nproc_per_node)] = _streams(streams_text)
        return settings
    except ValueError as error:
        raise ValueError(f"{hint} ({error})" if str(error) else hint) from None


def _streams(text: str) -> Streams:
    number = int(text)
    if number not in range(4):
        raise ValueError("")
    return Streams(number)


def _local_rank(flag: str, text: str, nproc_per_node: int) -> int:
    rank = int(text)
    if not 0 <= rank < nproc_per_node:
        raise ValueError(f"local rank {rank} does not exist with --nproc-per-node={nproc_per_node}: use "
                         f"0..{nproc_per_node - 1}")
    return rank


def parse_local_ranks(value: str, nproc_per_node: int) -> frozenset[int] | None:
    """``--local-ranks-filter``'s value (``0,2``): the local ranks shown on the console; None: all."""
    if not value.strip():
        return None
    try:
        return frozenset(_local_rank("--local-ranks-filter", part, nproc_per_node) for part in value.split(","))
    except ValueError as error:
        detail = str(error) if "does not exist" in str(error) else "give local ranks separated by commas, e.g. 0,1"
        raise ValueError(f"--local-ranks-filter={value!r}: {detail}.") from None


@dataclass(frozen=True)
class OutputPlan:
    """Where each local rank's streams go (see the module's docstring)."""

    log_dir: str | None = None
    redirects: dict[int, Streams] = field(default_factory=dict)
    tee: dict[int, Streams] = field(default_factory=dict)
    shown: frozenset[int] | None = None  # local ranks shown on the console; None: all

    def is_default(self) -> bool:
        """Nothing redirected, teed or filtered: the workers write to the launcher's streams."""
        return not self.writes_files() and self.shown is None

    def writes_files(self) -> bool:
        return any(self.redirects.values()) or any(self.tee.values())

    def with_log_dir(self) -> OutputPlan:
        """This plan with a log folder: a new temporary one when files are written and none was given."""
        if self.log_dir is not None or not self.writes_files():
            return self
        folder = tempfile.mkdtemp(prefix="ddpkit-logs-")
        _log.info(f"ddpkit run: the workers' log files are in {folder} (choose the folder with --log-dir)")
        return OutputPlan(folder, self.redirects, self.tee, self.shown)

    def attempt_folder(self, node_rank: int, attempt: int) -> str | None:
        return None if self.log_dir is None else os.path.join(self.log_dir, f"node{node_rank}", f"attempt_{attempt}")

    def routing(self, local_rank: int) -> Routing:
        return Routing(self.redirects.get(local_rank, Streams.NONE), self.tee.get(local_rank, Streams.NONE),
                       self.shown is None or local_rank in self.shown)


@dataclass(frozen=True)
class Routing:
    """One worker's settings: which streams go to files only, which to files and the console, and
    whether what is left reaches the console."""

    redirects: Streams
    tee: Streams
    shown: bool

    def to_file(self, stream: Streams) -> bool:
        return bool(stream & (self.redirects | self.tee))

    def to_console(self, stream: Streams) -> bool:
        return self.shown and (bool(stream & self.tee) or not stream & self.redirects)

    def variables(self) -> dict[str, str]:
        """What the worker is told: whether its stderr lines get the rank prefix here (then ddpkit's
        messages in it leave theirs out, ``ddpkit.logs``)."""
        prefixed = self.shown and bool(Streams.ERR & self.tee)
        return {DDPKIT_STDERR_PREFIXED: "1" if prefixed else "0"}


# A console line starts after a newline, and after a carriage return: a progress bar redraws its
# line with '\r', and each redraw gets the prefix back at its start.
_LINE_ENDS = re.compile(rb"(?<=[\r\n])")


class WorkerOutput:
    """One worker's streams: what to hand ``subprocess.Popen``, and the threads that copy piped
    streams to their file and (prefixed when teed) to the console.

    A worker whose rank is known gets a pipe only for the streams teed to the console; a file or
    nothing otherwise. A warm spare (``routing`` None) gets pipes for both, routed once it takes a
    rank (``assign``): it prints nothing before.
    """

    def __init__(self, folder: str | None, routing: Routing | None, label: str) -> None:
        self.folder = folder
        self.label = label  # the console prefix's name, e.g. rank1
        self._routing = routing
        self._files: list[IO[bytes]] = []
        self._threads: list[threading.Thread] = []

    def assign(self, routing: Routing, label: str) -> None:
        """A spare took a rank: route its output as that rank's from now on."""
        self._routing, self.label = routing, label

    def popen_arguments(self) -> dict[str, Any]:
        """``stdout``/``stderr`` for ``subprocess.Popen``: inherited, a file, a pipe or nothing."""
        arguments: dict[str, Any] = {}
        for stream, name in _STREAM_NAMES.items():
            routing = self._routing
            if routing is None or (routing.to_console(stream) and stream & routing.tee):
                arguments[name] = subprocess.PIPE
            elif routing.to_file(stream):
                arguments[name] = self._open(name)
                self._files.append(arguments[name])
            elif not routing.to_console(stream):
                arguments[name] = subprocess.DEVNULL
        return arguments

    def _open(self, name: str) -> IO[bytes]:
        if self.folder is None:
            raise RuntimeError("OutputPlan.with_log_dir gives a folder to every plan that writes files")
        os.makedirs(self.folder, exist_ok=True)
        return open(os.path.join(self.folder, f"{name}.log"), "ab")

    def started(self, process: subprocess.Popen[bytes]) -> None:
        """Start copying the pipes of ``process``; close the files it now holds (it has its own copies)."""
        for handle in self._files:
            handle.close()
        self._files.clear()
        for pipe, stream, console in ((process.stdout, Streams.OUT, sys.stdout), (process.stderr, Streams.ERR, sys.stderr)):
            if pipe is not None:
                thread = threading.Thread(target=self._copy, args=(pipe, stream, console), daemon=True,
                                          name=f"ddpkit-output-{self.label}-{_STREAM_NAMES[stream]}")
                thread.start()
                self._threads.append(thread)

    def _copy(self, pipe: IO[bytes], stream: Streams, console: IO[str]) -> None:
        at_line_start = True
        log: IO[bytes] | None = None
        try:
            while chunk := os.read(pipe.fileno(), 65536):
                routing = self._routing
                if routing is None:  # a spare that has not taken a rank: nothing is expected
                    routing = Routing(Streams.NONE, Streams.NONE, True)
                if routing.to_file(stream):
                    log = log or self._open(_STREAM_NAMES[stream])
                    log.write(chunk)
                    log.flush()
                if not routing.to_console(stream):
                    continue
                pieces = []
                for piece in _LINE_ENDS.split(chunk) if stream & routing.tee else [chunk]:
                    if piece and at_line_start and stream & routing.tee:
                        pieces.append(f"[{self.label}]: ".encode())
                    if piece:
                        pieces.append(piece)
                        at_line_start = piece.endswith((b"\n", b"\r"))
                with _CONSOLE_LOCK, contextlib.suppress(OSError, ValueError):
                    console.flush()
                    os.write(console.fileno(), b"".join(pieces))
        finally:
            pipe.close()
            if log is not None:
                log.close()

    def close(self, timeout: float = 2.0) -> None:
        """Wait (up to ``timeout`` seconds each) for the copies to reach the end of their pipes."""
        for thread in self._threads:
            thread.join(timeout)


# One worker's chunk is written whole before another's, so lines of different ranks do not mix.
_CONSOLE_LOCK = threading.Lock()
