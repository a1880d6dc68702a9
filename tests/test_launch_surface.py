"""torchrun's launch surface on ``ddpkit run`` (issue 15, item 2): ``-m``, ``--no-python``,
``--standalone``, ``--nnodes MIN:MAX``, and where the workers' output goes (``--log-dir``,
``--redirects``, ``--tee`` with ``[rank<N>]:`` prefixes, ``--local-ranks-filter``). Real launchers
and workers; the scripts import no torch unless they train, to keep the tests short."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ddpkit.environments import Recovery
from ddpkit.launching.cli import main
from ddpkit.launching.config import LaunchConfig, validate
from ddpkit.workers.output import Streams, parse_local_ranks, parse_streams

# Each worker reports its place on stdout, a line on stderr, and a progress bar redrawn with '\r'.
REPORT = textwrap.dedent(
    """
    import os, sys
    print(f"out of rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} at {os.environ['MASTER_ADDR']} "
          f"name {__name__} argv {sys.argv[1:]}", flush=True)
    print(f"err of rank {os.environ['RANK']}", file=sys.stderr, flush=True)
    from ddpkit.logs import get_logger
    get_logger("test").warning("a message of ddpkit's")
    sys.stdout.write("bar 1%\\rbar 50%\\rbar 100%\\n")
    sys.stdout.flush()
    if os.environ.get("FAIL_RANK") == os.environ["RANK"] and os.environ["DDPKIT_RESTART_COUNT"] == "0":
        print(f"last words of rank {os.environ['RANK']}", file=sys.stderr, flush=True)
        os._exit(3)
    """
)


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    (tmp_path / "report.py").write_text(REPORT)
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "__init__.py").write_text("")
    (tmp_path / "jobs" / "report.py").write_text(REPORT)
    return tmp_path


def refused(folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *arguments: str,
            **variables: str) -> str:
    """What ``ddpkit run arguments`` prints when it refuses them (exit code 2, nothing started); in
    this process, since nothing starts."""
    monkeypatch.chdir(folder)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert main(["run", *arguments]) == 2
    return capsys.readouterr().err


def ddpkit_run(folder: Path, *arguments: str, **variables: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "ddpkit", "run", *arguments], cwd=folder, capture_output=True,
                            timeout=60, env={**os.environ, **variables})
    # Decoded here rather than with text=True, which would turn the progress bar's '\r' into '\n'.
    return subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode(), result.stderr.decode())


def test_a_module_runs_as_python_m_runs_it(folder: Path) -> None:
    result = ddpkit_run(folder, "--nproc-per-node", "2", "-m", "jobs.report", "--lr", "0.1")
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"out of rank {rank} of 2 at 127.0.0.1 name __main__ argv ['--lr', '0.1']" in result.stdout
        assert f"[rank {rank}] a message of ddpkit's" in result.stderr  # ddpkit's own prefix, without --tee


def test_a_module_that_does_not_exist_is_refused_before_anything_starts(
        folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    message = refused(folder, monkeypatch, capsys, "--module", "nothere.report")
    assert "module 'nothere.report' was not found (looked for 'nothere'" in message


def test_no_python_runs_the_program_itself_and_names_the_rank_that_failed(folder: Path) -> None:
    program = folder / "job.sh"
    program.write_text('#!/bin/sh\necho "program rank $RANK of $WORLD_SIZE"\n[ "$RANK" = 1 ] && exit 3\nexit 0\n')
    program.chmod(0o755)
    result = ddpkit_run(folder, "--nproc-per-node", "2", "--no-python", "./job.sh")
    assert result.returncode == 1
    assert "program rank 0 of 2" in result.stdout and "program rank 1 of 2" in result.stdout
    assert "rank 1 (local rank 1" in result.stderr and "exited with code 3" in result.stderr, result.stderr


def test_no_python_with_a_program_that_cannot_run_is_refused(
        folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (folder / "data.txt").write_text("not a program")
    message = refused(folder, monkeypatch, capsys, "--no-python", "./data.txt")
    assert "program './data.txt' was not found or is not executable" in message


def test_module_and_no_python_together_are_refused(
        folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert "--module and --no-python together" in refused(folder, monkeypatch, capsys, "-m", "--no-python", "report")


def test_standalone_runs_on_this_machine_on_a_port_of_its_own(folder: Path) -> None:
    result = ddpkit_run(folder, "--standalone", "--nproc-per-node", "2", "--nnodes", "1:1", "--master-addr",
                        "localhost", "--master-port", "1", "report.py")
    assert result.returncode == 0, result.stderr
    assert "out of rank 1 of 2 at 127.0.0.1" in result.stdout
    assert "--master-port=1 is not used" in result.stderr


def test_standalone_across_nodes_is_refused(
        folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    message = refused(folder, monkeypatch, capsys, "--standalone", "--nnodes", "2", "report.py")
    assert "--standalone is one node on this machine" in message


@pytest.mark.parametrize("value", ["1:2", "2:4"])
def test_a_range_of_node_counts_without_c10d_and_in_place_is_refused_with_the_way_to_go(
        folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str) -> None:
    message = refused(folder, monkeypatch, capsys, "--nnodes", value, "report.py")
    assert f"--nnodes={value}: a range of node counts needs --rdzv-backend c10d" in message
    assert "--recovery in-place" in message and "--max-restarts" in message
    c10d = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29999", "--rdzv-id", "j"]
    message = refused(folder, monkeypatch, capsys, "--nnodes", value, *c10d, "report.py")
    assert "a range of node counts needs" in message


@pytest.mark.parametrize("value", ["2:1", "3:2"])
def test_a_range_of_node_counts_out_of_order_is_refused(
        folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str) -> None:
    message = refused(folder, monkeypatch, capsys, "--nnodes", value, "--recovery", "in-place", "--max-restarts", "1",
                      "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29999", "--rdzv-id", "j", "report.py")
    assert f"--nnodes={value}: MIN:MAX needs 1 <= MIN < MAX" in message


def test_tee_writes_log_files_and_prefixes_each_console_line_with_the_rank(folder: Path) -> None:
    result = ddpkit_run(folder, "--nproc-per-node", "2", "--tee", "3", "--log-dir", "logs", "report.py")
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"[rank{rank}]: out of rank {rank} of 2" in result.stdout
        assert f"[rank{rank}]: err of rank {rank}" in result.stderr
        assert f"[rank{rank}]: a message of ddpkit's" in result.stderr  # one prefix, not two
        # The bar redraws its line: each redraw starts with the prefix again.
        assert f"[rank{rank}]: bar 1%\r[rank{rank}]: bar 50%\r[rank{rank}]: bar 100%\n" in result.stdout
        logs = folder / "logs" / "node0" / "attempt_0" / str(rank)
        assert (logs / "stdout.log").read_text().startswith(f"out of rank {rank} of 2")  # no prefix in the file
        assert (logs / "stderr.log").read_text() == f"err of rank {rank}\na message of ddpkit's\n"
    assert not re.search(r"^(out|err) of rank", result.stdout + result.stderr, re.MULTILINE)  # every line prefixed


def test_redirects_write_the_log_files_only_and_replace_a_former_runs(folder: Path) -> None:
    stale = folder / "logs" / "node0" / "attempt_0" / "0" / "stale.log"
    stale.parent.mkdir(parents=True)
    stale.write_text("from yesterday\n")
    result = ddpkit_run(folder, "--nproc-per-node", "2", "-r", "3", "--log-dir", "logs", "report.py")
    assert result.returncode == 0, result.stderr
    assert "of rank" not in result.stdout + result.stderr
    assert "out of rank 1 of 2" in (folder / "logs" / "node0" / "attempt_0" / "1" / "stdout.log").read_text()
    assert not stale.exists()


def test_log_dir_alone_writes_nothing_and_keeps_a_former_runs_files(folder: Path) -> None:
    """As torchrun: --log-dir names where --redirects/--tee files go; alone, the output stays on the console."""
    kept = folder / "logs" / "node0" / "attempt_0" / "0" / "stdout.log"
    kept.parent.mkdir(parents=True)
    kept.write_text("from yesterday\n")
    result = ddpkit_run(folder, "--nproc-per-node", "2", "--log-dir", "logs", "report.py")
    assert result.returncode == 0, result.stderr
    assert "out of rank 1 of 2" in result.stdout
    assert sorted(path.name for path in (folder / "logs").rglob("*") if path.is_file()) == ["stdout.log"]
    assert kept.read_text() == "from yesterday\n"
    result = ddpkit_run(folder, "--nproc-per-node", "1", "--log-dir", "fresh", "report.py")
    assert result.returncode == 0 and not (folder / "fresh").exists()


def test_settings_per_local_rank(folder: Path) -> None:
    # stdout of local rank 0 to its file only, stderr of local rank 1 teed; the rest as usual.
    result = ddpkit_run(folder, "--nproc-per-node", "2", "--redirects", "0:1", "--tee", "1:2", "--log-dir", "logs",
                        "report.py")
    assert result.returncode == 0, result.stderr
    assert "out of rank 0" not in result.stdout and "out of rank 1 of 2" in result.stdout
    assert "[rank1]: err of rank 1" in result.stderr and "err of rank 0" in result.stderr
    attempt = folder / "logs" / "node0" / "attempt_0"
    assert sorted(str(path.relative_to(attempt)) for path in attempt.rglob("*.log")) == ["0/stdout.log",
                                                                                       "1/stderr.log"]


def test_local_ranks_filter_shows_only_those_ranks_and_writes_every_ranks_files(folder: Path) -> None:
    result = ddpkit_run(folder, "--nproc-per-node", "3", "--local-ranks-filter", "1,2", "--tee", "0:3,1:1",
                        "--log-dir", "logs", "report.py")
    assert result.returncode == 0, result.stderr
    assert "of rank 0" not in result.stdout + result.stderr
    assert "[rank1]: out of rank 1 of 3" in result.stdout and "err of rank 2" in result.stderr
    assert "err of rank 0" in (folder / "logs" / "node0" / "attempt_0" / "0" / "stderr.log").read_text()


def test_each_restart_writes_to_a_folder_of_its_own_and_the_last_words_of_a_failed_rank_arrive(folder: Path) -> None:
    result = ddpkit_run(folder, "--nproc-per-node", "2", "--max-restarts", "1", "--tee", "3", "--log-dir", "logs",
                        "report.py", FAIL_RANK="1")
    assert result.returncode == 0, result.stderr
    assert "[rank1]: last words of rank 1" in result.stderr
    node = folder / "logs" / "node0"
    assert "last words of rank 1" in (node / "attempt_0" / "1" / "stderr.log").read_text()
    assert (node / "attempt_1" / "1" / "stderr.log").read_text().startswith("err of rank 1\n")


@pytest.mark.parametrize(("arguments", "message"), [
    (["--tee", "4"], "--tee='4' is not a stream setting"),
    (["-r", "0:1,5:2"], "local rank 5 does not exist with --nproc-per-node=2: use 0..1"),
    (["--redirects", "out"], "--redirects='out' is not a stream setting"),
    (["--local-ranks-filter", "0,x"], "--local-ranks-filter='0,x': give local ranks separated by commas"),
    (["--local-ranks-filter", "2"], "--local-ranks-filter='2': local rank 2 does not exist"),
])
def test_bad_output_settings_are_refused(folder: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str], arguments: list[str], message: str) -> None:
    assert message in refused(folder, monkeypatch, capsys, "--nproc-per-node", "2", *arguments, "report.py")


def test_output_settings_come_from_the_environment_too_and_files_go_to_a_named_folder(folder: Path) -> None:
    result = ddpkit_run(folder, "--nproc-per-node", "2", "report.py", DDPKIT_TEE="2", DDPKIT_LOCAL_RANKS_FILTER="1")
    assert result.returncode == 0, result.stderr
    assert "[rank1]: err of rank 1" in result.stderr and "of rank 0" not in result.stderr + result.stdout
    # Without --log-dir the files go to a new folder, which the launcher names.
    named = re.search(r"the workers' log files are in (\S+) \(choose the folder with --log-dir\)", result.stderr)
    assert named is not None, result.stderr
    assert (Path(named[1]) / "node0" / "attempt_0" / "0" / "stderr.log").read_text().startswith("err of rank 0")


def test_a_bad_output_setting_from_the_environment_is_named_as_such(
        folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert "DDPKIT_TEE='9' is not a stream setting" in refused(folder, monkeypatch, capsys, "report.py",
                                                                DDPKIT_TEE="9")


def test_stream_settings_are_read_as_torchrun_reads_them() -> None:
    assert parse_streams("--tee", "3", 2) == {0: Streams.BOTH, 1: Streams.BOTH}
    assert parse_streams("--tee", "0:1,1:2", 3) == {0: Streams.OUT, 1: Streams.ERR, 2: Streams.NONE}
    assert parse_streams("--tee", "", 1) == {0: Streams.NONE}
    assert parse_local_ranks("", 4) is None and parse_local_ranks("0,3", 4) == {0, 3}


def test_the_help_names_every_torchrun_flag_ddpkit_takes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    for flag in ("--standalone", "-m, --module", "--no-python", "--log-dir", "-r REDIRECTS, --redirects",
                 "-t TEE, --tee", "--local-ranks-filter"):
        assert flag in text, flag


def test_standalone_sets_the_rendezvous_itself(folder: Path) -> None:
    result = ddpkit_run(folder, "--standalone", "--rdzv-backend", "c10d", "--rdzv-endpoint", "x:1", "report.py")
    assert result.returncode == 0 and "out of rank 0 of 1 at 127.0.0.1" in result.stdout, result.stderr


def test_in_place_over_nccl_is_refused_unless_its_switch_is_on(
        folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Until in-place recovery has run on GPUs, NCCL needs DDPKIT_NCCL_IN_PLACE=1; the refusal names it."""
    monkeypatch.delenv("DDPKIT_NCCL_IN_PLACE", raising=False)
    in_place = ["--recovery", "in-place", "--max-restarts", "1", "--backend", "nccl", "report.py"]
    message = refused(folder, monkeypatch, capsys, *in_place)
    assert "DDPKIT_NCCL_IN_PLACE=''" in message and "DDPKIT_NCCL_IN_PLACE=1" in message and "--backend gloo" in message
    monkeypatch.setenv("DDPKIT_NCCL_IN_PLACE", "1")
    validate(LaunchConfig(nproc_per_node=2, backend="nccl", max_restarts=1, recovery=Recovery.IN_PLACE), "report.py")


