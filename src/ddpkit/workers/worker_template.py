"""Warm starts: a script's workers forked from one process that has imported torch already.

Importing torch, and ``torch._dynamo`` which any optimizer's first call imports, costs a worker
seconds of CPU before its script runs: at every start, and again at every restart of the job.
``ddpkit run`` therefore starts one *template* per node (``python -m ddpkit.workers.worker
--template``): a process that imports those (and ddpkit's Lightning strategy, with Lightning, when
the script imports Lightning) once, then forks each worker on request. A forked worker is the
worker a fresh interpreter would be: a session of its own, the worker's own environment, its
working directory, the same bootstrap (``workers.worker.main``), which ends the process itself;
numpy's global generator is seeded anew, as Python's ``random`` is by the interpreter. Forking
after importing torch is what every fork-started DataLoader worker does.

The warm spares of in-place recovery (``--spare``) are forked too: a spare is a worker that waits
for its rank, and a fork has nothing left to import, so it is warm at once, after every recovery as
well, and costs the node no interpreter of its own. Its standard input is a pipe from the launcher,
as a fresh spare's is: the template is handed the pipe's end with the request (``SCM_RIGHTS``),
as every worker is handed the standard streams its starter has at that moment (they may have been
redirected since the template started). A function pool's workers (``--serve-functions``:
``launch(fn)``, ``WorkerPool``) are forked the same way, each pool's pipe handed to its worker, from
one template for all the pools of a process (``workers.pool``).
A spare node asks ``forks_at_once`` before it starts its spares: a fork before the template's
imports are done waits for them, and the node must be free to claim a lost node's place meanwhile.

It is not used (each worker is a fresh interpreter, as before) where a fork would not be the same
worker: a torch built for CUDA or ROCm (a library that asks for the devices at import would make
them unusable in a forked child), a program run without ddpkit's bootstrap (``--no-python``), the
workers' streams routed by the launcher (``--tee``, ``--redirects``, ``--log-dir``), a worker
whose environment differs from the template's in a variable that takes effect when an
interpreter or torch starts (``PYTHON*``, ``OMP_*``, ``TORCH_*``, ``LD_*``, ...), or
``DDPKIT_FORK_WORKERS=0``. A template that cannot start, or dies, is replaced by fresh interpreters
for the workers started after; the launcher says so once.

The template's side is the worker bootstrap's (``workers.worker.serve_forks``). It speaks JSON
lines on a socket: the launcher asks ``{"argv": ..., "environment": ..., "cwd": ..., "input": ...}``
(``input``: the request carries the read end of a pipe, the worker's standard input) and is
told ``{"started": pid}``, and ``{"ended": pid, "code": code}`` when a worker ends (the template is the
workers' parent, and reaps them: ``code`` as ``subprocess.Popen``'s ``returncode``). When the
launcher dies the template passes SIGTERM on to each worker, as the kernel would have without it,
and waits for them; a template that dies alone takes its workers with it (SIGKILL), a crash the
launcher restarts or replaces.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from ddpkit.logs import get_logger
from ddpkit.variables import DDPKIT_FORK_WORKERS, DDPKIT_LAUNCHER_PID, DDPKIT_TEMPLATE_SOCKET

__all__ = ["LIGHTNING", "SERVE_FUNCTIONS", "SPARE", "TEMPLATE", "ForkedProcess", "WorkerTemplate", "forking_allowed",
           "imported_packages", "only_the_standard_library", "starts_differently"]

_log = get_logger("launching")

# The argument that makes a worker bootstrap the template of the node's workers.
TEMPLATE = "--template"
# The argument that makes a worker a warm spare (in-place recovery): it waits for a rank to take over.
SPARE = "--spare"
# The argument that makes a worker one of a function pool's (``workers.pool``): it runs the functions it is sent.
SERVE_FUNCTIONS = "--serve-functions"
# Lightning's two package names: a script that imports either has its template import Lightning.
LIGHTNING = frozenset({"lightning", "pytorch_lightning"})
_WORKER_MODULE = "ddpkit.workers.worker"

# Variables read when an interpreter, torch or a library torch loads starts (the thread pools,
# glibc's allocator, the locale, dynamo's and inductor's settings): a worker whose value differs
# from the template's would not be the worker a fresh interpreter is.
_READ_AT_START_PREFIXES = ("PYTHON", "LD_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH_", "TORCHDYNAMO_",
                           "TORCHINDUCTOR_", "PYTORCH_", "CUDA_", "HIP_", "ROCM_", "MALLOC_", "GLIBC_", "LC_")
_READ_AT_START_NAMES = frozenset({"LANG", "LANGUAGE", "TZ", "TMPDIR", "TEMP", "TMP", "HOME"})

# How long the launcher waits for the template's answer to a start (its imports come first).
_ANSWER_SECONDS = 120.0


def starts_differently(template: Mapping[str, str], worker: Mapping[str, str]) -> list[str]:
    """The variables read at an interpreter's or torch's start whose values differ between the
    template's environment and a worker's (sorted; empty: a fork is the same worker)."""
    names = {name for name in (*template, *worker)
             if name in _READ_AT_START_NAMES or name.startswith(_READ_AT_START_PREFIXES)}
    return sorted(name for name in names if template.get(name) != worker.get(name))


def forking_allowed(environment: Mapping[str, str]) -> str | None:
    """Why workers cannot be forked from a template on this machine (None: they can)."""
    if environment.get(DDPKIT_FORK_WORKERS, "1").strip() == "0":
        return f"{DDPKIT_FORK_WORKERS}=0"
    if not sys.platform.startswith("linux"):
        return "not Linux"
    accelerator = _torch_accelerator_build()
    if accelerator:
        return f"torch is built for {accelerator}"
    return None


def _torch_accelerator_build() -> str | None:
    """"CUDA" or "ROCm" when the installed torch is built for one, read from ``torch/version.py``
    without importing torch (the launcher does not); "an unknown build" when it cannot be read."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return "an unknown build"
    try:
        with open(os.path.join(next(iter(spec.submodule_search_locations)), "version.py"), encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return "an unknown build"
    for line in lines:
        name, _, value = line.partition("=")
        name, value = name.split(":")[0].strip(), value.strip()
        if name in ("cuda", "hip") and value and value != "None":
            return "CUDA" if name == "cuda" else "ROCm"
    return None


class ForkedProcess:
    """A worker forked by the template, as the launcher sees it: what it uses of ``subprocess.Popen``."""

    stdout = stderr = None

    def __init__(self, pid: int, template: WorkerTemplate, args: Sequence[str], stdin: IO[bytes] | None = None) -> None:
        self.pid, self.args = pid, list(args)
        self.stdin = stdin  # the write end of a spare's input (``fork(..., with_input=True)``)
        self.returncode: int | None = None
        self._template = template

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._template.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)
        return code


