"""Bootstrap of every worker that ddpkit starts (``workers.processes``):
``python -m ddpkit.workers.worker script.py [args]`` or ``python -m ddpkit.workers.worker -m module [args]``
for ``ddpkit run`` and in-script launching, ``python -m ddpkit.workers.worker --serve-functions`` for
the function pool of ``launch(fn)`` and ``ddpkit.testing.WorkerPool`` (``workers.pool``);
``python -m ddpkit.workers.worker --template script.py [args]`` for the process that forks a node's
workers (``workers.worker_template``), each of which then comes back here as a worker;
``python -m ddpkit.workers.worker --spare script.py [args]`` for the warm spare of in-place
recovery, which imports torch and ddpkit's training parts (and ddpkit's strategy for Lightning's
Trainer, with Lightning, when the script imports Lightning), then waits for the launcher to write
the variables of the rank it replaces (one JSON line on its standard input) and runs the script.

Before running the script as ``__main__`` (or serving the pool) it (1) asks the kernel to send SIGTERM when the launcher
dies (Linux ``PR_SET_PDEATHSIG``), and exits at once if the launcher is already gone, so no worker
outlives a killed launcher; (2) records an uncaught exception, with its traceback and the time it
happened, in the JSON file the launcher named (``DDPKIT_ERROR_FILE``), so the launcher can name the
root cause: the earliest failure, not the rank that merely lost its peer; (3) publishes that
exception to the other ranks through the process group's store (``ddpkit.diagnostics.failures``); (4) dumps
its threads' stacks to a file on SIGUSR1, for ``ddpkit run``'s stack dumps; (5) when the script
has ended, finishes the process itself (``_finish``), so that a clean script exits 0 every time.
"""

from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import gc
import importlib
import importlib.util
import io
import itertools
import json
import os
import runpy
import select
import signal
import socket
import sys
import traceback
from typing import Any

from ddpkit._collector import collector_paused
from ddpkit.diagnostics.exits import leave
from ddpkit.environments.preemption import PREEMPTED_EXIT_CODE
from ddpkit.logs import get_logger
from ddpkit.variables import DDPKIT_LAUNCHER_PID, DDPKIT_STACK_FILE, DDPKIT_TEMPLATE_SOCKET
from ddpkit.workers.linux_process import die_with_parent, rename_process
from ddpkit.workers.worker_template import (
    LIGHTNING,
    SERVE_FUNCTIONS,
    SPARE,
    TEMPLATE,
    imported_packages,
    only_the_standard_library,
)

_log = get_logger("launching")

# The process a worker forked by the node's template dies with: the template, itself dying with the
# launcher (``DDPKIT_LAUNCHER_PID`` keeps naming the launcher, which a script may signal).
_FORKED_BY: int | None = None


def die_with_launcher() -> None:
    """Ask the kernel for SIGTERM when the launcher dies; exit at once if it is gone already.

    A worker forked by the node's template asks for SIGKILL when the template dies: the template
    passes the launcher's end on as SIGTERM itself (``serve_forks``), so its own death, alone, is a
    crash of the node's workers, which the launcher restarts or replaces, not a preemption."""
    launcher = _FORKED_BY or int(os.environ.get(DDPKIT_LAUNCHER_PID, "0"))
    die_with_parent(launcher, signal.SIGKILL if _FORKED_BY else signal.SIGTERM)


def _dump_stacks_on_request() -> None:
    """On SIGUSR1 (from ``ddpkit run``), write every thread's Python stack to DDPKIT_STACK_FILE.

    faulthandler writes from the signal handler itself, in C, so this works while the main
    thread is blocked in a collective. It keeps a reference to the file, which stays open.
    """
    path = os.environ.get(DDPKIT_STACK_FILE)
    if path:
        faulthandler.register(signal.SIGUSR1, file=open(path, "a", encoding="utf-8"), all_threads=True)