def _option_strings(parser: object) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}  # type: ignore[attr-defined]


def test_every_flag_of_the_installed_torchrun_is_taken_by_ddpkit_run() -> None:
    """Read from the installed torch's own parser: a torchrun flag that ``ddpkit run`` does not take
    fails this test (a new torch release adds one), instead of a cluster's launch script."""
    from torch.distributed.run import get_args_parser

    from ddpkit.launching.cli import _parser

    run = next(action for action in _parser()._actions if action.dest == "command").choices["run"]
    missing = sorted(_option_strings(get_args_parser()) - _option_strings(run))
    assert missing == [], f"torchrun's flags that ddpkit run refuses: {missing}"


# torchrun's flags that ddpkit run has none of its own for, each with a value as a launch script gives it.
TORCHRUN_FLAGS = ["--monitor-interval", "0.2", "--shutdown_timeout", "5", "--role", "trainer", "--start-method", "fork",
                  "--event-log-handler", "console", "--run-path", "--local-addr", "127.0.0.1", "--logs-specs",
                  "default", "--numa-binding", "node", "--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1",
                  "--virtual-local-rank", "--duplicate-stdout-filters", "apple,orange", "--duplicate_stderr_filters",
                  "pear"]
ROLE_JOB = textwrap.dedent(
    """
    import os
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} as {os.environ['ROLE_NAME']}: {total.item()}", flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(90)
def test_a_torchrun_command_line_with_every_flag_runs_under_ddpkit_run_saying_what_it_takes_another_way(
        tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(ROLE_JOB)
    result = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", *TORCHRUN_FLAGS, "job.py"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=80)
    assert result.returncode == 0, result.stderr[-3000:]
    # (two ranks write to one pipe: a line of one may run into the other's)
    assert sorted(re.findall(r"rank \d of \d as \w+: \d+\.\d", result.stdout)) == [
        "rank 0 of 2 as trainer: 3.0", "rank 1 of 2 as trainer: 3.0"], result.stdout
    for flag in ("start-method", "event-log-handler", "run-path", "local-addr", "logs-specs", "numa-binding",
                 "signals-to-handle", "virtual-local-rank", "duplicate-stdout-filters", "duplicate-stderr-filters"):
        assert result.stderr.count(f"ddpkit run: --{flag} is accepted for torchrun's command lines: ") == 1, (
            flag, result.stderr[-3000:])
    assert "--monitor-interval is accepted" not in result.stderr and "--role is accepted" not in result.stderr


def test_torchruns_timings_are_the_launchers_and_a_bad_one_is_refused_naming_it(tmp_path: Path,
                                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--monitor-interval", "-1", "job.py"]) == 2
    assert "--monitor-interval='-1' is not a number of seconds above 0, e.g. 0.1." in capsys.readouterr().err
    assert main(["run", "--shutdown-timeout", "soon", "job.py"]) == 2
    assert "--shutdown-timeout='soon' is not a number of seconds, 0 or more, e.g. 30." in capsys.readouterr().err


def test_version_names_ddpkits_and_torchs(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    import ddpkit

    with pytest.raises(SystemExit) as ended:
        main(["--version"])
    assert ended.value.code == 0
    assert capsys.readouterr().out == f"ddpkit {ddpkit.__version__} (torch {torch.__version__})\n"


@pytest.mark.parametrize(("argv", "said"), [
    (["run", "--stragglers", "bogus", "job.py"],
     "ddpkit run: argument --stragglers: invalid choice: 'bogus' (choose from 'name', 'replace')."),
    (["run", "--recovery", "later", "job.py"],
     "ddpkit run: argument --recovery: invalid choice: 'later' (choose from 'fail-fast', 'in-place')."),
    (["run", "--backend", "mpich", "job.py"],
     "ddpkit run: argument --backend: invalid choice: 'mpich' (choose from 'gloo', 'nccl', 'mpi')."),
    (["run", "--no-such-flag", "job.py"], "ddpkit: unrecognized arguments: --no-such-flag."),
])
def test_a_flag_argparse_refuses_is_one_line_naming_the_value_and_the_help(
        argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        main(argv)
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(said) and "--help` lists the flags" in err, err


def test_run_help_groups_the_flags_shows_their_defaults_and_ends_with_examples(capsys: pytest.CaptureFixture[str],
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # each flag's help on one line
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    for group in ("the job's shape (torchrun's flags):", "what a failure costs:",
                  "where the workers' output goes (torchrun's flags):", "the job's health, metrics and stragglers:",
                  "torchrun's flags that ddpkit run takes another way:"):
        assert f"\n{group}\n" in text, text
    assert re.search(r"--report-every REPORT_EVERY, --report_every REPORT_EVERY\n.*\(default: 60\)\n", text), text
    assert re.search(r"--straggler_factor STRAGGLER_FACTOR\n.*\(default: 1\.2\)\n", text), text
    examples = text.split("\nexamples:\n")[1]
    assert examples.count("  ddpkit run ") == 3, examples