class WorkerTemplate:
    """The launcher's side of a node's template: started with the first worker that can be forked,
    kept across the job's restarts, closed with the launcher (``close``)."""

    def __init__(self, environment: Mapping[str, str]) -> None:
        self._refused = forking_allowed(environment)
        self._environment: dict[str, str] | None = None  # the template's, once started
        self._process: subprocess.Popen[bytes] | None = None
        self._socket: socket.socket | None = None
        self._lock = threading.Lock()
        self._received = b""
        self._ended: dict[int, int] = {}
        self._gone = False
        self._ready = False  # the template said it imported what the workers need

    def prepare(self, command: Sequence[str], environment: Mapping[str, str]) -> None:
        """Start the template for the workers of ``command`` now, so that its imports overlap the
        rendezvous; ``environment`` is theirs but for the variables of each rank and attempt."""
        if self._refused is None and self._process is None and _forkable(command):
            self._start(command, environment)

    def fork(self, command: Sequence[str], environment: Mapping[str, str], with_input: bool = False,
             handed: Mapping[str, int] | None = None) -> ForkedProcess | None:
        """Fork the worker of ``command`` (``python -m ddpkit.workers.worker [--spare] script ...``,
        or a pool's ``--serve-functions``) with ``environment``, its standard input a pipe from here
        when ``with_input`` (the process's ``stdin``), and each descriptor of ``handed`` open in it,
        its number in the variable it is given under (as ``pass_fds`` and that variable would
        hand it to a fresh interpreter); None when it should start as a fresh interpreter instead
        (the module says when)."""
        if self._refused is not None or not _forkable(command):
            return None
        if self._process is None:
            self._start([*command[:3], *_script_of(command)], environment)  # a spare's template is its script's
        if not self._ready:
            self._await_ready()
        if self._refused is not None or self._environment is None:
            return None
        if differing := starts_differently(self._environment, environment):
            _log.debug(f"ddpkit run: a worker starts as a fresh interpreter: {', '.join(differing)} differ from the "
                       "template's")
            return None
        read_end, write_end = os.pipe() if with_input else (-1, -1)
        # What a fresh interpreter would have been given: the standard streams this process has
        # now (a pool's may have been redirected since the template started: pytest's capture),
        # the spare's input in place of this process's, ``handed``, and this process's priority.
        passed: list[tuple[dict[str, int | str], int]] = [({"at": 0}, read_end)] if with_input else []
        passed += [({"at": stream}, stream) for stream in ((1, 2) if with_input else (0, 1, 2)) if _is_open(stream)]
        passed += [({"variable": variable}, descriptor) for variable, descriptor in (handed or {}).items()]
        request = {"argv": list(command[3:]), "environment": dict(environment), "cwd": os.getcwd(),
                   "nice": os.getpriority(os.PRIO_PROCESS, 0), "input": with_input,
                   "descriptors": [how for how, _ in passed]}
        try:
            with self._lock:
                answer = self._ask(request, [descriptor for _, descriptor in passed])
        finally:
            if with_input:
                os.close(read_end)  # the worker's now
        if answer is None:
            if with_input:
                os.close(write_end)
            return None
        return ForkedProcess(answer, self, command, os.fdopen(write_end, "wb") if with_input else None)

    def exit_code(self, pid: int) -> int | None:
        """The exit code of the forked worker ``pid`` (Popen's convention), None while it runs."""
        with self._lock:
            self._read(block=False)
            if pid not in self._ended and self._gone and not _exists(pid):
                # Its template died, and it with the template (its parent-death signal, SIGKILL).
                self._ended[pid] = -signal.SIGKILL
            return self._ended.get(pid)

    def close(self) -> None:
        """End the template (its workers are the launcher's to end first)."""
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.close()
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
            self._process.wait()
        self._socket, self._process = None, None

    def _start(self, command: Sequence[str], environment: Mapping[str, str]) -> None:
        ours, theirs = socket.socketpair()
        template_environment = {**environment, DDPKIT_TEMPLATE_SOCKET: str(theirs.fileno()),
                                DDPKIT_LAUNCHER_PID: str(os.getpid())}
        try:
            self._process = subprocess.Popen([*command[:3], TEMPLATE, *command[3:]], env=template_environment,
                                             pass_fds=[theirs.fileno()], start_new_session=True)
        except OSError as error:
            self._refuse(f"the template could not start ({error})")
            return
        finally:
            theirs.close()
        self._socket, self._environment = ours, dict(environment)

    def forks_at_once(self) -> bool:
        """Whether ``fork`` would answer now rather than wait for the template's imports (torch,
        Lightning: seconds): the template said it is ready (read here without waiting), or there
        is no template to wait for (workers start as fresh interpreters; one that died is given up
        at the fork's first read)."""
        if self._ready or self._refused is not None or self._process is None or self._gone:
            return True
        with self._lock:
            said = [message for message in self._read(block=False) if "ready" in message or "refused" in message]
        if said:
            self._take_readiness(said[0])
        return self._ready

    def _await_ready(self) -> None:
        with self._lock:
            ready = self._receive(lambda message: "ready" in message or "refused" in message)
        self._take_readiness(ready)

    def _take_readiness(self, said: dict[str, Any] | None) -> None:
        """What the template said once its imports were done (None: it ended first)."""
        if said is None:
            self._refuse("the template ended before it was ready")
        elif "refused" in said:
            self._refuse(str(said["refused"]))
        self._ready = True

    def _refuse(self, why: str) -> None:
        self._refused = why
        _log.info(f"ddpkit run: each worker starts as a fresh interpreter: {why}.")
        self.close()

    def _ask(self, request: dict[str, Any], descriptors: Sequence[int]) -> int | None:
        """Send ``request`` with ``descriptors`` (what its "descriptors" says of each, in order) and
        return the pid of the worker started; None when the template is gone."""
        assert self._socket is not None
        data = json.dumps(request).encode() + b"\n"
        try:
            sent = socket.send_fds(self._socket, [data], list(descriptors)) if descriptors else 0
            self._socket.sendall(data[sent:])
        except OSError:
            self._gone = True
        answer = None if self._gone else self._receive(lambda message: "started" in message)
        if answer is None:
            if self._refused is None:
                self._refused = "the template died"
                _log.warning("ddpkit run: the process that forks this node's workers died: the next workers start "
                             "as fresh interpreters.")
            return None
        return int(answer["started"])

    def _receive(self, wanted: Any) -> dict[str, Any] | None:
        """Messages until one ``wanted`` accepts (returned), noting the ends on the way; None when
        the template is gone or silent for ``_ANSWER_SECONDS``."""
        deadline = time.monotonic() + _ANSWER_SECONDS
        while time.monotonic() < deadline:
            for message in self._read(block=True):
                if wanted(message):
                    return message
            if self._gone:
                return None
        return None

    def _read(self, block: bool) -> list[dict[str, Any]]:
        """The messages that arrived (waiting up to 0.1 s for one when ``block``); ends are noted."""
        if self._socket is None or self._gone:
            return []
        ready, _, _ = select.select([self._socket], [], [], 0.1 if block else 0.0)
        if ready:
            try:
                data = self._socket.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                self._gone = True
            self._received += data
        messages = []
        *lines, self._received = self._received.split(b"\n")
        for line in lines:
            message = json.loads(line)
            if "ended" in message:
                self._ended[int(message["ended"])] = int(message["code"])
            messages.append(message)
        return messages


