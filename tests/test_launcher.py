"""`ddpkit run` end to end, through the real command line: clean runs, failures, signals, bad input."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import assert_gone, worker_pids

from ddpkit.diagnostics.hangs import _process_state
from ddpkit.environments import find_free_port
from ddpkit.launching.worker_environment import performance_defaults
from ddpkit.workers.processes import WorkerProcesses

PRELUDE = textwrap.dedent(
    """
    import os, sys, time, signal
    import torch
    import torch.distributed as dist
    from ddpkit import detect_environment, init_dist_connection, destroy_dist_connection, sync_ddp
    open(os.path.join(os.path.dirname(__file__), f"pid{os.environ['RANK']}"), "w").write(str(os.getpid()))
    env = detect_environment()
    init_dist_connection(env, timeout=30)
    rank = env.global_rank()
    """
)

SCRIPTS = {
    "ok.py": ("total = sync_ddp(torch.ones(1)).item()\n"
              "print(f'rank {rank} of {env.world_size()} total {total}', flush=True)\ndestroy_dist_connection()\n"),
    "raises.py": "if rank == 1:\n    raise ValueError('broken on purpose')\ndist.barrier()\n",
    "catches.py": ("import ddpkit\nif rank == 1:\n    try:\n        with ddpkit.guard():\n"
                   "            raise ValueError('caught and logged')\n    except ValueError:\n"
                   "        sys.exit(3)\ndist.barrier()\n"),
    "killed.py": "if rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\ndist.barrier()\n",
    "sleeps.py": "time.sleep(60)\n",
    "threads.py": "print(f'rank {rank} threads {torch.get_num_threads()} OMP {os.environ[\"OMP_NUM_THREADS\"]} '"
                  "f'malloc {os.environ.get(\"MALLOC_TRIM_THRESHOLD_\")}', flush=True)\ndestroy_dist_connection()\n",
}


@pytest.fixture()
def scripts(tmp_path: Path) -> Path:
    for name, body in SCRIPTS.items():
        (tmp_path / name).write_text(PRELUDE + body)
    return tmp_path


def launch(folder: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "ddpkit", "run", *args], cwd=folder, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_clean_two_process_run_exits_zero(scripts: Path) -> None:
    launcher = launch(scripts, "--nproc-per-node", "2", "ok.py")
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, err
    assert "rank 0 of 2 total 2.0" in out and "rank 1 of 2 total 2.0" in out


def test_a_stop_signal_after_every_worker_ended_leaves_the_job_s_exit_code(tmp_path: Path) -> None:
    """A scheduler signals every process of a job that just ended (or a user presses Ctrl-C as the
    last rank returns): the workers succeeded, so the job did; neither the watch ("stopping all
    workers", 143) nor the launcher's exit (the default action: killed by SIGTERM) may say otherwise."""
    (tmp_path / "ends.py").write_text("import os\nopen(f\"pid.{os.environ['RANK']}\", 'w').write(str(os.getpid()))\n")
    codes = []
    for _ in range(3):
        for written in tmp_path.glob("pid.*"):
            written.unlink()
        launcher = launch(tmp_path, "--nproc-per-node", "2", "ends.py")
        deadline = time.monotonic() + 60
        while len(pids := [int(text) for path in tmp_path.glob("pid.*") if (text := path.read_text())]) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate()
            time.sleep(0.002)
        while any(_process_state(pid) is not None for pid in pids):  # until both exited
            assert time.monotonic() < deadline
            time.sleep(0.001)
        while launcher.poll() is None:  # a signal every millisecond, through the launcher's end
            assert time.monotonic() < deadline
            with contextlib.suppress(ProcessLookupError):
                os.kill(launcher.pid, signal.SIGTERM)
            time.sleep(0.001)
        codes.append((launcher.returncode, launcher.communicate()[1][-500:]))
    assert all(code == 0 for code, _ in codes), codes


def test_a_raising_worker_ends_the_job_naming_its_rank_and_traceback(scripts: Path) -> None:
    launcher = launch(scripts, "--nproc-per-node", "2", "raises.py")
    pids = worker_pids(scripts, 2)
    start = time.monotonic()
    _, err = launcher.communicate(timeout=60)
    assert time.monotonic() - start < 5
    assert launcher.returncode == 1
    assert "rank 1 (local rank 1" in err and "failed first with ValueError: broken on purpose" in err
    assert "raise ValueError('broken on purpose')" in err  # the traceback
    assert_gone(pids)


def test_a_worker_that_catches_its_guarded_failure_and_exits_is_named_with_it(scripts: Path) -> None:
    """guard() records the failure for the launcher too: the script's own exit code does not hide the cause."""
    launcher = launch(scripts, "--nproc-per-node", "2", "catches.py")
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode != 0
    assert "rank 1 (local rank 1" in err and "failed first with ValueError: caught and logged" in err, err


def test_a_killed_worker_ends_the_job_naming_the_signal(scripts: Path) -> None:
    launcher = launch(scripts, "--nproc-per-node", "2", "killed.py")
    pids = worker_pids(scripts, 2)
    start = time.monotonic()
    _, err = launcher.communicate(timeout=60)
    assert time.monotonic() - start < 5
    assert launcher.returncode == 1 and "rank 1" in err and "killed by signal SIGKILL" in err
    assert_gone(pids)


def test_the_launcher_process_does_not_load_torch(tmp_path: Path) -> None:
    """Issue 16, item 3: importing torch takes seconds, and only the workers need it."""
    (tmp_path / "parent.py").write_text(
        "import os\n"
        "launcher = os.getppid()\n"
        "if b'--template' in open(f'/proc/{launcher}/cmdline', 'rb').read():  # forked by the node's template\n"
        "    launcher = int(open(f'/proc/{launcher}/stat').read().split(')')[-1].split()[1])\n"
        "with open(f'/proc/{launcher}/maps') as maps:\n"
        "    print('launcher loaded torch:', any('libtorch' in line for line in maps), flush=True)\n")
    result = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "1", "parent.py"],
                            cwd=tmp_path, text=True, capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "launcher loaded torch: False" in result.stdout, result.stdout


