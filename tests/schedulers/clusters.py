"""Real schedulers for the tests in this folder (conftest.py makes fixtures of them): a one-node
Slurm cluster brought up from Debian's packages (``slurm-wlm``, ``munge``) in a temporary folder,
and Open MPI's and MPICH's ``mpirun``.

``.ci/run`` installs the packages as root; where they are missing or cannot run, the tests skip
and say why. Everything the cluster writes (key, state, logs, pid files) stays in its folder, its
ports are free ones, and its daemons are stopped afterwards, so it touches no system Slurm.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import example_summary

from ddpkit.environments import find_free_port

REPOSITORY = Path(__file__).resolve().parents[2]
EXAMPLE = REPOSITORY / "examples" / "train.py"
INSTALL_HINT = "apt-get install slurm-wlm munge openmpi-bin mpich (.ci/run does so as root)"
SLURM_COMMANDS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "salloc", "squeue", "scontrol", "sinfo")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"({path} was not written)"


def trained_as_one_world_of(processes: int, output: str) -> None:
    """The example's summary line: one training over ``processes`` ranks that agree, equal to one process."""
    summary = example_summary(output)
    assert output.count("samples/s over") == 1, f"more than one training ran:\n{output[-3000:]}"
    assert (summary["world_size"], summary["identical"]) == (processes, True), output[-3000:]
    assert summary["max_difference"] < 1e-5, output[-3000:]


@dataclass
class BatchJob:
    job_id: str
    state: str
    exit_code: int
    output: str


@dataclass
class SlurmCluster:
    folder: Path
    environment: dict[str, str]

    def run(self, command: Sequence[str], timeout: float = 90) -> subprocess.CompletedProcess[str]:
        """Runs an ``srun``/``salloc`` command line; on timeout, cancels what it left and fails."""
        try:
            return subprocess.run(list(command), capture_output=True, text=True, timeout=timeout,
                                  env=self.environment, cwd=REPOSITORY)
        except subprocess.TimeoutExpired as expired:
            self.cancel_all()
            pytest.fail(f"{' '.join(command)} did not end within {timeout} s:\n{expired.stderr!r}")

    def batch(self, script: Path, options: Sequence[str] = (), timeout: float = 90) -> BatchJob:
        """Submits ``script`` with sbatch and waits for the job to end (polled, since ``sbatch --wait``
        checks only every 10 s)."""
        output = self.folder / f"batch-{time.monotonic_ns()}.out"
        submitted = subprocess.run(["sbatch", "--parsable", f"--output={output}", *options, str(script)],
                                   capture_output=True, text=True, timeout=30, env=self.environment, cwd=REPOSITORY)
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        while True:
            shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                                   timeout=30, env=self.environment)
            fields = dict(item.split("=", 1) for item in shown.stdout.split() if "=" in item)
            state = fields.get("JobState", "UNKNOWN")
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "UNKNOWN"):
                break
            if time.monotonic() > deadline:
                self.cancel_all()
                pytest.fail(f"batch job {job_id} ({script.name}) did not end within {timeout} s:\n{_tail(output, 40)}")
            time.sleep(0.2)
        return BatchJob(job_id, state, int(fields.get("ExitCode", "-1:0").split(":")[0]), _tail(output, 200))

    def cancel_all(self) -> None:
        subprocess.run(["scancel", "--full", "--partition=debug"], capture_output=True, timeout=30, env=self.environment)


def _stop(pid_file: Path) -> None:
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 2  # the cluster's state is thrown away: no need to wait for a tidy stop
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _slurm_conf(folder: Path, host: str) -> str:
    return "\n".join([
        "ClusterName=ddpkit-tests",
        f"SlurmctldHost={host}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        f"AuthInfo=socket={folder / 'munge.socket'}",
        "CredType=cred/munge",
        f"SlurmctldPort={find_free_port()}",
        f"SlurmdPort={find_free_port()}",
        f"StateSaveLocation={folder / 'state'}",
        f"SlurmdSpoolDir={folder / 'spool'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'slurmd.log'}",
        # What a container without cgroups allows, as the one-node cluster ran.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SchedulerType=sched/builtin",
        "ReturnToService=2",
        "KillWait=5",
        # Four CPUs on any machine (the tests' jobs need at most four tasks); the node's real count
        # may be smaller, which config_overrides lets slurmd accept.
        "SlurmdParameters=config_overrides",
        f"NodeName={host} CPUs=4 State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        "",
    ])


