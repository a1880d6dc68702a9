"""``ddpkit run``: start the workers of one node and watch them (also ``python -m ddpkit run``).

    ddpkit run [--nproc-per-node N|auto] [--nnodes M] [--node-rank R] [--master-addr A]
               [--master-port P] [--backend gloo|nccl] [--max-restarts N] [--preemption-signal SIG]
               [--recovery fail-fast|in-place] script.py [script args...]

Flags follow torchrun's names (the underscore spellings work too). Each can also come from the
environment: DDPKIT_NPROC_PER_NODE, DDPKIT_NNODES, DDPKIT_NODE_RANK, DDPKIT_MASTER_ADDR,
DDPKIT_MASTER_PORT, DDPKIT_BACKEND, DDPKIT_MAX_RESTARTS, DDPKIT_PREEMPTION_SIGNAL (which the
workers read too: ``ddpkit.preemption``), DDPKIT_RECOVERY (the workers' too:
``ddpkit.recovery``). ``auto`` means one process per GPU, or one
per CPU core without CUDA (torchrun's choice). Under a scheduler that already started the processes (srun,
torchrun, mpirun, jsrun, Kubeflow: see ``detect_environment``), the script runs once in this
process instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ddpkit.environments import LocalEnvironment, detect_environment
from ddpkit.launching.launcher import LaunchConfig, LaunchError, run_workers
from ddpkit.logs import get_logger
from ddpkit.preemption import PREEMPTION_SIGNAL_VARIABLE, parse_signal

__all__ = ["main"]

_log = get_logger("launching")


def _flag(parser: argparse.ArgumentParser, name: str, **kwargs: object) -> None:
    dashed, underscored = f"--{name}", f"--{name.replace('-', '_')}"
    spellings = [dashed] if dashed == underscored else [dashed, underscored]
    environment = "DDPKIT_" + name.replace("-", "_").upper()
    default = os.environ.get(environment, kwargs.pop("default", None))
    help_text = f"{kwargs.pop('help', '')} (environment: {environment})"
    parser.add_argument(*spellings, dest=name.replace("-", "_"), default=default, help=help_text, **kwargs)  # type: ignore[arg-type]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddpkit", description="ddpkit: data-parallel training launcher")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="start and watch the workers of this node", allow_abbrev=False)
    _flag(run, "nproc-per-node", default="1", help="processes on this node: a number, or 'auto'")
    _flag(run, "nnodes", default="1", help="number of nodes")
    _flag(run, "node-rank", default="0", help="this node's rank, 0..nnodes-1")
    _flag(run, "master-addr", default="127.0.0.1", help="address of the node with rank 0")
    _flag(run, "master-port", default=None, help="port on the master node (default: a free one, single node only)")
    _flag(run, "backend", default=None, choices=list(_BACKENDS), help="torch.distributed backend")
    _flag(run, "max-restarts", default="0", help="times to start every worker again after a failure")
    _flag(run, "preemption-signal", default="TERM",
          help="signal that asks the workers to save and stop, besides SIGTERM (e.g. USR1 for Slurm's "
               "--signal=USR1@90; then SIGUSR1 prints no stacks)")
    _flag(run, "recovery", default="fail-fast", choices=["fail-fast", "in-place"],
          help="what a killed worker costs: fail-fast ends (or, with --max-restarts, restarts) every worker; "
               "in-place replaces it from a warm spare while the others go on (each counts against --max-restarts)")
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


_BACKENDS = ("gloo", "nccl", "mpi")


def _origin(flag: str, argv: Sequence[str]) -> str:
    """How the user gave ``flag``: the flag itself, or its DDPKIT_ environment variable."""
    spellings = {f"--{flag}", f"--{flag.replace('-', '_')}"}
    given = any(arg in spellings or arg.split("=", 1)[0] in spellings for arg in argv)
    variable = "DDPKIT_" + flag.replace("-", "_").upper()
    return variable if not given and variable in os.environ else f"--{flag}"


def _integer(flag: str, value: str, argv: Sequence[str]) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise LaunchError(f"{_origin(flag, argv)}={value!r} is not an integer.") from None


def _nproc(value: str, argv: Sequence[str]) -> int:
    if value == "auto":
        import torch  # only here: the launcher itself needs no torch, and importing it takes seconds

        return torch.cuda.device_count() if torch.cuda.is_available() else (os.cpu_count() or 1)
    return _integer("nproc-per-node", value, argv)


def _backend(value: str | None, argv: Sequence[str]) -> str | None:
    if value not in (None, "", *_BACKENDS):  # argparse checks choices on the command line, not defaults
        raise LaunchError(f"{_origin('backend', argv)}={value!r} is not a backend; use one of {', '.join(_BACKENDS)}.")
    return value or None


def _started_by_a_scheduler() -> str | None:
    """The name of the scheduler that already started this process as one of many, if any."""
    environment = detect_environment()
    if isinstance(environment, LocalEnvironment) or environment.world_size() <= 1:
        return None
    return type(environment).__name__


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    # Only ddpkit's own flags (before the script) can name a flag's origin.
    launcher_argv = argv[: argv.index(args.script)] if args.script in argv else argv
    try:
        scheduler = _started_by_a_scheduler()
    except ValueError as error:  # malformed scheduler variables: say so before anything starts
        print(f"ddpkit run: {error}", file=sys.stderr)
        return 2
    try:
        preemption_signal = parse_signal(args.preemption_signal, _origin("preemption-signal", launcher_argv))
    except ValueError as error:
        print(f"ddpkit run: {error}", file=sys.stderr)
        return 2
    if scheduler is not None:
        # The scheduler started every process already (srun, torchrun, mpirun, ...): run the
        # script here, once, instead of starting --nproc-per-node more. It signals the process itself.
        os.environ[PREEMPTION_SIGNAL_VARIABLE] = preemption_signal.name
        _log.info(f"ddpkit run: {scheduler} started this process; running {args.script} in it directly")
        os.execv(sys.executable, [sys.executable, "-m", "ddpkit.launching.worker", args.script, *args.script_args])
    try:
        config = LaunchConfig(
            nproc_per_node=_nproc(args.nproc_per_node, launcher_argv),
            nnodes=_integer("nnodes", args.nnodes, launcher_argv),
            node_rank=_integer("node-rank", args.node_rank, launcher_argv),
            master_addr=args.master_addr,
            master_port=None if args.master_port in (None, "") else _integer("master-port", args.master_port,
                                                                             launcher_argv),
            backend=_backend(args.backend, launcher_argv),
            max_restarts=_integer("max-restarts", args.max_restarts, launcher_argv),
            preemption_signal=preemption_signal,
            recovery=args.recovery,
        )
        return run_workers(args.script, args.script_args, config)
    except LaunchError as error:
        print(f"ddpkit run: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