def test_a_stopped_worker_is_ended_by_sigterm_without_waiting_out_the_grace() -> None:
    """A worker frozen with SIGSTOP (a hang ended by DDPKIT_HANG_ABORT_SECONDS, a forgotten
    debugger) gets SIGCONT after SIGTERM, so the job ends at once rather than after ``grace``."""
    with WorkerProcesses("test") as workers:
        worker = workers.start([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"],
                               os.environ, rank=0, local_rank=0)
        deadline = time.monotonic() + 30
        while _process_state(worker.process.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _process_state(worker.process.pid) == "T"
        start = time.monotonic()
        workers.end(grace=20)
        assert time.monotonic() - start < 5
        assert worker.process.returncode == -signal.SIGTERM  # it acted on SIGTERM, not the SIGKILL after the grace


def test_a_worker_that_kills_itself_while_being_ended_counts_as_ended_by_itself() -> None:
    """A worker killed by SIGKILL before the launcher sent its own (it killed itself, or the
    out-of-memory killer did, while the launcher was ending the workers because another node's
    failed) failed by itself: ``end`` says so, so that its end is named as the root cause. One that
    acts on SIGTERM, or is killed by the launcher's SIGKILL after the grace, was ended by the launcher."""
    ignores_term = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); "
    with WorkerProcesses("test") as workers:
        kills_itself = workers.start([sys.executable, "-c", ignores_term + "time.sleep(1); import os; "
                                      "os.kill(os.getpid(), signal.SIGKILL)"], os.environ, rank=0, local_rank=0)
        stops = workers.start([sys.executable, "-c", "import time; time.sleep(60)"], os.environ, rank=1, local_rank=1)
        time.sleep(0.5)  # each is running (the first ignores SIGTERM by now)
        assert workers.end(grace=10) == [kills_itself]
        assert (kills_itself.process.returncode, stops.process.returncode) == (-signal.SIGKILL, -signal.SIGTERM)
    with WorkerProcesses("test") as workers:
        ignores = workers.start([sys.executable, "-c", ignores_term + "time.sleep(60)"], os.environ, rank=0,
                                local_rank=0)
        time.sleep(0.5)
        assert workers.end(grace=1) == []
        assert ignores.process.returncode == -signal.SIGKILL


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_launcher_ends_every_worker(scripts: Path, sig: int, code: int) -> None:
    launcher = launch(scripts, "--nproc-per-node", "2", "sleeps.py")
    pids = worker_pids(scripts, 2)
    launcher.send_signal(sig)
    _, err = launcher.communicate(timeout=10)
    assert launcher.returncode == code and signal.Signals(sig).name in err
    assert_gone(pids)


def test_workers_exit_when_the_launcher_is_killed(scripts: Path) -> None:
    launcher = launch(scripts, "--nproc-per-node", "2", "sleeps.py")
    pids = worker_pids(scripts, 2)
    launcher.kill()
    launcher.wait()
    assert_gone(pids, within=3.0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc-per-node", "0", "ok.py"], "--nproc-per-node=0"),
        (["--nproc-per-node", "two", "ok.py"], "--nproc-per-node='two' is not an integer"),
        (["--nnodes", "2", "--node-rank", "2", "--master-port", "29999", "ok.py"], "--node-rank=2 with --nnodes=2"),
        (["--nproc-per-node", "2", "missing.py"], "script 'missing.py' does not exist"),
        (["--master-addr", "no-such-host.invalid", "ok.py"], "--master-addr='no-such-host.invalid' does not resolve"),
        (["--nnodes", "2", "ok.py"], "--master-port is required with --nnodes > 1"),
        (["--max-restarts", "-1", "ok.py"], "--max-restarts=-1: give 0 (no restart) or more"),
        (["--recovery", "in-place", "--max-restarts", "1", "--nnodes", "2", "--master-port", "29999", "ok.py"],
         "--recovery in-place with --nnodes=2 and static node ranks: across nodes in-place recovery needs --rdzv-backend c10d"),
    ],
)
def test_bad_input_is_refused_before_anything_starts(scripts: Path, args: list[str], message: str) -> None:
    launcher = launch(scripts, *args)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 2 and message in err, err
    assert "Traceback" not in err, err
    assert not list(scripts.glob("pid*"))  # no worker started


