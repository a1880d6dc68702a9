"""A chaos soak: the example trained under faults drawn at random, and what became of each run.

    python benchmarks/chaos.py --runs N [--seed S] [--skip K] [--epochs 4] [--samples 32768]

Each run trains ``examples/train.py`` (two ranks, a checkpoint after every epoch) with what real
loops add (``--warmup-steps 200``: a learning-rate schedule stepped every step; ``--sync-batchnorm``;
``--all-reduce-loss``: a ``torch.distributed`` collective of the script's own in every step;
``--plain-job`` leaves them out, and the example then checks itself against one process trained on
the same batches) in one of three set-ups, drawn at random:

- one node, ``ddpkit run --nproc-per-node 2 --recovery in-place --max-restarts 3``;
- one node, ``ddpkit run --nproc-per-node 2 --max-restarts 3`` (restart mode);
- two nodes, a launcher with one worker each, ``--nnodes 2 --max-restarts 3``: each in a network
  namespace of its own on a bridge (``netns.Nodes``) when this runs as root with ``ip``, else on
  loopback;
- a world that may shrink: two launchers with one worker each, ``--nnodes 1:2 --recovery in-place
  --max-restarts 3`` at a c10d rendezvous whose store is ``ddpkit store`` outside the nodes
  (loopback): a lost node is left out and the survivor trains its share too.

and meets one to three faults, each at a random time of the run (a fault follows the one before
within two seconds half of the time: during the recovery it started):

- ``kill-worker``: SIGKILL to a rank's process;
- ``kill-in-save``: a rank kills itself (SIGKILL) as its epoch's checkpoint is saved (the
  example's ``--kill-during checkpoint-save``);
- ``kill-in-block``: a rank kills itself (SIGKILL) in the reduction of an epoch's totals, the
  example's block between steps (``strategy.between_steps``; ``--kill-during epoch-totals``);
- ``kill-spare``: SIGKILL to the warm spare (in-place recovery);
- ``kill-launcher``: SIGKILL to a node's ``ddpkit run`` (two nodes; node 0's hosts the store; the
  launchers wait 30 s for one another at the start, ``--rdzv-conf join_timeout=30``; in a world
  that may shrink, not before both launchers are in the job: one killed before it arrives makes a
  job of one node from the start, as ``--nnodes 1:2`` asks, whose result is another one; the
  rendezvous stays open 10 s for the second, ``last_call_timeout=10``: the two start together, but
  on a loaded machine one may reach the store seconds after the other);
- ``freeze``: SIGSTOP to a rank for longer than the hang threshold (``DDPKIT_HANG_SECONDS`` and
  ``DDPKIT_HANG_ABORT_SECONDS`` are 3 here), SIGCONT after it if it still lives;
- ``link-down``: node 1's network link down for 5 s (two nodes in namespaces);
- ``preempt``: SIGTERM to every launcher, then the same command again (it resumes);
- ``disk-full``: the checkpoint folder (a 4 MiB tmpfs) filled up, freed 2-10 s later.

A run ends in one of these ways:

- **exact**: the job finished (after a preemption: the same command again finished) with the
  ranks' parameters identical and within 1e-6 of the fault-free run's (the soak's first run, which
  must match one process trained on the same batches in the plain job). A run whose world shrank
  trains the same batches, but a survivor's one forward over two shares rounds unlike two ranks,
  and training amplifies that from epoch to epoch (the example's own check derives its allowance
  the same way): its parameters at each epoch's end must be within ``ROUNDING_FACTOR`` times the
  gap between the fault-free run and a second fault-free run whose world shrank as it began (two
  roundings of the same training), or 1e-6;
- **ended naming the root cause**: the job ended (a budget spent, the disk full, a node lost)
  with the fault named in its output, and the same command with ``--resume`` then finished exact
  from the checkpoint it left (nothing of the work is lost but the steps since that checkpoint);
- **refused**: the command after the end was refused before it trained, naming why: it formed a
  world whose global batch is not the checkpoint's (``--nnodes 1:2`` run again on the one node
  whose launcher came first), which would train other batches (``DDPStrategy.load_checkpoint``);
- **hung**: a command still running past its bound (then killed);
- **wrong**: anything else: a wrong result, an end that does not name the fault, a checkpoint
  the command after it cannot finish from.

Apart from those, **left behind** counts the runs after which a process of the run was still
alive (its working folder is the run's), a namespace or a mount. Printed: a table per fault kind
(the runs that had it), then ``chaos: N runs: A exact, B ended naming the root cause, R refused
naming why, H hung, W wrong, L left behind``. Runs one at a time; a run takes 10-30 s on two cores.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from _processes import all_pids, descendants, read_proc  # beside this script, as netns
from netns import Nodes

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.py"
EXACT = 1e-6
ROUNDING_FACTOR = 10.0  # as examples/train.py's: the allowance of a shrunk run over the gap of two roundings
KINDS = ["kill-worker", "kill-in-save", "kill-spare", "kill-launcher", "freeze", "link-down", "preempt", "disk-full",
         "kill-in-block"]
# The faults the example injects in itself (once per run): the phase of ``--kill-during`` and where it is.
SELF_KILLS = {"kill-in-save": ("checkpoint-save", "in the save after epoch"),
              "kill-in-block": ("epoch-totals", "in the reduction of the totals (between_steps) of epoch")}
OUTCOMES = ("exact", "ended", "refused", "hung", "wrong")
SETUPS = ["in-place", "restart", "two-nodes", "shrink"]
MULTI_NODE = ("two-nodes", "shrink")
# What the job's output says when a fault of each kind ended it (any one of them).
NAMED = {
    "kill-worker": ["SIGKILL"],
    "kill-in-save": ["SIGKILL"],
    "kill-in-block": ["SIGKILL"],
    "kill-spare": ["SIGKILL"],
    "kill-launcher": ["lost contact with the job's store", "could not reach the job's store", "did not come back",
                      "went silent",
                      "did not reach the job's store", "the preemption came from the workers of a lost launcher"],
    "freeze": ["HangError", "SIGKILL", "SIGSTOP"],
    "link-down": ["lost contact", "did not come back", "HangError", "Connection", "connection"],
    "preempt": ["SIGTERM"],
    "disk-full": ["No space left on device"],
}
# What a resume refused before training says (``DDPStrategy.load_checkpoint``: another world's checkpoint).
SHRANK = "the world shrank"  # a launcher's line when a lost node is left out
REFUSED = "resuming it would train"
HANG_SECONDS = 3
FREEZE_SECONDS = 9  # past the report (3 s) and the abort (3 s more)
LINK_DOWN_SECONDS = 5
DISK_MIB = 4


@dataclass
class Fault:
    kind: str
    at: float  # seconds after the job started
    applied: str = ""  # what was done, or empty when the job had ended before it


@dataclass
class Run:
    index: int
    setup: str
    faults: list[Fault]
    outcome: str = ""
    detail: str = ""
    left_behind: list[str] = field(default_factory=list)
    seconds: float = 0.0


# Processes, from /proc (a run's processes are the launchers' descendants, and anything whose
# working folder is the run's).

def _command_line(pid: int) -> list[str]:
    return read_proc(f"/proc/{pid}/cmdline").split("\0")


def workers_and_spares(launcher: int) -> tuple[list[int], list[int]]:
    """The launcher's worker processes (ranks) and its waiting warm spares, which are named
    ``ddpkit-spare`` while they wait (a spare forked from the template has its command line)."""
    workers, spares = [], []
    for pid in descendants(launcher):
        command = _command_line(pid)
        if "ddpkit.workers.worker" not in command or _is_template(pid, launcher, command):
            continue  # (the node's template forks the workers: it is none of them)
        (spares if read_proc(f"/proc/{pid}/comm").strip() == "ddpkit-spare" else workers).append(pid)
    return workers, spares


def _is_template(pid: int, launcher: int, command: list[str]) -> bool:
    """Whether ``pid`` is the node's template (``workers.worker_template``): the launcher's child
    that forks the workers, which keep its command line."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        return "--template" in command and int(read_proc(f"/proc/{pid}/stat").rsplit(")", 1)[1].split()[1]) == launcher
    return False


