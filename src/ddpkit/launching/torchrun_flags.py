"""torchrun's flags that ``ddpkit run`` has no flag of its own for, so that a torchrun command line
runs as it is: each is accepted (dashed and underscored), three with torchrun's meaning, and each of
the others, when given, says in one line what ddpkit does instead.

With torchrun's meaning: ``--monitor-interval`` (how often the launcher looks at its workers),
``--shutdown-timeout`` (how long the workers get between SIGTERM and SIGKILL) and ``--role``
(``ROLE_NAME``). ``tests/test_launch_surface.py`` reads the installed torchrun's parser and fails
when it has a flag ``ddpkit run`` does not take, so that a new torch release is noticed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ddpkit.variables import DDPKIT_FORK_WORKERS

__all__ = ["TORCHRUN_NOTES", "add_torchrun_flags", "notes_for"]

# Flag -> (what it takes, the line said when it is given).
TORCHRUN_NOTES: dict[str, tuple[str, str]] = {
    "start-method": ("spawn|fork|forkserver", "ddpkit run forks a script's workers from one process per node that "
                     f"imported torch once ({DDPKIT_FORK_WORKERS}=0: a fresh interpreter each, as torchrun starts a "
                     "script's); torchrun's start method applies to functions only"),
    "event-log-handler": ("NAME", "ddpkit run records no torchelastic events; --metrics FILE records the job's "
                          "windows, stragglers and recoveries"),
    "run-path": ("", "ddpkit run's worker bootstrap runs the script with runpy.run_path already"),
    "local-addr": ("ADDRESS", "ddpkit run's workers reach each other at the addresses torch.distributed finds "
                   "(GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME choose the interface); the rendezvous is at "
                   "--rdzv-endpoint or --master-addr"),
    "logs-specs": ("NAME", "ddpkit run writes the workers' logs as --log-dir, --redirects and --tee say"),
    "numa-binding": ("node|socket|exclusive|core-complex", "ddpkit run binds no worker to CPUs; start the command "
                     "under numactl or taskset to bind"),
    "signals-to-handle": ("SIGNALS", "ddpkit run passes SIGTERM and SIGINT on to its workers, and "
                          "--preemption-signal, which asks them to save and stop"),
    "virtual-local-rank": ("", "ddpkit run gives each worker its own LOCAL_RANK and every device; pick the "
                           "device from LOCAL_RANK, or set CUDA_VISIBLE_DEVICES per worker"),
    "duplicate-stdout-filters": ("WORDS", "ddpkit run copies no filtered lines to a file of their own; --tee with "
                                 "--log-dir keeps every line"),
    "duplicate-stderr-filters": ("WORDS", "ddpkit run copies no filtered lines to a file of their own; --tee with "
                                 "--log-dir keeps every line"),
}
_SWITCHES = {"run-path", "virtual-local-rank"}
_CHOICES = {"start-method": ["spawn", "fork", "forkserver"],
            "numa-binding": ["node", "socket", "exclusive", "core-complex"]}


def add_torchrun_flags(run: argparse.ArgumentParser,
                       spellings: Callable[[str], list[str]]) -> None:
    """Add torchrun's flags that ddpkit has none of its own for to the ``run`` parser, under a group
    of their own (``spellings``: a flag's dashed and underscored names)."""
    group = run.add_argument_group("torchrun's flags that ddpkit run takes another way")
    group.add_argument(*spellings("monitor-interval"), dest="monitor_interval", default=None, metavar="SECONDS",
                       help="how often the launcher looks at its workers (torchrun's meaning; default 0.05)")
    group.add_argument(*spellings("shutdown-timeout"), dest="shutdown_timeout", default=None, metavar="SECONDS",
                       help="how long the workers get between SIGTERM and SIGKILL (torchrun's meaning; default 3)")
    group.add_argument(*spellings("role"), dest="role", default="default",
                       help="the workers' role, their ROLE_NAME (torchrun's meaning)")
    for name, (takes, note) in TORCHRUN_NOTES.items():
        dest = name.replace("-", "_")
        if name in _SWITCHES:
            group.add_argument(*spellings(name), dest=dest, action="store_true", default=False,
                               help=f"accepted: {note}")
        else:
            group.add_argument(*spellings(name), dest=dest, default=None, metavar=takes, choices=_CHOICES.get(name),
                               help=f"accepted: {note}")


def notes_for(args: argparse.Namespace) -> list[str]:
    """One line for each of torchrun's flags given that ddpkit takes another way."""
    return [f"ddpkit run: --{name} is accepted for torchrun's command lines: {note}."
            for name, (_, note) in TORCHRUN_NOTES.items()
            if getattr(args, name.replace("-", "_")) not in (None, False)]