def test_a_taken_port_is_refused(scripts: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        launcher = launch(scripts, "--master-port", str(port), "ok.py")
        _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 2 and f"--master-port={port} is already in use" in err


def test_underscore_spellings_and_environment_variables(scripts: Path) -> None:
    environment = {**os.environ, "DDPKIT_NPROC_PER_NODE": "2"}
    launcher = subprocess.Popen([sys.executable, "-m", "ddpkit", "run", "--master_addr", "127.0.0.1", "ok.py"],
                                cwd=scripts, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0 and "rank 1 of 2" in out, err


def test_two_nodes_on_loopback(scripts: Path) -> None:
    port = str(find_free_port())
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-port", port]
    node0 = launch(scripts, *common, "--node-rank", "0", "ok.py")
    node1 = launch(scripts, *common, "--node-rank", "1", "ok.py")
    out0, err0 = node0.communicate(timeout=90)
    out1, err1 = node1.communicate(timeout=90)
    assert node0.returncode == 0 and node1.returncode == 0, err0 + err1
    # Workers of one node share a pipe, so their lines may interleave: match the reports, not lines.
    reports = sorted(re.findall(r"rank (\d) of (\d) total ([\d.]+)", out0 + out1))
    assert reports == [(str(r), "4", "4.0") for r in range(4)]


def test_under_a_scheduler_it_starts_no_processes_of_its_own(scripts: Path) -> None:
    port = str(find_free_port())
    launchers = []
    for rank in range(2):  # what `srun --ntasks-per-node 2 ddpkit run --nproc-per-node 4 ok.py` would start
        environment = {**os.environ, "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": str(rank),
                       "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_JOB_NAME": "train",
                       "SLURM_STEP_ID": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank)}
        launchers.append(subprocess.Popen([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "4", "ok.py"],
                                          cwd=scripts, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          env=environment))
    outputs = [launcher.communicate(timeout=60) for launcher in launchers]
    assert [launcher.returncode for launcher in launchers] == [0, 0], outputs
    reports = sorted(re.findall(r"rank (\d) of (\d)", "".join(out for out, _ in outputs)))
    assert reports == [("0", "2"), ("1", "2")]  # two processes in all, not eight
    assert all("SLURMEnvironment started this process" in err for _, err in outputs)


# What sbatch's script sees with `#SBATCH --ntasks-per-node=2` (outside any job step: no SLURM_STEP_ID).
BATCH_STEP = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
              "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_JOB_NAME": "train.sbatch", "SLURM_JOB_ID": "41",
              "SLURM_NODELIST": "localhost", "SLURM_TASKS_PER_NODE": "2"}


