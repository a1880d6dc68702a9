"""How ``ddpkit``'s command line reads: errors in one line (as ddpkit's own checks), each flag's
default in its help, the examples at the end of ``ddpkit run --help``, and the version.
"""

from __future__ import annotations

import argparse
from importlib import metadata
from typing import NoReturn

__all__ = ["RUN_EXAMPLES", "HelpWithDefaults", "OneLineErrors", "torch_version"]


class HelpWithDefaults(argparse.RawDescriptionHelpFormatter):
    """Each flag's default at the end of its help (where it has one and the help does not say it),
    and the examples kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and action.default not in (None, "", False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


RUN_EXAMPLES = """examples:
  ddpkit run --nproc-per-node 2 train.py --epochs 10
      two workers on this machine (torchrun's command line with ddpkit run in its place)
  ddpkit run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST --max-restarts 3 train.py
      on each of two nodes: they meet at HOST, and a failure restarts every worker, up to 3 times
  ddpkit run --nnodes 2:3 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST --recovery in-place \\
      --max-restarts 3 train.py
      on three nodes: a lost worker is replaced while the others go on, the third node waits as a spare
"""


class OneLineErrors(argparse.ArgumentParser):
    """argparse's parser, whose errors (an unknown flag, a value not among a flag's choices, one
    missing) are one line, as ddpkit's own checks are, instead of the whole usage first."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}. `{self.prog} --help` lists the flags.\n")


def torch_version() -> str:
    """The installed torch's version, read without importing it (the launcher stays torch-free)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "not installed"