def _forkable(command: Sequence[str]) -> bool:
    """Whether ``command`` runs a script or module through ddpkit's bootstrap with this interpreter,
    waits as a spare for one, or serves a function pool (not a program of its own)."""
    script = _script_of(command)
    return (list(command[:3]) == [sys.executable, "-m", _WORKER_MODULE] and bool(script)
            and (script == [SERVE_FUNCTIONS] or not script[0].startswith("--")))


def _script_of(command: Sequence[str]) -> list[str]:
    """The script (or ``-m module``) and its arguments in a worker's ``command``, a spare's ``SPARE`` left out."""
    return list(command[4:] if len(command) > 3 and command[3] == SPARE else command[3:])


def _is_open(descriptor: int) -> bool:
    try:
        os.fstat(descriptor)
    except OSError:
        return False
    return True


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def imported_packages(argv: list[str]) -> set[str] | None:
    """The top-level packages the script of ``argv`` (a path, or ``-m module``) imports anywhere in
    its source, read without running it, with "." for a relative import; None when its source
    cannot be read."""
    try:
        if argv[0] == "-m":
            spec = importlib.util.find_spec(argv[1])
            path = spec.origin if spec is not None else None
        else:
            path = argv[0]
        with open(path or "", "rb") as handle:
            tree = ast.parse(handle.read())
    except (OSError, SyntaxError, ValueError, ImportError):
        return None
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module.split(".")[0] if node.module and not node.level else ".")
    return names


def only_the_standard_library(packages: set[str] | None) -> bool:
    """Whether ``packages`` (``imported_packages``'s) are Python's standard library alone: a script
    that only starts, writes or waits, which needs neither torch's compiler stack nor ddpkit's
    strategy; False when the source could not be read or it imports relatively."""
    return packages is not None and packages <= sys.stdlib_module_names

