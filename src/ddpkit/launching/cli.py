"""``ddpkit run``: start the workers of one node and watch them (also ``python -m ddpkit run``);
``ddpkit store``: keep a job's store outside the training nodes (``launching.store_host``);
``ddpkit report FILE [--plot out.png]``: what ``ddpkit run --metrics FILE`` wrote (``health.report``).

    ddpkit run [--nproc-per-node N|auto] [--nnodes M] [--node-rank R] [--master-addr A]
               [--master-port P] [--standalone] [--rdzv-backend c10d --rdzv-endpoint HOST[:PORT]
               --rdzv-id ID [--rdzv-conf join_timeout=S]] [--backend gloo|nccl] [--max-restarts N]
               [--preemption-signal SIG] [--recovery fail-fast|in-place]
               [--log-dir DIR] [-r|--redirects S] [-t|--tee S] [--local-ranks-filter R,..]
               [--report-every S] [--metrics FILE] [--straggler-factor F] [--stragglers name|replace]
               [-m|--module | --no-python] script.py [script args...]

Flags follow torchrun's names (the underscore spellings work too). Each can also come from the
environment: DDPKIT_NPROC_PER_NODE, DDPKIT_NNODES, DDPKIT_NODE_RANK, DDPKIT_MASTER_ADDR,
DDPKIT_MASTER_PORT, DDPKIT_BACKEND, DDPKIT_MAX_RESTARTS, DDPKIT_PREEMPTION_SIGNAL (which the
workers read too: ``ddpkit.environments.preemption``), DDPKIT_RECOVERY (the workers' too:
``ddpkit.training.recovery``), DDPKIT_LOG_DIR, DDPKIT_REDIRECTS, DDPKIT_TEE, DDPKIT_LOCAL_RANKS_FILTER (where
the workers' output goes: ``workers.output``); the switches DDPKIT_STANDALONE, DDPKIT_MODULE,
DDPKIT_NO_PYTHON when 1. ``auto`` means one process per GPU, or one
per CPU core without CUDA (torchrun's choice). Under a scheduler that already started the processes (srun,
torchrun, mpirun, jsrun, Kubeflow: see ``detect_environment``), the script runs once in this
process instead.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from collections.abc import Sequence

from ddpkit import __version__
from ddpkit.environments import LocalEnvironment, Recovery, detect_environment
from ddpkit.environments.preemption import parse_signal
from ddpkit.health.report import report
from ddpkit.launching.config import LaunchConfig, LaunchError, RunAs
from ddpkit.launching.launcher import run_workers, stop_signals
from ddpkit.launching.rendezvous import (
    DEFAULT_PORT,
    Endpoint,
    RendezvousSettings,
    StoreWaits,
    parse_endpoint,
    parse_rdzv_conf,
)
from ddpkit.launching.store_host import serve_outside_nodes
from ddpkit.launching.torchrun_flags import add_torchrun_flags, notes_for
from ddpkit.launching.usage import RUN_EXAMPLES, HelpWithDefaults, OneLineErrors, torch_version
from ddpkit.launching.worker_environment import worker_command
from ddpkit.logs import get_logger
from ddpkit.variables import DDPKIT_PREEMPTION_SIGNAL, launcher_flag_variable
from ddpkit.workers.output import OutputPlan, parse_local_ranks, parse_streams

__all__ = ["main"]

_log = get_logger("launching")


# torchrun's one-letter spellings.
_SHORT = {"redirects": "-r", "tee": "-t", "module": "-m"}


def _spellings(name: str) -> list[str]:
    """Every spelling of flag ``name``: its short one (torchrun's), dashed, underscored."""
    dashed, underscored = f"--{name}", f"--{name.replace('-', '_')}"
    short = [_SHORT[name]] if name in _SHORT else []
    return [*short, dashed] if dashed == underscored else [*short, dashed, underscored]


def _flag(parser: argparse._ActionsContainer, name: str, **kwargs: object) -> None:
    environment = launcher_flag_variable(name)
    default = os.environ.get(environment, kwargs.pop("default", None))
    help_text = f"{kwargs.pop('help', '')} (environment: {environment})"
    parser.add_argument(*_spellings(name), dest=name.replace("-", "_"), default=default, help=help_text, **kwargs)  # type: ignore[arg-type]


def _switch(parser: argparse._ActionsContainer, name: str, help: str) -> None:  # noqa: A002 - argparse's name
    """An on/off flag, also on when its DDPKIT_ variable is 1, true or yes."""
    environment = launcher_flag_variable(name)
    default = os.environ.get(environment, "").strip().lower() in ("1", "true", "yes")
    parser.add_argument(*_spellings(name), dest=name.replace("-", "_"), action="store_true", default=default,
                        help=f"{help} (environment: {environment}=1)")


def _health_flags(run: argparse.ArgumentParser) -> None:
    """The job's health (``health.job_health``) and what a straggler costs (``health.straggler_replacement``)."""
    health = run.add_argument_group("the job's health, metrics and stragglers")
    _flag(health, "report-every", default="60",
          help="seconds between two lines of the job's health (steps/s, step time, the slowest rank and phase); 0: none")
    _flag(health, "metrics", default=None,
          help="a file to append each window's per-rank step phases, stragglers and recoveries to (JSON lines; "
               "ddpkit report FILE reads it)")
    _flag(health, "straggler-factor", default="1.2",
          help="how much slower than the others' median a rank's compute or data wait must stay to be named")
    _flag(health, "stragglers", default="name", choices=["name", "replace"],
          help="what a straggler costs: name it (the default), or replace its node by a waiting spare node "
               "(with --recovery in-place across nodes; the others' workers go on)")


def _run_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``ddpkit run``'s flags, in groups: the job's shape, what a failure costs, the output, the health."""
    run = commands.add_parser("run", help="start and watch the workers of this node", allow_abbrev=False,
                              formatter_class=HelpWithDefaults, epilog=RUN_EXAMPLES,
                              description="Start this node's workers of a training script and watch them; a torchrun "
                                          "command line works as it is.")
    shape = run.add_argument_group("the job's shape (torchrun's flags)")
    recovery = run.add_argument_group("what a failure costs")
    output = run.add_argument_group("where the workers' output goes (torchrun's flags)")
    _flag(shape, "nproc-per-node", default="1", help="processes on this node: a number, or 'auto'")
    _flag(shape, "nnodes", default="1", help="number of nodes, or MIN:MAX with --rdzv-backend c10d and --recovery "
                                           "in-place (launchers beyond the world wait as spare nodes)")
    _flag(shape, "node-rank", default="0", help="this node's rank, 0..nnodes-1")
    _flag(shape, "master-addr", default="127.0.0.1", help="address of the node with rank 0")
    _flag(shape, "master-port", default=None, help="port on the master node (default: a free one, single node only)")
    _flag(shape, "backend", default=None, choices=list(_BACKENDS), help="torch.distributed backend")
    _flag(shape, "max-restarts", default="0", help="times to start every worker again after a failure")
    _flag(recovery, "preemption-signal", default="TERM",
          help="signal that asks the workers to save and stop, besides SIGTERM (e.g. USR1 for Slurm's "
               "--signal=USR1@90; then SIGUSR1 prints no stacks)")
    _flag(recovery, "recovery", default="fail-fast", choices=["fail-fast", "in-place"],
          help="what a killed worker costs: fail-fast ends (or, with --max-restarts, restarts) every worker; "
               "in-place replaces it from a warm spare while the others go on (each counts against --max-restarts)")
    _flag(shape, "rdzv-backend", default="static",
          help="'static' (the default: --node-rank, --master-addr, --master-port) or 'c10d': each node gets its "
               "node rank as it arrives at --rdzv-endpoint")
    _flag(shape, "rdzv-endpoint", default="",
          help=f"HOST[:PORT] (default port {DEFAULT_PORT}) of the rendezvous, the same on every node; the launcher on "
               "HOST hosts it (static: the master address and port)")
    _flag(shape, "rdzv-id", default="none", help="the job's name at the rendezvous, the same on every node")
    _flag(shape, "rdzv-conf", default="", help="torchrun's key=value,... settings; ddpkit reads join_timeout (seconds, "
                                             "default 600) and read_timeout (seconds, default 30)")
    _switch(shape, "standalone", help="one node on this machine: address and port chosen here (torchrun's flag)")
    _switch(shape, "module", help="run the script as a module, as 'python -m' does")
    _switch(shape, "no-python", help="run the script as a program (not with python); ddpkit's worker bootstrap "
                                   "(failure records, stack dumps, ending with the launcher) is then not in it")
    _flag(output, "log-dir", default=None,
          help="folder of the workers' log files: node<N>/attempt_<A>/<local rank>/{stdout,stderr}.log")
    _flag(output, "redirects", default="0",
          help="streams written to the log files only: 0 none, 1 stdout, 2 stderr, 3 both, or per local rank "
               "(0:3,1:2)")
    _flag(output, "tee", default="0",
          help="streams written to the log files and to the console, each line prefixed with [rank<N>]: (values "
               "as --redirects)")
    _flag(output, "local-ranks-filter", default="", help="local ranks shown on the console, e.g. 0 or 0,1 (default: all)")
    _health_flags(run)
    add_torchrun_flags(run, _spellings)
    run.add_argument("script", help="the training script (a module with -m, a program with --no-python)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def _parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="ddpkit", description="ddpkit: data-parallel training launcher")
    parser.add_argument("--version", action="version", version=f"ddpkit {__version__} (torch {torch_version()})")
    commands = parser.add_subparsers(dest="command", required=True)
    _run_parser(commands)
    store = commands.add_parser(
        "store", allow_abbrev=False,
        help="keep a job's store outside the training nodes (a head node): the --rdzv-endpoint of a c10d rendezvous, "
             "so that losing any training node leaves it")
    store.add_argument("--host", default="", help="the address to listen on (default: every interface)")
    store.add_argument("--port", default=str(DEFAULT_PORT), help=f"the port (default {DEFAULT_PORT}, torchrun's c10d port)")
    report = commands.add_parser("report", allow_abbrev=False,
                                 help="what the file of ddpkit run --metrics says: each window, the stragglers")
    report.add_argument("file", help="the file ddpkit run --metrics appended to")
    report.add_argument("--plot", default=None, help="draw the step time and phases per rank to this image (matplotlib)")
    return parser


_BACKENDS = ("gloo", "nccl", "mpi")


def _given(flag: str, argv: Sequence[str]) -> bool:
    """Whether ``flag`` is on the command line (any spelling)."""
    spellings = set(_spellings(flag))
    return any(arg in spellings or arg.split("=", 1)[0] in spellings for arg in argv)


def _origin(flag: str, argv: Sequence[str]) -> str:
    """How the user gave ``flag``: the flag itself, or its DDPKIT_ environment variable."""
    variable = launcher_flag_variable(flag)
    return variable if not _given(flag, argv) and variable in os.environ else f"--{flag}"


def _integer(flag: str, value: str, argv: Sequence[str]) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise LaunchError(f"{_origin(flag, argv)}={value!r} is not an integer.") from None


#: The most processes ``ddpkit run`` starts on one node: a GPU node has 8 or 16, a CPU node's cores are
#: shared among its processes; a larger count is most likely a typo, and each would be an interpreter with torch.
MAX_PROCESSES_PER_NODE = 1024


def _nproc(value: str, argv: Sequence[str]) -> int:
    if value == "auto":
        import torch  # only here: the launcher itself needs no torch, and importing it takes seconds

        return torch.cuda.device_count() if torch.cuda.is_available() else (os.cpu_count() or 1)
    count = _integer("nproc-per-node", value, argv)
    if count > MAX_PROCESSES_PER_NODE:
        raise LaunchError(f"{_origin('nproc-per-node', argv)}={count}: more than {MAX_PROCESSES_PER_NODE} processes on "
                          "one node, which ddpkit run takes for a typo. Give the number of GPUs (or a share of the "
                          "cores), and spread more processes over several nodes (--nnodes).")
    return count


def _nnodes(value: str, argv: Sequence[str]) -> tuple[int, int | None]:
    """``--nnodes N``, or torchrun's elastic ``MIN:MAX`` (then MAX, else None)."""
    if ":" in str(value):
        low, _, high = str(value).partition(":")
        least, most = _integer("nnodes", low.strip(), argv), _integer("nnodes", high.strip(), argv)
        return least, (None if least == most else most)
    return _integer("nnodes", value, argv), None


def _standalone(nnodes: int, node_rank: int, master_port: str | None, argv: Sequence[str]) -> tuple[str, None]:
    """``--standalone``: this machine only, on a free port of 127.0.0.1 (torchrun's meaning)."""
    if nnodes != 1 or node_rank != 0:
        raise LaunchError(f"--standalone with {_origin('nnodes', argv)}={nnodes} and {_origin('node-rank', argv)}="
                          f"{node_rank}: --standalone is one node on this machine. Leave out --standalone to run "
                          "across nodes, or --nnodes and --node-rank to run here.")
    if master_port not in (None, ""):
        _log.warning(f"ddpkit run: --standalone chooses a free port itself; {_origin('master-port', argv)}="
                     f"{master_port} is not used (as with torchrun).")
    return "127.0.0.1", None


def _rendezvous(args: argparse.Namespace, argv: Sequence[str]) -> tuple[RendezvousSettings | None, Endpoint | None]:
    """The c10d rendezvous asked for (``launching.rendezvous``), or None for a static one; and a
    static one's --rdzv-endpoint, which (torchrun's meaning) stands for --master-addr and --master-port."""
    backend = (args.rdzv_backend or "static").strip()
    if backend not in ("static", "c10d"):
        raise LaunchError(f"{_origin('rdzv-backend', argv)}={backend!r}: ddpkit run's rendezvous is 'static' or "
                          "'c10d' (torchrun's etcd backends are not supported). Use c10d with --rdzv-endpoint.")
    endpoint = None
    if args.rdzv_endpoint:
        try:
            endpoint = parse_endpoint(args.rdzv_endpoint)
        except ValueError as error:
            raise LaunchError(str(error).replace("--rdzv-endpoint", _origin("rdzv-endpoint", argv))) from None
    if backend == "static":
        if endpoint is not None:  # it stands for --master-addr: say it as the user gave it
            try:
                socket.getaddrinfo(endpoint.host, None)
            except (socket.gaierror, UnicodeError) as error:
                raise LaunchError(f"{_origin('rdzv-endpoint', argv)}={args.rdzv_endpoint!r}: the host {endpoint.host!r} "
                                  f"does not resolve ({error}). Give the address of the node with rank 0.") from None
        return None, endpoint
    if endpoint is None:
        raise LaunchError(f"{_origin('rdzv-backend', argv)}=c10d needs --rdzv-endpoint HOST[:PORT]: an address of one "
                          "of the job's nodes, the same on every node (its launcher hosts the rendezvous).")
    for flag in ("node-rank", "master-addr", "master-port"):
        if _given(flag, argv):
            _log.warning(f"ddpkit run: --{flag} is not used with --rdzv-backend c10d: the rendezvous gives the "
                         "node rank, and the endpoint is the master address and port.")
    return RendezvousSettings(endpoint, str(args.rdzv_id)), None


def _store_waits(conf: str | None) -> StoreWaits:
    """``--rdzv-conf join_timeout=S,read_timeout=S``: how long the launchers wait for one another,
    and for one answer from the job's store (a c10d rendezvous, and static nodes)."""
    try:
        return parse_rdzv_conf(conf or "")
    except ValueError as error:
        raise LaunchError(str(error)) from None


def _run_as(module: bool, no_python: bool) -> RunAs:
    if module and no_python:
        raise LaunchError("--module and --no-python together: a module runs in python. Give one of them.")
    return RunAs.MODULE if module else RunAs.PROGRAM if no_python else RunAs.SCRIPT


def _recovery(value: str, argv: Sequence[str]) -> Recovery:
    """argparse checks the choices given on the command line, not a DDPKIT_RECOVERY default."""
    try:
        return Recovery.parse(value, _origin("recovery", argv), "the default is fail-fast")
    except ValueError as error:
        raise LaunchError(str(error)) from None


def _stragglers(value: str, argv: Sequence[str]) -> bool:
    """Whether stragglers' nodes are replaced; argparse checks the command line's choice, not DDPKIT_STRAGGLERS's."""
    if value.strip().lower() not in ("name", "replace"):
        raise LaunchError(f"{_origin('stragglers', argv)}={value!r}: give name (stragglers are named) or replace "
                          "(a straggler's node is handed to a waiting spare node).")
    return value.strip().lower() == "replace"


def _output_plan(args: argparse.Namespace, nproc_per_node: int, argv: Sequence[str]) -> OutputPlan:
    try:
        return OutputPlan(
            log_dir=args.log_dir or None,
            redirects=parse_streams(_origin("redirects", argv), args.redirects, nproc_per_node),
            tee=parse_streams(_origin("tee", argv), args.tee, nproc_per_node),
            shown=parse_local_ranks(args.local_ranks_filter, nproc_per_node),
        )
    except ValueError as error:
        raise LaunchError(str(error)) from None


def _number(flag: str, value: str, argv: Sequence[str], least: float, what: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if not number >= least or number == float("inf"):
        raise LaunchError(f"{_origin(flag, argv)}={value!r} is not {what}.")
    return number


def _torchrun_timings(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, float]:
    """torchrun's ``--monitor-interval`` and ``--shutdown-timeout``, as ``run_workers``'s poll interval
    and grace, where given."""
    timings = {}
    if args.monitor_interval is not None:
        timings["poll_interval"] = _number("monitor-interval", args.monitor_interval, argv, 0.001,
                                           "a number of seconds above 0, e.g. 0.1")
    if args.shutdown_timeout is not None:
        timings["grace"] = _number("shutdown-timeout", args.shutdown_timeout, argv, 0.0,
                                   "a number of seconds, 0 or more, e.g. 30")
    return timings


def _backend(value: str | None, argv: Sequence[str]) -> str | None:
    if value not in (None, "", *_BACKENDS):  # argparse checks choices on the command line, not defaults
        raise LaunchError(f"{_origin('backend', argv)}={value!r} is not a backend; use one of {', '.join(_BACKENDS)}.")
    return value or None


# What the environments detect a scheduler's process by (``ddpkit.environments``), named when they
# are malformed.
_SCHEDULER_VARIABLES = ("TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID", "OMPI_COMM_WORLD_RANK",
                        "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "MV2_COMM_WORLD_RANK", "LSB_JOBID",
                        "JSM_NAMESPACE_RANK", "KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK",
                        "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")


def _started_by_a_scheduler() -> str | None:
    """The name of the scheduler that already started this process as one of many, if any."""
    environment = detect_environment()
    if isinstance(environment, LocalEnvironment) or environment.world_size() <= 1:
        return None
    return type(environment).__name__


def _serve_store(args: argparse.Namespace) -> int:
    """``ddpkit store``: the job's store in this process until it is stopped."""
    if not args.port.isdigit() or not 1 <= int(args.port) <= 65535:
        print(f"ddpkit store: --port={args.port!r} is not a TCP port (1..65535).", file=sys.stderr)
        return 2
    return serve_outside_nodes(args.host, int(args.port))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.command == "store":
        return _serve_store(args)
    if args.command == "report":
        return report(args.file, args.plot)
    for name, value in vars(args).items():  # argparse gives `--flag=--` as an empty list: no value at all
        if isinstance(value, list) and name != "script_args":
            print(f"ddpkit run: --{name.replace('_', '-')} was given '--', which is no value for it (it ends the flags). "
                  "Give it a value.", file=sys.stderr)
            return 2
    # Only ddpkit's own flags (before the script) can name a flag's origin.
    launcher_argv = argv[: argv.index(args.script)] if args.script in argv else argv
    try:
        scheduler = _started_by_a_scheduler()
    except ValueError as error:  # malformed scheduler variables: say so before anything starts
        given = [name for name in _SCHEDULER_VARIABLES if name in os.environ]
        print(f"ddpkit run: {error} (ddpkit run took this process for one a scheduler started, from "
              f"{', '.join(given) or 'its variables'}: start it that way, or unset them to have ddpkit run start "
              "the workers)", file=sys.stderr)
        return 2
    try:
        preemption_signal = parse_signal(args.preemption_signal, _origin("preemption-signal", launcher_argv))
    except ValueError as error:
        print(f"ddpkit run: {error}", file=sys.stderr)
        return 2
    if scheduler is not None:
        return _run_in_this_process(args, scheduler, preemption_signal)
    try:
        config = _launch_config(args, launcher_argv, preemption_signal)
        timings = _torchrun_timings(args, launcher_argv)
        for note in notes_for(args):
            _log.info(note)
        code = run_workers(args.script, args.script_args, config, **timings)
    except LaunchError as error:
        print(f"ddpkit run: {error}", file=sys.stderr)
        return 2
    # The launcher's own exit is left (a moment, with torch imported), through which its handlers stay
    # out of a stop signal's way: the interpreter's finalisation puts the default action back, which
    # would end the process with the signal's code instead of the job's.
    for stop in stop_signals(config.preemption_signal):
        signal.signal(stop, signal.SIG_IGN)
    return code


def _run_in_this_process(args: argparse.Namespace, scheduler: str, preemption_signal: signal.Signals) -> int:
    """The scheduler started every process already (srun, torchrun, mpirun, ...): run the script
    here, once, instead of starting --nproc-per-node more. It signals the process itself."""
    os.environ[DDPKIT_PREEMPTION_SIGNAL] = preemption_signal.name
    _log.info(f"ddpkit run: {scheduler} started this process; running {args.script} in it directly")
    try:
        command = worker_command(_run_as(args.module, args.no_python), args.script, args.script_args)
    except LaunchError as error:
        print(f"ddpkit run: {error}", file=sys.stderr)
        return 2
    os.execvp(command[0], command)


def _launch_config(args: argparse.Namespace, launcher_argv: Sequence[str],
                   preemption_signal: signal.Signals) -> LaunchConfig:
    """What ``ddpkit run`` was asked to do, each flag read and checked (``LaunchError`` names a bad one)."""
    nproc_per_node = _nproc(args.nproc_per_node, launcher_argv)
    nnodes, max_nodes = _nnodes(args.nnodes, launcher_argv)
    node_rank = _integer("node-rank", args.node_rank, launcher_argv)
    master_addr, master_port = args.master_addr, args.master_port
    rendezvous = None
    if args.standalone:
        master_addr, master_port = _standalone(nnodes, node_rank, master_port, launcher_argv)
    else:
        rendezvous, static_endpoint = _rendezvous(args, launcher_argv)
        if static_endpoint is not None:
            master_addr, master_port = static_endpoint.host, str(static_endpoint.port)
    return LaunchConfig(
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        max_nodes=max_nodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=None if master_port in (None, "") else _integer("master-port", master_port, launcher_argv),
        backend=_backend(args.backend, launcher_argv),
        max_restarts=_integer("max-restarts", args.max_restarts, launcher_argv),
        preemption_signal=preemption_signal,
        recovery=_recovery(args.recovery, launcher_argv),
        run_as=_run_as(args.module, args.no_python),
        output=_output_plan(args, nproc_per_node, launcher_argv),
        rendezvous=rendezvous,
        store_waits=_store_waits(args.rdzv_conf),
        report_every=_number("report-every", args.report_every, launcher_argv, 0.0,
                             "a number of seconds: give 0 (no health line) or more, e.g. 60"),
        metrics=args.metrics or None,
        straggler_factor=_number("straggler-factor", args.straggler_factor, launcher_argv, 1.0,
                                 "a factor of 1 or more (a rank this much slower than the others is named), e.g. 1.2"),
        replace_stragglers=_stragglers(args.stragglers, launcher_argv),
        role=args.role,
    )


if __name__ == "__main__":
    sys.exit(main())