def test_in_an_sbatch_script_it_starts_its_workers(scripts: Path) -> None:
    """Issue 15, item 3: in the batch script no srun started anything, so ddpkit run does."""
    launcher = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", "ok.py"],
                              cwd=scripts, text=True, capture_output=True, timeout=60, env={**os.environ, **BATCH_STEP})
    assert launcher.returncode == 0, launcher.stderr
    assert sorted(re.findall(r"rank (\d) of (\d) total ([\d.]+)", launcher.stdout)) == [("0", "2", "2.0"),
                                                                                       ("1", "2", "2.0")]
    assert "started this process" not in launcher.stderr


def test_a_script_run_alone_in_an_sbatch_script_trains_alone_and_says_why(scripts: Path) -> None:
    """Issue 15, item 2: it used to become rank 0 of 2 and wait for a rank 1 that nobody starts."""
    result = subprocess.run([sys.executable, "ok.py"], cwd=scripts, text=True, capture_output=True, timeout=60,
                            env={**os.environ, **BATCH_STEP, "RANK": "0"})
    assert result.returncode == 0, result.stderr
    assert "rank 0 of 1 total 1.0" in result.stdout
    assert "trains alone (world size 1) inside a Slurm allocation of SLURM_NTASKS=2 tasks" in result.stderr
    assert "`srun python script.py`" in result.stderr


def rank_times(factor: int) -> tuple[int, float]:
    import torch
    import torch.distributed as dist

    total = torch.ones(1)
    dist.all_reduce(total)
    return dist.get_rank() * factor, total.item()


def fails_on_rank_one() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("missing on rank 1")
    dist.barrier()


def test_launch_runs_a_function_and_returns_results_by_rank() -> None:
    from ddpkit import launch

    assert launch(rank_times, nprocs=3, args=(10,), timeout=60) == [(0, 3.0), (10, 3.0), (20, 3.0)]


def test_launch_raises_the_failing_rank_and_its_traceback() -> None:
    from ddpkit import launch
    from ddpkit.launching.launcher import RankFailedError

    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(fails_on_rank_one, nprocs=2, timeout=60)
    assert time.monotonic() - start < 15  # spawn included; the failure itself surfaces at once
    assert info.value.rank == 1 and "KeyError: 'missing on rank 1'" in str(info.value)


def test_nproc_auto_is_one_process_per_cpu_without_gpus(scripts: Path) -> None:
    cpus = os.cpu_count() or 1
    if cpus > 8:
        pytest.skip(f"{cpus} CPUs: too many processes for a test")
    launcher = launch(scripts, "--nproc-per-node", "auto", "ok.py")
    out, err = launcher.communicate(timeout=90)
    assert launcher.returncode == 0, err
    assert sorted(re.findall(r"rank (\d) of (\d)", out)) == [(str(rank), str(cpus)) for rank in range(cpus)]


def test_sigusr1_to_the_launcher_prints_every_workers_stack(scripts: Path) -> None:
    launcher = launch(scripts, "--nproc-per-node", "2", "sleeps.py")
    pids = worker_pids(scripts, 2)
    time.sleep(0.5)  # both are in the script's sleep
    launcher.send_signal(signal.SIGUSR1)
    time.sleep(1.5)
    assert launcher.poll() is None  # asking for stacks ends nothing
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=30)
    assert "ddpkit run: Python stacks of 2 running workers (SIGUSR1)" in err, err
    for rank in range(2):
        section = err.split(f"=== rank {rank} (local rank {rank}, pid {pids[rank]}) ===")[1]
        assert 'sleeps.py", line' in section.split("===")[0], section
    assert_gone(pids)


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"DDPKIT_NPROC_PER_NODE": "two"}, "DDPKIT_NPROC_PER_NODE='two' is not an integer"),
        ({"DDPKIT_MASTER_PORT": "abc"}, "DDPKIT_MASTER_PORT='abc' is not an integer"),
        ({"DDPKIT_BACKEND": "tcp"}, "DDPKIT_BACKEND='tcp' is not a backend; use one of gloo, nccl, mpi"),
        ({"DDPKIT_NNODES": "2", "DDPKIT_NODE_RANK": "5", "DDPKIT_MASTER_PORT": "29400"}, "--node-rank=5 with --nnodes=2"),
        ({"MASTER_PORT": "abc"}, "MASTER_PORT='abc' is not an integer"),
        ({"DDPKIT_RECOVERY": "inplace"}, "DDPKIT_RECOVERY='inplace': use 'fail-fast' or 'in-place'"),
        # The workers' settings: refused by the launcher, not by each worker with its traceback.
        ({"DDPKIT_HANG_SECONDS": "abc"}, "DDPKIT_HANG_SECONDS='abc' is not a number of seconds"),
        ({"DDPKIT_HANG_ABORT_SECONDS": "1 min"}, "DDPKIT_HANG_ABORT_SECONDS='1 min' is not a number of seconds"),
        ({"DDPKIT_PEER_FAILURE_EXIT_SECONDS": "x"}, "DDPKIT_PEER_FAILURE_EXIT_SECONDS='x' is not a number of seconds"),
        ({"DDPKIT_LOG_LEVEL": "LOUD"}, "DDPKIT_LOG_LEVEL='LOUD' is not a logging level"),  # read as the launcher loads
        ({"DDPKIT_JOB_SECRET": "tiny"}, "DDPKIT_JOB_SECRET is 4 characters long"),
    ],
)
def test_bad_environment_values_are_refused_before_anything_starts(scripts: Path, variables: dict[str, str],
                                                                   message: str) -> None:
    launcher = subprocess.Popen([sys.executable, "-m", "ddpkit", "run", "ok.py"], cwd=scripts, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **variables})
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 2 and message in err, err
    assert "Traceback" not in err, err
    assert not list(scripts.glob("pid*"))  # no worker started