def main(argv: list[str]) -> None:
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit("usage: python -m ddpkit.workers.worker (script.py | -m module) [args...]")
    with collector_paused():  # torch's import, which the failure records need (``ddpkit._collector``)
        from ddpkit.diagnostics.failures import CollectiveFailedError, record_exception, uncaught_failure
    if argv[0] == TEMPLATE:  # the node's template: it forks workers, each of which comes back to main
        die_with_launcher()
        serve_forks(argv[1:])
    _dump_stacks_on_request()
    die_with_launcher()
    if argv[0] == SPARE:
        argv = argv[1:]
        _wait_for_a_rank(argv)
    _rank_read_at_import()
    # What exists now (the bootstrap, and torch, which it imported) lives until the process
    # ends: out of the collector's way, it costs no time in the script's full collections, nor
    # in the look for open files and the collection when the script has ended.
    gc.freeze()
    namespace: dict[str, Any] = {}
    try:
        if argv == [SERVE_FUNCTIONS]:
            from ddpkit.workers.pool import serve  # only a pool's workers need it

            serve()
        elif argv[0] == "-m":  # as `python -m module args`: the module's own sys.argv[0], the cwd on the path
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())
            namespace = runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            namespace = runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_request:
        _finish(_exit_code(exit_request), namespace)
    except BaseException as exc:
        # For the launcher, and (unless it is a consequence, not news to them) for the other ranks,
        # which frees those blocked in collectives.
        # A collective of the script's own that failed because another rank failed or was lost says so.
        exc = uncaught_failure(exc)
        record_exception(exc, publish=not isinstance(exc, CollectiveFailedError))
        traceback.print_exc()
        # Not sys.exit: finalising after a Gloo error can turn the code into an abort (134), and
        # a collective left pending would hold the process until its peers exit. A thread may be
        # blocked in a collective that only this exit ends: not waited for.
        leave(1, wait_for_threads=False)
    _finish(0, namespace)


# For a script that imports Lightning, a spare and a template also import ddpkit's strategy for its
# Trainer (Lightning with it): importing Lightning takes longer than the rest of a worker's way into
# the step. (The launcher's own rule, import no more than it needs, is about the launcher and a
# worker before its script; a spare's and a template's whole point is to have imported them already.)
# What a template or a warm spare imports ahead of the workers' scripts, in its own process (the
# launcher imports none of it): torch, the compiler stack any optimizer's first call imports, and
# the strategy (the DDP module, the collectives, the recovery).
WARM_MODULES = ("torch", "torch._dynamo", "ddpkit.training.strategy")


def _import_ahead(argv: list[str]) -> None:
    """Import what the training script ``argv`` needs: torch, the compiler stack any optimizer's
    first call imports, ddpkit's strategy (the DDP module, the collectives, in-place recovery).
    Only torch, which the bootstrap imports anyway, for a script that imports nothing but the
    standard library: the rest would cost each start seconds of CPU that nothing uses."""
    packages = None if argv == [SERVE_FUNCTIONS] else imported_packages(argv)  # a pool's functions: unknown
    if only_the_standard_library(packages):
        return
    with collector_paused():
        for name in WARM_MODULES:
            importlib.import_module(name)
        if packages and LIGHTNING & packages:
            with contextlib.suppress(ImportError):  # (not installed: the script says so itself)
                importlib.import_module("ddpkit.lightning")


def _wait_for_a_rank(argv: list[str]) -> None:
    """The warm spare: import what the training script ``argv`` needs (seconds, done ahead; nothing
    left when forked from the template), then wait for the launcher to name the rank this process
    replaces; leave quietly when the launcher closes the pipe. While it waits, the process is named
    ``SPARE_NAME`` (``ps``, ``/proc/PID/comm``): a spare forked from the template has the template's
    command line."""
    _import_ahead(argv)
    own_name = rename_process(SPARE_NAME)
    line = sys.stdin.readline()
    if not line.strip():
        os._exit(0)
    rename_process(own_name)
    os.environ.update(json.loads(line))
    sys.stdin = open(os.devnull, encoding="utf-8")  # the pipe was the launcher's, not the script's input


# What a waiting spare is called (its process name: Linux keeps 15 bytes).
SPARE_NAME = b"ddpkit-spare"