def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("a Slurm cluster of its own needs Linux and root (slurmd starts tasks as their user)")
    missing = [command for command in SLURM_COMMANDS if shutil.which(command) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} not found): {INSTALL_HINT}")
    folder = tmp_path_factory.mktemp("slurm")
    for part in ("state", "spool"):
        (folder / part).mkdir()
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    host = socket.gethostname().split(".")[0]
    conf = folder / "slurm.conf"
    conf.write_text(_slurm_conf(folder, host))
    environment = {**os.environ, "SLURM_CONF": str(conf)}
    started = []
    try:
        for name, command in [
            ("munged", ["munged", "--force", f"--key-file={key}", f"--socket={folder / 'munge.socket'}",
                        f"--pid-file={folder / 'munged.pid'}", f"--seed-file={folder / 'munge.seed'}",
                        f"--log-file={folder / 'munged.log'}"]),
            ("slurmctld", ["slurmctld", "-i"]),
            ("slurmd", ["slurmd"]),
        ]:
            result = subprocess.run(command, capture_output=True, text=True, timeout=30, env=environment)
            if result.returncode != 0:
                pytest.skip(f"{name} did not start here: {result.stderr.strip()} {_tail(folder / f'{name}.log')}")
            started.append(folder / f"{name}.pid")
        deadline = time.monotonic() + 30
        while True:
            shown = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30, env=environment)
            if shown.stdout.strip() == "idle":
                break
            if time.monotonic() > deadline:
                pytest.skip(f"the Slurm node did not become idle within 30 s (sinfo: {shown.stdout.strip()!r} "
                            f"{shown.stderr.strip()!r}); slurmd's log:\n{_tail(folder / 'slurmd.log')}")
            time.sleep(0.2)
        cluster = SlurmCluster(folder, environment)
        yield cluster
        cluster.cancel_all()
    finally:
        for pid_file in reversed(started):
            _stop(pid_file)


@dataclass
class MPI:
    name: str
    mpirun: str
    environment: dict[str, str]

    def run(self, arguments: Sequence[str], timeout: float = 90) -> subprocess.CompletedProcess[str]:
        """Runs mpirun; on timeout kills it with its ranks (they share the session started for it) and fails."""
        command = [self.mpirun, *arguments]
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=self.environment, cwd=REPOSITORY, start_new_session=True) as job:
            try:
                stdout, stderr = job.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                stdout, stderr = job.communicate()
                pytest.fail(f"{self.name}: {' '.join(command)} did not end within {timeout} s:\n{stderr[-3000:]}")
        return subprocess.CompletedProcess(command, job.returncode, stdout, stderr)


# Open MPI refuses to run as root unless told twice; a user running as root sets these as well.
_OPEN_MPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                     "OMPI_MCA_rmaps_base_oversubscribe": "1"}


def chosen_mpi(name: str, tmp_path: Path) -> MPI:
    """Open MPI's and MPICH's mpirun (Debian installs both side by side as mpirun.openmpi and
    mpirun.mpich); ``environment`` puts the chosen one first on PATH as ``mpirun``."""
    command = shutil.which(f"mpirun.{name}")
    if command is None:
        pytest.skip(f"mpirun.{name} is not installed: {INSTALL_HINT}")
    chosen = tmp_path / "bin"
    chosen.mkdir()
    # A script, not a link: MPICH's mpiexec looks for hydra_pmi_proxy beside the path it was called by.
    (chosen / "mpirun").write_text(f'#!/bin/sh\nexec {command} "$@"\n')
    (chosen / "mpirun").chmod(0o755)
    environment = {**os.environ, "PATH": f"{chosen}{os.pathsep}{os.environ.get('PATH', '')}"}
    if name == "openmpi":
        environment.update(_OPEN_MPI_AS_ROOT)
    return MPI(name, str(chosen / "mpirun"), environment)