PERFORMANCE_VARIABLES = ("OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                         "GLIBC_TUNABLES")


def test_performance_defaults_share_the_cores_and_leave_user_choices_alone() -> None:
    cores = len(os.sched_getaffinity(0))
    defaults = performance_defaults(2, {})
    assert defaults["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    assert performance_defaults(10 * cores, {})["OMP_NUM_THREADS"] == "1"
    assert int(defaults["MALLOC_TRIM_THRESHOLD_"]) > int(defaults["MALLOC_MMAP_THRESHOLD_"]) > 128 * 1024
    assert performance_defaults(2, {"OMP_NUM_THREADS": "3", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {}


@pytest.mark.parametrize("user_threads", [None, "3"], ids=["unset", "user-chose-3"])
def test_workers_get_their_share_of_the_cores_unless_the_user_chose(scripts: Path, user_threads: str | None) -> None:
    environment = {name: value for name, value in os.environ.items() if name not in PERFORMANCE_VARIABLES}
    if user_threads is not None:
        environment["OMP_NUM_THREADS"] = user_threads
    launcher = subprocess.Popen([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", "threads.py"],
                                cwd=scripts, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, err
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    reports = sorted(re.findall(r"rank (\d) threads (\d+) OMP (\d+) malloc (\d+)", out))
    if user_threads is None:  # torch follows it (torch caps a user's larger value at the core count)
        assert reports == [(str(rank), share, share, str(256 * 1024 * 1024)) for rank in range(2)], out
    else:
        assert [(rank, omp) for rank, _, omp, _ in reports] == [("0", user_threads), ("1", user_threads)], out
    assert ("OMP_NUM_THREADS=" in err) == (user_threads is None), err  # said when ddpkit chose, like torchrun


def test_the_launchers_notices_follow_ddpkit_log_level(scripts: Path) -> None:
    """The OMP_NUM_THREADS notice is a log message (ddpkit.launching): WARNING silences it."""
    environment = {name: value for name, value in os.environ.items() if name not in PERFORMANCE_VARIABLES}
    environment["DDPKIT_LOG_LEVEL"] = "WARNING"
    launcher = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", "threads.py"],
                              cwd=scripts, text=True, capture_output=True, env=environment, timeout=60)
    assert launcher.returncode == 0, launcher.stderr
    assert "OMP_NUM_THREADS=" not in launcher.stderr, launcher.stderr


def test_a_worker_that_fails_between_the_look_for_failures_and_the_look_for_the_end_is_not_a_success() -> None:
    """Each poll of ``watch`` looks for failed workers, then whether every worker has ended. A worker
    that exited 1 between the two was read as ended and the attempt as a success: a launcher whose
    one worker raised (a refused checkpoint, in 2 runs of 30) exited 0 without a word. The end is
    only a success when every code is."""
    from ddpkit.launching.watch import _all_ended

    with WorkerProcesses("test") as workers:
        worker = workers.start([sys.executable, "-c", "raise SystemExit(1)"], os.environ, rank=0, local_rank=0)
        worker.process.wait(timeout=30)  # as if it exited just after this poll's look for failures
        assert _all_ended(workers, grace=1.0, preemption=None) is None
