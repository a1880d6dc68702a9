"""The README's code is a promise: its Python snippets run as written (the Quickstart under ``ddpkit
run`` and as one process, the test pool as a script), and the names it uses are there."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_the_snippets_these_tests_run() -> None:
    snippets = python_snippets()
    assert len(snippets) == 2 and "init_dist_connection(env)" in snippets[0] and "WorkerPool(2)" in snippets[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launch", [["-m", "ddpkit", "run", "--nproc-per-node", "2"], []], ids=["ddpkit-run", "alone"])
def test_the_quickstart_runs_under_ddpkit_run_and_as_one_process(tmp_path: Path, launch: list[str]) -> None:
    # One write (the ranks print at once, each piece a write of its own when unbuffered).
    (tmp_path / "script.py").write_text(python_snippets()[0] + "print(f'done {env.global_rank()} {mean_loss.item()}')\n")
    result = subprocess.run([sys.executable, *launch, "script.py"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = ["done 0 0.375", "done 1 0.375"] if launch else ["done 0 0.25"]
    # (two ranks write to one pipe: a line of one may run into the other's)
    assert sorted(re.findall(r"done \d \d+\.\d+", result.stdout)) == expected, result.stdout


@pytest.mark.timeout(120)
def test_the_test_pool_snippet_runs_as_a_script(tmp_path: Path) -> None:
    (tmp_path / "check.py").write_text(python_snippets()[1])
    result = subprocess.run([sys.executable, "check.py"], cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_lightning_line_works_after_import_ddpkit() -> None:
    """``Trainer(strategy=ddpkit.lightning.DDPStrategy())`` after ``import ddpkit`` alone."""
    code = "import ddpkit; print(ddpkit.lightning.DDPStrategy.__name__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert result.returncode == 0 and result.stdout == "DDPStrategy\n", result.stderr[-3000:]


def test_init_dist_connection_takes_torchs_backend_keyword_and_refuses_two_that_differ() -> None:
    code = ("import ddpkit, torch.distributed as dist\n"
            "env = ddpkit.detect_environment()\n"
            "ddpkit.init_dist_connection(env, backend='gloo')\n"
            "print(dist.get_backend())\n"
            "ddpkit.destroy_dist_connection()\n"
            "try:\n"
            "    ddpkit.init_dist_connection(env, 'gloo', backend='nccl')\n"
            "except ValueError as error:\n"
            "    print(error)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "gloo", "init_dist_connection was given backend='nccl' and torch_distributed_backend='gloo': they name the "
                "same setting. Give one of them."], result.stdout


def test_the_readme_is_read_in_one_sitting() -> None:
    """At most 250 lines: the reference lives in docs/ (api.md, glossary.md, troubleshooting.md...)."""
    lines = README.read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move reference material to docs/"
