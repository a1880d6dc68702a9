"""Hostile input to ``ddpkit run`` (issue 33, item 5): every flag and every variable it or its
workers read, given malformed, huge, negative, empty and non-UTF-8 values (hypothesis draws
them). Each run ends within its bound with the script run (the value was usable) or refused in a
message naming the flag or variable; never a traceback from inside, never a hang, never a worker
started after a refusal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddpkit.variables import launcher_flag_variable

# The flags that take a value (the script and its arguments aside).
FLAGS = ["--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--backend",
         "--max-restarts", "--preemption-signal", "--recovery", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id",
         "--rdzv-conf", "--log-dir", "--redirects", "--tee", "--local-ranks-filter"]
# Every variable the launcher reads (each flag's, and the settings it checks for its workers), and
# torchrun's and the schedulers' that it inherits.
VARIABLES = [launcher_flag_variable(flag) for flag in FLAGS] + [
    "DDPKIT_HANG_SECONDS", "DDPKIT_HANG_ABORT_SECONDS", "DDPKIT_PEER_FAILURE_EXIT_SECONDS",
    "DDPKIT_RECOVERY_TIMEOUT_SECONDS", "DDPKIT_LOG_LEVEL", "DDPKIT_JOB_SECRET", "DDPKIT_JOB_SECRET_FILE",
    "DDPKIT_STORE_BIND", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK",
    "PMI_SIZE", "LSB_JOBID",
]

HOSTILE = st.one_of(
    st.just(""),
    st.sampled_from(["-1", "0", "-0", "1e999", "nan", "inf", " ", "x" * 5000, "99999999999999999999", "1.5", "0x10",
                     "auto", "all", "127.0.0.1:0", "[::1]", "a=b=c,,", "TERM,INT", "-", "--", "\\", "0,1,-2"]),
    st.integers(-(10 ** 30), -1).map(str),
    st.integers(10 ** 6, 10 ** 30).map(str),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40),
    st.binary(min_size=1, max_size=16).filter(lambda raw: b"\x00" not in raw).map(
        lambda raw: raw.decode("utf-8", "surrogateescape")),
)

# CI draws the same examples every run (a test that fails must fail again): 15 of each, a launch
# of 2-3 s each on two cores; HOSTILE_EXAMPLES=N HOSTILE_RANDOM=1 draws new ones, as when looking for more.
EXAMPLES = int(os.environ.get("HOSTILE_EXAMPLES", "15"))
DERANDOMIZE = os.environ.get("HOSTILE_RANDOM") != "1"

SCRIPT = "import os\nopen(f'started{os.getpid()}', 'w').close()\n"
BOUND_SECONDS = 60


def run_launcher(folder: Path, arguments: list[str], variables: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    (folder / "ok.py").write_text(SCRIPT)
    environment = {key.encode(): value.encode() for key, value in os.environ.items()
                   if not key.startswith(("DDPKIT_", "SLURM_", "OMPI_", "PMI_", "LSB_", "TORCHELASTIC_"))
                   and key not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    environment.update({key.encode(): value.encode("utf-8", "surrogateescape") for key, value in variables.items()})
    command = [os.fsencode(sys.executable), b"-m", b"ddpkit", b"run",
               *(argument.encode("utf-8", "surrogateescape") for argument in arguments), b"ok.py"]
    return subprocess.run(command, cwd=folder, env=environment, capture_output=True, timeout=BOUND_SECONDS)


def check_outcome(folder: Path, result: subprocess.CompletedProcess[bytes], names: tuple[str, ...]) -> None:
    err = result.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err, err[-3000:]
    if result.returncode != 0:
        assert any(name in err for name in names), err[-3000:]  # the message names what was wrong
    if result.returncode == 2:  # refused by the launcher: before anything started
        assert not list(folder.glob("started*")), err[-3000:]


@pytest.mark.timeout(900)
@settings(max_examples=EXAMPLES, deadline=None, derandomize=DERANDOMIZE,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(VARIABLES), value=HOSTILE)
def test_a_hostile_variable_is_used_or_refused_naming_it(tmp_path_factory: pytest.TempPathFactory, name: str,
                                                         value: str) -> None:
    folder = tmp_path_factory.mktemp("variable")
    result = run_launcher(folder, [], {name: value})
    check_outcome(folder, result, (name, name.removeprefix("DDPKIT_").lower().replace("_", "-")))


@pytest.mark.timeout(900)
@settings(max_examples=EXAMPLES, deadline=None, derandomize=DERANDOMIZE,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(FLAGS), value=HOSTILE)
def test_a_hostile_flag_is_used_or_refused_naming_it(tmp_path_factory: pytest.TempPathFactory, flag: str,
                                                     value: str) -> None:
    folder = tmp_path_factory.mktemp("flag")
    result = run_launcher(folder, [f"{flag}={value}"], {})
    check_outcome(folder, result, (flag, "ddpkit run"))