# Lightning's modules that note the process's rank when they are imported (``rank_zero_only.rank``,
# from RANK and the like), under both of Lightning's package names.
_RANK_AT_IMPORT = ("lightning.fabric.utilities.rank_zero", "lightning_fabric.utilities.rank_zero")


def _rank_read_at_import() -> None:
    """What a module imported before this process knew its rank (by a warm spare, or the template a
    worker was forked from) noted of the rank at its import, noted again as a fresh import would."""
    for name in _RANK_AT_IMPORT:
        module = sys.modules.get(name)
        if module is not None:
            module.rank_zero_only.rank = module._get_rank() or 0


def _exit_code(exit_request: SystemExit) -> int:
    """The exit code the interpreter would give ``sys.exit(code)`` (a message is printed, code 1)."""
    code = exit_request.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _finish(code: int, namespace: dict[str, Any]) -> None:
    """End this process as the interpreter would after the script, minus its finalisation
    (``diagnostics.exits.leave``: a clean script would otherwise abort now and then at exit).

    After the exit handlers, and after a clean end or a preemption only, a process group the
    script left alive is torn down in order (every rank passes a barrier first). Then the
    script's objects are released, which closes and flushes the files they hold.
    """

    def release_the_script() -> None:
        if code in (0, PREEMPTED_EXIT_CODE):  # a clean end, or one that saved and stopped together
            _tear_down_group()
        namespace.clear()
        _flush_open_files()
        gc.collect()

    leave(code, release_the_script)


def _flush_open_files() -> None:
    """Flush every file object still open, before the garbage collector meets them.

    ``runpy`` hands back a copy of the script's globals; the original stays alive through the
    script's functions (a reference cycle), and with it the files the script never closed.
    The collector finalises such a cycle's objects in no set order: a text file's buffered
    writer may be closed before the text file flushes into it, and the text is lost. The
    interpreter's own exit avoids this by clearing ``__main__``'s globals first.
    """
    tracked = gc.get_objects()
    # By type, not isinstance(): isinstance reads each object's __class__, and some objects warn
    # when touched (torch.distributed.reduce_op prints a FutureWarning at every exit). The types
    # are checked once each, and the objects picked by C-level iteration: there are 10^5 of them.
    file_types = {kind for kind in set(map(type, tracked)) if issubclass(kind, io.IOBase)}
    for candidate in itertools.compress(tracked, map(file_types.__contains__, map(type, tracked))):
        if not candidate.closed:
            with contextlib.suppress(OSError, ValueError):  # unwritable, or not flushable
                candidate.flush()


def _tear_down_group() -> None:
    """``destroy_dist_connection`` of a process group the script left alive; a failure of a peer
    there is the peer's to report (this rank's script succeeded)."""
    import torch.distributed as dist  # imported by ``main`` already

    if not (dist.is_available() and dist.is_initialized()):
        return
    from ddpkit.membership.connection import destroy_dist_connection

    try:
        destroy_dist_connection()
    except RuntimeError as error:
        _log.debug(f"ddpkit: tearing down the process group after the script ended failed: {error}")


# The template of a node's workers (``workers.worker_template``): it forks them.