def processes_in(folder: Path) -> list[int]:
    """The processes whose working folder is ``folder`` or below it (the run's)."""
    found = []
    for pid in all_pids():
        with contextlib.suppress(OSError):
            if pid != os.getpid() and Path(os.readlink(f"/proc/{pid}/cwd")).is_relative_to(folder):
                found.append(pid)
    return found


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


# One run.

class Job:
    """One command of a run: one launcher per node, each in a session of its own."""

    def __init__(self, folder: Path, setup: str, port: int, extra: list[str], namespaces: Nodes | None,
                 name: str = "first") -> None:
        self.folder, self.namespaces, self.setup = folder, namespaces, setup
        train = [str(EXAMPLE), *extra, "--checkpoint", str(folder / "checkpoint") + os.sep]
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "DDPKIT_HANG_SECONDS": str(HANG_SECONDS),
                       "DDPKIT_HANG_ABORT_SECONDS": str(HANG_SECONDS), "DDPKIT_RECOVERY_TIMEOUT_SECONDS": "15",
                       "DDPKIT_JOB_SECRET": hashlib.sha256(str(folder).encode()).hexdigest(), "PYTHONUNBUFFERED": "1"}
        run = [sys.executable, "-m", "ddpkit", "run"]
        self.store: subprocess.Popen[str] | None = None
        if setup == "shrink":
            self.store = subprocess.Popen([sys.executable, "-m", "ddpkit", "store", "--host", "127.0.0.1", "--port",
                                           str(port)], cwd=folder, env=environment, text=True, start_new_session=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            if self.store.stdout is None or "serving" not in self.store.stdout.readline():
                raise SystemExit(f"chaos: `ddpkit store` did not serve on port {port}")
            commands = [[*run, "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                         f"127.0.0.1:{port}", "--rdzv-id", f"chaos-{name}", "--rdzv-conf",
                         "last_call_timeout=10,join_timeout=30", "--recovery", "in-place", "--max-restarts", "3", *train]
                        for _ in (0, 1)]
        elif setup == "two-nodes":
            address = namespaces.addresses[0] if namespaces else "127.0.0.1"
            commands = [([*(namespaces.prefix(node) if namespaces else []), *run,
                          "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr", address,
                          "--master-port", str(port), "--max-restarts", "3", "--rdzv-conf", "join_timeout=30",
                          *train]) for node in (0, 1)]
        else:
            recovery = ["--recovery", "in-place"] if setup == "in-place" else []
            commands = [[*run, "--nproc-per-node", "2", *recovery, "--max-restarts", "3", *train]]
        self.outputs = [(open(folder / f"{name}.out{node}.txt", "w+"), open(folder / f"{name}.err{node}.txt", "w+"))
                        for node in range(len(commands))]
        self.started = time.monotonic()
        self.launchers = [subprocess.Popen(command, cwd=folder, env=environment, stdout=out, stderr=err,
                                           start_new_session=True)
                          for command, (out, err) in zip(commands, self.outputs, strict=True)]

    def running(self) -> bool:
        return any(launcher.poll() is None for launcher in self.launchers)

    def formed(self) -> bool:
        """Whether every launcher is in the job: in a world that may shrink, each said which node of
        the rendezvous it is (elsewhere the launchers wait for one another: always true)."""
        if self.setup != "shrink":
            return True
        said = []
        for _, stderr in self.outputs:
            with open(stderr.name) as text:
                said.append(re.search(r"rendezvous .* complete: this is node \d+ of 2", text.read()) is not None)
        return all(said)

    def wait(self, bound: float) -> bool:
        """Until every launcher ended (True) or ``bound`` seconds passed since the start (False)."""
        while self.running():
            if time.monotonic() - self.started > bound:
                return False
            time.sleep(0.05)
        return True

    def diagnose(self) -> str:
        """What a hung command's processes were doing: each one's state and kernel wait, and the
        workers' Python stacks (SIGUSR1 asks ``ddpkit run`` for them)."""
        for launcher in self.launchers:
            _signal(launcher.pid, signal.SIGUSR1)
        time.sleep(3)
        lines = []
        for node, launcher in enumerate(self.launchers):
            for pid in [launcher.pid, *descendants(launcher.pid)]:
                state = read_proc(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()[:1]
                lines.append(f"node {node} pid {pid} state {state} wchan {read_proc(f'/proc/{pid}/wchan')}: "
                             f"{' '.join(_command_line(pid))[:100]}")
        return "\n".join(lines)

    def kill_all(self) -> None:
        for launcher in self.launchers:
            for pid in [launcher.pid, *descendants(launcher.pid)]:
                _signal(pid, signal.SIGKILL)
                _signal(pid, signal.SIGCONT)
        for launcher in self.launchers:
            launcher.wait()
        self.stop_store()

    def stop_store(self) -> None:
        """The ``ddpkit store`` of a world that may shrink, once the launchers ended."""
        if self.store is not None and self.store.poll() is None:
            self.store.terminate()
            try:
                self.store.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.store.kill()
                self.store.wait()

    def text(self) -> tuple[str, str]:
        self.stop_store()
        out, err = "", ""
        for stdout, stderr in self.outputs:
            stdout.seek(0)
            stderr.seek(0)
            out, err = out + stdout.read(), err + stderr.read()
            stdout.close()
            stderr.close()
        return out, err

    def codes(self) -> list[int]:
        return [launcher.returncode for launcher in self.launchers]


def summary_of(out: str) -> dict[str, object] | None:
    line = next((line for line in out.splitlines() if line.startswith("summary ")), None)
    return None if line is None else json.loads(line.removeprefix("summary "))


@dataclass
class Reference:
    """The fault-free run: its final parameters and buffers (``final``) and its parameters at the end
    of each epoch (``epochs``); ``allowed`` is how far a run whose world shrank may be from those."""

    final: torch.Tensor
    epochs: list[torch.Tensor]
    base: Path
    train: list[str]
    _allowed: list[float] | None = None

    def allowed(self) -> list[float]:
        """Per epoch, ``ROUNDING_FACTOR`` times the gap to a fault-free run that shrank as it began
        (or ``EXACT``): trained when a run first needs it."""
        if self._allowed is None:
            other = shrunk_from_the_start(self.base, self.train)
            self._allowed = [max(EXACT, ROUNDING_FACTOR * (mine - theirs).abs().max().item())
                             for mine, theirs in zip(other, self.epochs)]
        return self._allowed


def exact(codes: list[int], out: str, folder: Path, reference: Reference | None,
          shrank: bool = False) -> tuple[bool, str]:
    """Whether a finished command trained as it should: its ranks identical, and its parameters within
    ``EXACT`` of one process's (the example's own check, when it makes one) and of ``reference``
    (the fault-free run's, when given: read from the checkpoint written after the last epoch; a run
    whose world ``shrank``: each epoch's within the reference's allowance)."""
    summary = summary_of(out)
    if summary is None or any(codes):
        return False, f"exit codes {codes}, summary {summary}"
    difference = summary["max_difference"]
    good = summary["identical"] is True and (difference is None or difference <= EXACT)
    detail = f"identical {summary['identical']}, max difference to one process {difference}"
    if reference is not None and shrank:
        epochs = trajectory_of(folder)
        gaps = [(mine - theirs).abs().max().item() for mine, theirs in zip(epochs, reference.epochs)]
        worst = max((gap / allowed for gap, allowed in zip(gaps, reference.allowed())), default=float("inf"))
        good = good and len(gaps) == len(reference.epochs) and worst <= 1.0
        detail = (f"{detail}; the world shrank: to the fault-free run per epoch {', '.join(f'{g:.1e}' for g in gaps)}, "
                  f"at most {worst:.2f} of the allowance rounding explains")
    elif reference is not None:
        fault_free = (final_parameters(folder) - reference.final).abs().max().item()
        good, detail = good and fault_free <= EXACT, f"{detail}, to the fault-free run {fault_free:.2e}"
    return good, detail


def trajectory_of(folder: Path) -> list[torch.Tensor]:
    """The parameters at the end of every epoch, from the checkpoint written after the last one."""
    state = torch.load(folder / "checkpoint" / "checkpoint.pt", map_location="cpu", weights_only=False)
    return [epoch.double() for epoch in state["trajectory"]["epochs"]]


def final_parameters(folder: Path) -> torch.Tensor:
    """The parameters in the checkpoint the example wrote after its last epoch, flat."""
    state = torch.load(folder / "checkpoint" / "checkpoint.pt", map_location="cpu", weights_only=False)["model"]
    return torch.cat([value.flatten().double() for value in state.values()])


class Injector(threading.Thread):
    """Applies a run's faults at their times while its first command runs."""

    def __init__(self, job: Job, faults: list[Fault], disk: Path | None, chooser: random.Random) -> None:
        super().__init__(daemon=True)
        self.job, self.faults, self.disk, self.chooser = job, faults, disk, chooser
        self.cleanups: list[tuple[float, str, int]] = []  # (when, what, pid): SIGCONT, link up, disk freed

    def run(self) -> None:
        pending = sorted(self.faults, key=lambda fault: fault.at)
        while self.job.running() and (pending or self.cleanups):
            now = time.monotonic() - self.job.started
            for cleanup in [cleanup for cleanup in self.cleanups if cleanup[0] <= now]:
                self.cleanups.remove(cleanup)
                self._clean(cleanup[1], cleanup[2])
            # A launcher killed before it arrived makes a smaller job (--nnodes 1:2 starts with MIN, as
            # torchrun's), not a loss: it waits until both are in the job.
            if pending and pending[0].at <= now and (pending[0].kind != "kill-launcher" or self.job.formed()):
                fault = pending.pop(0)
                fault.applied = self._apply(fault, now)
            time.sleep(0.02)
        self.finish()

    def finish(self) -> None:
        """Undo what is still in force (the job ended first): thaw, link up, disk freed."""
        for _, what, pid in self.cleanups:
            self._clean(what, pid)
        self.cleanups.clear()

    def _clean(self, what: str, pid: int) -> None:
        if what == "thaw":
            _signal(pid, signal.SIGCONT)
        elif what == "link-up" and self.job.namespaces is not None:
            self.job.namespaces.link(1, up=True)
        elif what == "free-disk" and self.disk is not None:
            with contextlib.suppress(OSError):
                (self.disk / "filler").unlink()

    def _apply(self, fault: Fault, now: float) -> str:
        launchers = [launcher.pid for launcher in self.job.launchers if launcher.poll() is None]
        if not launchers:
            return ""
        if fault.kind in ("kill-worker", "freeze"):
            workers = [pid for launcher in launchers for pid in workers_and_spares(launcher)[0]]
            if not workers:
                return ""
            pid = self.chooser.choice(workers)
            if fault.kind == "kill-worker":
                return f"SIGKILL to worker {pid}" if _signal(pid, signal.SIGKILL) else ""
            if _signal(pid, signal.SIGSTOP):
                self.cleanups.append((now + FREEZE_SECONDS, "thaw", pid))
                return f"SIGSTOP to worker {pid} for {FREEZE_SECONDS} s"
            return ""
        if fault.kind == "kill-spare":
            spares = [pid for launcher in launchers for pid in workers_and_spares(launcher)[1]]
            return f"SIGKILL to spare {spares[0]}" if spares and _signal(spares[0], signal.SIGKILL) else ""
        if fault.kind == "kill-launcher":
            pid = self.chooser.choice(launchers)
            node = [launcher.pid for launcher in self.job.launchers].index(pid)
            return f"SIGKILL to node {node}'s launcher" if _signal(pid, signal.SIGKILL) else ""
        if fault.kind == "preempt":
            for pid in launchers:
                _signal(pid, signal.SIGTERM)
            return f"SIGTERM to {len(launchers)} launcher(s)"
        if fault.kind == "link-down" and self.job.namespaces is not None:
            self.job.namespaces.link(1, up=False)
            self.cleanups.append((now + LINK_DOWN_SECONDS, "link-up", 0))
            return f"node 1's link down for {LINK_DOWN_SECONDS} s"
        if fault.kind == "disk-full" and self.disk is not None:
            with contextlib.suppress(OSError), open(self.disk / "filler", "wb") as filler:
                while True:
                    filler.write(b"\0" * 65536)
                    filler.flush()
            freed = self.chooser.uniform(2, 10)
            self.cleanups.append((now + freed, "free-disk", 0))
            return f"checkpoint disk full for {freed:.1f} s"
        return ""


@contextlib.contextmanager
def small_disk(folder: Path, wanted: bool) -> Iterator[Path | None]:
    """The checkpoint folder, a tmpfs of DISK_MIB when ``wanted`` (and possible: root)."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = wanted and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MIB}m", "tmpfs", str(folder)],
                                        capture_output=True, timeout=30).returncode == 0
    try:
        yield folder if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30)


def plan(index: int, chooser: random.Random, duration: float, namespaces: bool, disk: bool) -> Run:
    setup = chooser.choice(SETUPS)
    possible = [kind for kind in KINDS
                if not (kind == "kill-spare" and setup not in ("in-place", "shrink"))
                and not (kind == "kill-launcher" and setup not in MULTI_NODE)
                and not (kind == "link-down" and (setup != "two-nodes" or not namespaces))
                and not (kind == "disk-full" and not disk)]
    faults: list[Fault] = []
    for _ in range(chooser.randint(1, 3)):
        kind = chooser.choice(possible)
        if kind in SELF_KILLS and any(fault.kind in SELF_KILLS for fault in faults):
            kind = "kill-worker"  # the example kills itself once per run
        follows = faults and chooser.random() < 0.5  # during the recovery the fault before started
        at = faults[-1].at + chooser.uniform(0.1, 2.0) if follows else chooser.uniform(0.5, duration)
        faults.append(Fault(kind, at))
    return Run(index, setup, faults)


def execute(run: Run, base: Path, train: list[str], epochs: int, bound: float, namespaces: Nodes | None,
            chooser: random.Random, reference: Reference) -> None:
    folder = base / f"run{run.index}"
    folder.mkdir()
    try:
        _execute(run, folder, train, epochs, bound, namespaces, chooser, reference)
    except BaseException:  # interrupted (Ctrl-C, SIGTERM): nothing of the run may outlive the soak
        end_all(folder)
        raise


def end_all(folder: Path) -> list[int]:
    """SIGKILL to every process of ``folder`` (a launcher may start a worker between two looks):
    those there were."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut this short
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ended: list[int] = []
    for _ in range(10):
        if not (left := processes_in(folder)):
            break
        for pid in left:
            _signal(pid, signal.SIGKILL)
            _signal(pid, signal.SIGCONT)
        ended += left
        time.sleep(0.2)
    return ended


def _execute(run: Run, folder: Path, train: list[str], epochs: int, bound: float, namespaces: Nodes | None,
             chooser: random.Random, reference: Reference) -> None:
    started = time.monotonic()
    extra = list(train)
    self_kill = next((fault for fault in run.faults if fault.kind in SELF_KILLS), None)
    if self_kill is not None:
        epoch = chooser.randint(1, max(1, epochs - 1))
        steps_per_epoch = int(train[train.index("--samples") + 1]) // 2 // 64
        phase, where = SELF_KILLS[self_kill.kind]
        extra += ["--kill-at-step", str(epoch * steps_per_epoch), "--kill-during", phase,
                  "--kill-rank", str(chooser.randint(0, 1))]
        self_kill.applied = f"rank kills itself {where} {epoch}"
    from ddpkit.environments import find_free_port

    with small_disk(folder / "checkpoint", any(fault.kind == "disk-full" for fault in run.faults)) as disk:
        in_namespaces = namespaces is not None and run.setup == "two-nodes"
        # A fresh namespace has every port free; a port per command all the same (the last one's may linger).
        ports = [20000 + 2 * run.index, 20001 + 2 * run.index] if in_namespaces else [
            find_free_port("127.0.0.1"), find_free_port("127.0.0.1")]
        port = ports[0]
        job = Job(folder, run.setup, port, extra, namespaces if run.setup == "two-nodes" else None)
        injector = Injector(job, [fault for fault in run.faults if fault.kind not in SELF_KILLS], disk, chooser)
        injector.start()
        finished = job.wait(bound)
        if not finished:
            processes = job.diagnose()
            job.kill_all()
        injector.join(timeout=30)
        injector.finish()
        out, err = job.text()
        codes = job.codes()
        if not finished:
            run.outcome, run.detail = "hung", f"past {bound:.0f} s; its processes:\n{processes}\nlast output: {err[-3000:]}"
        elif all(code == 0 for code in codes):
            good, run.detail = exact(codes, out, folder, reference, SHRANK in err)
            run.outcome = "exact" if good else "wrong"
        else:
            preempted = all(code == 75 for code in codes)
            kinds = {fault.kind for fault in run.faults if fault.applied}
            # Every launcher killed by the soak itself: no one was left to name anything.
            all_killed = "kill-launcher" in kinds and all(code == -signal.SIGKILL for code in codes)
            named = preempted or all_killed or any(pattern in err for kind in kinds for pattern in NAMED[kind])
            again = Job(folder, run.setup, ports[1], extra if preempted else [*train, "--resume"],
                        namespaces if run.setup == "two-nodes" else None, "again")
            finished_again = again.wait(bound)
            if not finished_again:
                again.kill_all()
            out2, err2 = again.text()
            good, detail = exact(again.codes(), out2, folder, reference, SHRANK in err or SHRANK in err2)
            refusal = next((line for line in err2.splitlines() if REFUSED in line), None)
            if not finished_again:
                run.outcome, run.detail = "hung", f"the command after the end, past {bound:.0f} s: {err2[-400:]}"
            elif not good and refusal is not None:
                run.outcome, run.detail = "refused", f"the command after the end (codes {codes}): {refusal}"
            elif not good:
                run.outcome, run.detail = "wrong", f"the command after the end (codes {codes}): {detail}; {err2[-600:]}"
            elif preempted:
                run.outcome, run.detail = "exact", "preempted, then the same command finished: " + detail
            elif named:
                run.outcome, run.detail = "ended", f"codes {codes}, then --resume finished: {detail}"
            else:
                run.outcome, run.detail = "wrong", f"ended (codes {codes}) without naming the fault: {err[-800:]}"
    time.sleep(1.0)  # a process on its way out
    for pid in processes_in(folder):
        run.left_behind.append(f"{pid} {' '.join(_command_line(pid))[:120]}")
        _signal(pid, signal.SIGKILL)
        _signal(pid, signal.SIGCONT)
    if subprocess.run(["mountpoint", "-q", str(folder / "checkpoint")], capture_output=True).returncode == 0:
        run.left_behind.append("the checkpoint tmpfs is still mounted")
    run.seconds = time.monotonic() - started


def calibrate(base: Path, train: list[str]) -> tuple[float, Reference]:
    """The fault-free run's duration (seconds) and what runs are compared with (``Reference``); it
    must finish, identical on its ranks (and, in the plain job, within ``EXACT`` of one process)."""
    folder = base / "fault-free"
    folder.mkdir()
    job = Job(folder, "restart", 0, train, None)
    if not job.wait(600):
        job.kill_all()
        raise SystemExit("chaos: the fault-free run did not finish within 600 s")
    out, err = job.text()
    good, detail = exact(job.codes(), out, folder, None)
    if not good:
        raise SystemExit(f"chaos: the fault-free run is not exact ({detail}):\n{err[-2000:]}")
    return time.monotonic() - job.started, Reference(final_parameters(folder), trajectory_of(folder), base, train)


def shrunk_from_the_start(base: Path, train: list[str]) -> list[torch.Tensor]:
    """A second rounding of the fault-free training, for the allowance of runs whose world shrank:
    the world that may shrink, one node (its launcher and every process it started) SIGKILLed as
    soon as the ranks train (rank 0 draws the progress; killed before its launcher reached the
    job's store, a node is not left out: the job ends), the survivor training both shares from its
    first steps on. Its parameters at each epoch's end."""
    from ddpkit.environments import find_free_port

    folder = base / "shrunk-from-the-start"
    folder.mkdir()
    job = Job(folder, "shrink", find_free_port("127.0.0.1"), train, None)
    while job.running() and time.monotonic() - job.started < 120 and not any(
            "epoch 1:" in Path(stderr.name).read_text() for _, stderr in job.outputs):
        time.sleep(0.02)
    # The whole node: a launcher killed alone leaves its workers a SIGTERM from the kernel, and when
    # their preemption is agreed before the launcher's silence is (2 s), the job stops with 75
    # instead of shrinking (docs/never-lose-work.md).
    node = job.launchers[1].pid
    for pid in [node, *descendants(node)]:
        _signal(pid, signal.SIGKILL)
    if not job.wait(600):
        job.kill_all()
        raise SystemExit("chaos: the fault-free run that shrank as it began did not finish within 600 s")
    out, err = job.text()
    if SHRANK not in err or summary_of(out) is None:
        raise SystemExit(f"chaos: the fault-free run that shrank as it began did not shrink and finish:\n{err[-2000:]}")
    return trajectory_of(folder)


def table(runs: list[Run]) -> str:
    rows = [f"{'fault':<14}{'applied':>8}{'runs':>6}{'exact':>7}{'ended':>7}{'refused':>9}{'hung':>6}{'wrong':>7}"
            f"{'left':>6}"]
    for kind in KINDS:
        having = [run for run in runs if any(fault.kind == kind and fault.applied for fault in run.faults)]
        applied = sum(fault.kind == kind and bool(fault.applied) for run in runs for fault in run.faults)
        if not applied:
            continue
        count = {outcome: sum(run.outcome == outcome for run in having) for outcome in OUTCOMES}
        rows.append(f"{kind:<14}{applied:>8}{len(having):>6}{count['exact']:>7}{count['ended']:>7}{count['refused']:>9}"
                    f"{count['hung']:>6}"
                    f"{count['wrong']:>7}{sum(bool(run.left_behind) for run in having):>6}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None, help="the faults' draw (a new one when not given)")
    # Training long enough (1024 steps, seconds) that most faults land in it rather than in the start.
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=32768)
    parser.add_argument("--skip", type=int, default=0, metavar="K",
                        help="start at run K of the seed's draw (to go on with a soak that was stopped)")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders (outputs, checkpoints)")
    parser.add_argument("--verbose", action="store_true", help="say what each fault did and how each run ended")
    parser.add_argument("--plain-job", action="store_true",
                        help="train the example without a schedule, synchronised batch norm and a collective of its own")
    args = parser.parse_args()
    # SIGTERM as Ctrl-C: the runs' processes, the namespaces and the mounts are removed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10 ** 6)
    # The plans (set-ups, faults, times) come from the seed alone; the choices made while a run goes
    # on (which worker, when the disk is freed) from a stream of their own.
    planner, chooser = random.Random(seed), random.Random(seed + 1)
    train = ["--epochs", str(args.epochs), "--samples", str(args.samples)]
    if not args.plain_job:
        train += ["--warmup-steps", "200", "--sync-batchnorm", "--all-reduce-loss"]
    no_namespaces = Nodes.unavailable()
    no_disk = None if os.geteuid() == 0 and shutil.which("mount") else "needs root to mount a small tmpfs"
    for kind, why in (("link-down", no_namespaces), ("disk-full", no_disk)):
        if why:
            print(f"chaos: no {kind} faults: {why}; two nodes run on loopback" if kind == "link-down"
                  else f"chaos: no {kind} faults: {why}", flush=True)
    base = Path(tempfile.mkdtemp(prefix="ddpkit-chaos-"))
    runs: list[Run] = []
    try:
        duration, reference = calibrate(base, train)
        bound = 3 * duration + 90
        print(f"chaos: seed {seed}; the fault-free run took {duration:.1f} s; each command is bounded at {bound:.0f} s",
              flush=True)
        # Two nodes on a bridge (node 1's cable is what a link-down fault cuts).
        with Nodes(2, subnet="10.231.9") if no_namespaces is None else contextlib.nullcontext() as namespaces:
            for index in range(args.skip + args.runs):
                run = plan(index, planner, duration, namespaces is not None, no_disk is None)
                if index < args.skip:
                    continue
                execute(run, base, train, args.epochs, bound, namespaces, chooser, reference)
                runs.append(run)
                faults = "; ".join(f"{fault.kind} at {fault.at:.1f} s" + ("" if fault.applied else " (after the end)")
                                   for fault in run.faults)
                left = f"; LEFT BEHIND: {run.left_behind}" if run.left_behind else ""
                print(f"run {index} ({run.setup}): {faults} -> {run.outcome} in {run.seconds:.0f} s{left}", flush=True)
                if args.verbose:
                    print("    " + "; ".join(fault.applied or "-" for fault in run.faults), flush=True)
                if run.outcome in ("hung", "wrong", "refused") or args.verbose:
                    print(re.sub(r"^", "    ", run.detail, flags=re.M), flush=True)
    finally:
        if left := end_all(base):
            print(f"chaos: ended {len(left)} processes of the runs on the way out", flush=True)
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(table(runs))
    counts = {outcome: sum(run.outcome == outcome for run in runs) for outcome in OUTCOMES}
    print(f"chaos: {len(runs)} runs: {counts['exact']} exact, {counts['ended']} ended naming the root cause, "
          f"{counts['refused']} refused naming why, "
          f"{counts['hung']} hung, {counts['wrong']} wrong, {sum(bool(run.left_behind) for run in runs)} left behind")


if __name__ == "__main__":
    main()