def serve_forks(argv: list[str]) -> None:
    """The template's life: import what the script ``argv`` needs, say it is ready, then fork a
    worker for each request and report each worker's end, until the launcher closes the socket."""
    connection = socket.socket(fileno=int(os.environ.pop(DDPKIT_TEMPLATE_SOCKET)))
    _import_ahead(argv)
    refused = _why_forking_is_unsafe()
    _send(connection, {"refused": refused} if refused else {"ready": True})
    if refused:
        os._exit(0)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda _signum, _frame: None)
    launcher_gone: list[int] = []  # the launcher died (SIGTERM from the kernel) or closed the socket
    signal.signal(signal.SIGTERM, lambda _signum, _frame: launcher_gone.append(1))
    received, children, passed_on = b"", set[int](), False
    inputs: list[int] = []  # the descriptors that came with requests, in order (a spare's input)
    while not (passed_on and not children):
        ready, _, _ = select.select([wake_read] if launcher_gone else [connection.fileno(), wake_read], [], [], 1.0)
        if wake_read in ready:
            os.read(wake_read, 4096)
        children -= _report_ends(connection)
        if connection.fileno() in ready and not launcher_gone:
            data, descriptors, _, _ = socket.recv_fds(connection, 1 << 16, _MOST_DESCRIPTORS)
            inputs += descriptors
            if not data:
                launcher_gone.append(1)
            received += data
            *requests, received = received.split(b"\n")
            for line in requests:
                request = json.loads(line)
                passed = [(how, inputs.pop(0)) for how in request["descriptors"] if inputs]
                pid = _fork_worker(request, passed, (connection.fileno(), wake_read, wake_write, *inputs))
                for _, descriptor in passed:
                    os.close(descriptor)  # the worker's now
                children.add(pid)
                _send(connection, {"started": pid})
        if launcher_gone and not passed_on:
            # The launcher's end reaches each worker as it would have without a template: SIGTERM
            # (its process only, as the kernel's would), then this process waits for them to end,
            # since its own end would kill them.
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            passed_on = True
    os._exit(0)


def _why_forking_is_unsafe() -> str | None:
    """Why a worker forked now could not be the worker a fresh interpreter is (None: it could)."""
    import torch

    if torch.cuda.is_initialized():
        return "an import initialised CUDA, which a forked worker could not use"
    return None


def _report_ends(connection: socket.socket) -> set[int]:
    """Reap the workers that ended and tell the launcher their codes; their pids."""
    ended: set[int] = set()
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.add(pid)
        _send(connection, {"ended": pid, "code": os.waitstatus_to_exitcode(status)})


def _send(connection: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the launcher is gone: the template dies with it
        connection.sendall(json.dumps(message).encode() + b"\n")


def _take_priority(nice: int) -> None:
    """The starter's scheduling priority, which a fresh interpreter would have inherited: a pool's
    template may have started before its process ran ``nice`` (``os.setpriority``). A priority
    above the template's needs the privilege to raise one (root); without it the worker keeps the
    template's, as close as it may come."""
    if nice != os.getpriority(os.PRIO_PROCESS, 0):
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, 0, nice)


# How many descriptors one read of the launcher's requests takes at most (one per spare asked for).
_MOST_DESCRIPTORS = 16


def _fork_worker(request: dict[str, Any], passed: list[tuple[dict[str, Any], int]],
                 template_files: tuple[int, ...]) -> int:
    """Fork one worker (the child never returns here): its own session, environment, working
    directory, scheduling priority (``nice``) and the descriptors ``passed`` with the request, each
    either at the number it names (``{"at": 1}``: its standard output) or open where it is, its
    number in the variable it names (``{"variable": name}``); then the worker bootstrap, which ends
    the process."""
    template_pid = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a fresh interpreter's (the script may take it)
        for descriptor in template_files:
            os.close(descriptor)
        os.environ.clear()
        os.environ.update(request["environment"])
        # Above the standard streams first: a descriptor received while one of the template's was
        # closed has that number, and a stream put in place before it was moved would replace it.
        moved = [(how, fcntl.fcntl(received, fcntl.F_DUPFD, 3)) for how, received in passed]
        for _, received in passed:
            os.close(received)
        for how, descriptor in moved:
            if "at" in how:
                os.dup2(descriptor, how["at"])
                os.close(descriptor)
            else:
                os.environ[how["variable"]] = str(descriptor)
        if request["input"]:
            sys.stdin = open(0, encoding="utf-8", closefd=False)  # a spare's: the pipe from the launcher
        global _FORKED_BY
        _FORKED_BY = template_pid  # the worker dies with its parent
        os.chdir(request["cwd"])
        _take_priority(request["nice"])
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()  # as a fresh interpreter's import would: its own entropy
        main(request["argv"])  # ends the process itself
    except SystemExit as exit_request:
        code = exit_request.code if isinstance(exit_request.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
