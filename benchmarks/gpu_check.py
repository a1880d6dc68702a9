"""The GPU check: everything ddpkit needs to know from a GPU machine, in one bounded command.

    PYTHONPATH=src python3 benchmarks/gpu_check.py [--dry-run] [--out DIR] [--budget SECONDS]

A GPU machine is at hand only now and then, for minutes, with its own Python and torch and no
network: this runs from a checkout with nothing installed (``PYTHONPATH=src``), on any torch >= 2.4,
and writes ``gpu_check.json`` and ``gpu_check.md`` to ``--out`` (default ``$OUT`` when set, else
``gpu_check_out``). Its parts, each in a process of its own with a time limit (a part that fails or
overruns is reported and the others still run; all of them within ``--budget``, 480 s by default):

- **environment**: Python, torch, CUDA, NCCL and driver versions, the GPUs, and what this torch lacks
  (``shrink_group``);
- **tests**: ``tests/test_gpu.py`` (DDP on the device, the fp16/bf16 hooks and PowerSGD on CUDA
  tensors, SyncBatchNorm, a failure named, in-place recovery with CUDA tensors, and over NCCL
  behind ``DDPKIT_NCCL_IN_PLACE=1``): NCCL with one GPU per rank when there are two GPUs or more,
  else two ranks sharing the GPU over Gloo; each test's outcome and time;
- **step**: ``benchmarks/ddp_step.py --device cuda``, ddpkit against torch's DDP (its C++ reducer)
  on the MLP, LeNet, 120 and 1000 tensors: world 1 on NCCL, world 2 sharing the GPU over Gloo, and
  with two GPUs or more one rank per GPU on NCCL; step time and host time per step;
- **abort**: NCCL's abort and re-form in one process (a group formed, a collective, its
  communicators aborted, a new group formed, a collective), and with two GPUs or more across
  ranks: a peer SIGKILLed, the survivor's pending collective ended by the abort, ``shrink_group``
  where torch and the backend have it (reported when they do not), a group of the survivor
  formed, a collective; how long each took. The dry run runs both probes on Gloo.

``--dry-run`` runs the same plan on the CPU with Gloo (what needs CUDA or NCCL is skipped or run on
Gloo instead, and says so): CI runs it (tests/test_gpu_check.py), so the kit cannot rot. Exit code
0 when no part failed or overran.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parent.parent
BENCHMARKS = REPOSITORY / "benchmarks"
# Left for writing the report when the budget is spent on the parts.
_RESERVE_SECONDS = 5.0
_OLDEST_TORCH = (2, 4)


@dataclass
class Part:
    """One check's outcome: ``status`` passed, failed, timeout or skipped (``reason`` says why)."""

    name: str
    status: str = "skipped"
    seconds: float = 0.0
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    output: str = ""  # the end of what its process printed, when it did not pass


@dataclass
class Machine:
    """What the environment part found; the plan follows from it."""

    gpus: int
    dry_run: bool

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    @property
    def nccl(self) -> bool:
        return not self.dry_run and self.gpus >= 1


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def limit(self, wanted: float) -> float:
        """At most ``wanted`` seconds, and no more than what is left (less the report's reserve)."""
        return max(0.0, min(wanted, self.deadline - time.monotonic() - _RESERVE_SECONDS))


def child_environment(**variables: str) -> dict[str, str]:
    """This process's environment, with the checkout's ``src`` and ``tests`` on the path (nothing
    is installed on the GPU machine) and ``variables``."""
    paths = [str(REPOSITORY / "src"), str(REPOSITORY / "tests"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in paths if path), **variables}


def run_bounded(part: Part, command: list[str], seconds: float, environment: dict[str, str],
                cwd: Path = REPOSITORY) -> subprocess.CompletedProcess[str] | None:
    """Run ``command`` in a process group of its own, ended (the whole group) after ``seconds``;
    ``part`` gets the status, the time and, when it did not pass, the end of the output."""
    if seconds < 1:
        part.status, part.reason = "skipped", "no time left in the budget"
        return None
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=cwd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        part.status, part.reason = "timeout", f"still running after {seconds:.0f} s: ended"
        part.seconds, part.output = time.monotonic() - start, output[-4000:]
        return None
    part.seconds = time.monotonic() - start
    part.status = "passed" if process.returncode == 0 else "failed"
    if process.returncode != 0:
        part.reason = f"exit code {process.returncode}"
        part.output = output[-4000:]
    return subprocess.CompletedProcess(command, process.returncode, output, "")


# -- the parts ---------------------------------------------------------------------------------


def environment_part(dry_run: bool) -> tuple[Part, Machine]:
    import torch

    part = Part("environment", status="passed")
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    facts: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpus": gpus, "devices": [torch.cuda.get_device_name(index) for index in range(gpus)],
        "host": platform.node(), "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    if cuda:
        version = torch.cuda.nccl.version()
        facts["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    facts["driver"] = _driver()
    import torch.distributed as dist

    facts["shrink_group"] = hasattr(dist, "shrink_group")
    release = tuple(int(piece) for piece in torch.__version__.split("+")[0].split(".")[:2])
    lacking = []
    if release < _OLDEST_TORCH:
        lacking.append(f"torch {torch.__version__} is older than ddpkit's oldest ({'.'.join(map(str, _OLDEST_TORCH))})")
    if not facts["shrink_group"]:
        lacking.append("torch.distributed.shrink_group (the abort part forms a new group instead)")
    facts["lacking"] = lacking
    part.figures = facts
    if not dry_run and not cuda:
        part.status, part.reason = "failed", "no CUDA device (torch.cuda.is_available() is False): use --dry-run on a CPU"
    return part, Machine(gpus=gpus, dry_run=dry_run)


def _driver() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        answer = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return answer.stdout.strip().splitlines()[0] if answer.returncode == 0 and answer.stdout.strip() else None


def tests_part(machine: Machine, budget: Budget, out: Path) -> Part:
    part = Part("tests: tests/test_gpu.py")
    try:
        import pytest  # noqa: F401 - only whether it is there
    except ImportError:
        part.reason = "pytest is not installed here"
        return part
    if machine.dry_run:
        variables = {"GPU_TEST_DEVICE": "cpu"}
        part.figures["backend"] = "gloo on the CPU (dry run)"
    elif machine.gpus >= 2:
        variables = {"GPU_TEST_BACKEND": "nccl"}
        part.figures["backend"] = f"nccl, one GPU per rank ({machine.gpus} GPUs)"
    else:
        variables = {"GPU_TEST_BACKEND": "gloo"}
        part.figures["backend"] = "gloo, two ranks sharing the GPU"
    report = out / "tests.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={report}",
               str(REPOSITORY / "tests" / "test_gpu.py")]
    run_bounded(part, command, budget.limit(300), child_environment(**variables))
    if report.exists():
        part.figures["tests"] = _test_outcomes(report)
        outcomes = [test["outcome"] for test in part.figures["tests"]]
        part.figures["counts"] = {kind: outcomes.count(kind) for kind in sorted(set(outcomes))}
    return part


def _test_outcomes(report: Path) -> list[dict[str, Any]]:
    tests = []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                detail = (child.get("message") or "")[:300]
        tests.append({"name": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0),
                      **({"detail": detail} if detail else {})})
    return tests


def step_part(machine: Machine, budget: Budget, out: Path, ranks: int, backend: str, label: str,
              skip: str | None = None) -> Part:
    part = Part(f"step: {label}")
    if skip is not None:
        part.reason = skip
        return part
    figures = out / f"step-{ranks}-{backend}.json"
    models = ["mlp", "lenet", "many", "many1000"] if not machine.dry_run else ["lenet", "many"]
    steps = "100" if not machine.dry_run else "4"
    command = [sys.executable, str(BENCHMARKS / "ddp_step.py"), "--device", machine.device, "--ranks", str(ranks),
               "--backend", backend, "--steps", steps, "--models", *models, "--json", str(figures)]
    run_bounded(part, command, budget.limit(150), child_environment())
    if figures.exists():
        measured = json.loads(figures.read_text())
        part.figures = {"ranks": ranks, "backend": backend, "device": measured["device"], "models": {
            name: {"ddpkit_over_torch_step": round(model["ddpkit_over_torch_per_round"], 3),
                   "ddpkit_over_torch_host": round(model["host_ddpkit_over_torch"], 3),
                   "ddpkit_ms": round(model["median_ms"]["ddpkit"], 3),
                   "torch_ms": round(model["median_ms"]["torch DDP"], 3),
                   "host_ms": {name: round(ms, 3) for name, ms in model["host_ms"].items()}}
            for name, model in measured["models"].items()}}
    return part


def abort_part(machine: Machine, budget: Budget, out: Path, across: bool) -> Part:
    part = Part("abort: NCCL across ranks, a peer killed" if across else "abort: NCCL in one process")
    backend = "nccl" if machine.nccl else "gloo"
    if across and not machine.dry_run and machine.gpus < 2:
        part.reason = f"needs two GPUs, one per rank (NCCL): {machine.gpus} here"
        return part
    figures = out / f"abort-{'across' if across else 'one'}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--probe", "abort-across" if across else "abort-one",
               "--probe-backend", backend, "--probe-out", str(figures)]
    run_bounded(part, command, budget.limit(120), child_environment())
    if figures.exists():
        part.figures = json.loads(figures.read_text())
    if machine.dry_run:
        part.figures["note"] = "dry run: Gloo on the CPU in place of NCCL (the probe's code ran; NCCL's did not)"
    return part


# -- the probes: run in a process of their own (--probe) ------------------------------------------


def _timed(figures: dict[str, Any], name: str, action: Callable[[], Any]) -> Any:
    """Run ``action``, putting its seconds (or its error) in ``figures[name]``; return its result."""
    start = time.monotonic()
    try:
        result = action()
    except Exception as error:  # noqa: BLE001 - the probe reports what happened, whatever it was
        figures[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
                         "seconds": round(time.monotonic() - start, 4)}
        return None
    figures[name] = {"seconds": round(time.monotonic() - start, 4)}
    return result


def _timed_within(figures: dict[str, Any], name: str, action: Callable[[], Any], seconds: float) -> Any:
    """``_timed`` in a thread given ``seconds``: a call that never returns (a collective waiting for
    a dead peer) is reported as such, and the probe goes on."""
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(_timed(figures, name, action)), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        figures[name] = {"error": f"still running after {seconds:g} s", "seconds": seconds}
        return None
    return box[0]


def _abort_everything() -> None:
    """Abort every communicator of this process and leave its groups, as ddpkit's recovery does."""
    import torch.distributed as dist

    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        abort()
    elif dist.group.WORLD is not None:
        dist.group.WORLD.abort()
    if dist.is_initialized():
        dist.destroy_process_group()


def _collective(device: Any) -> float:
    import torch
    import torch.distributed as dist

    tensor = torch.ones(1 << 20, device=device)
    dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return float(tensor[0].item())


def probe_abort_one(backend: str) -> dict[str, Any]:
    """One process: form a group, a collective, abort its communicators, form another, a collective."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.HashStore()
    figures: dict[str, Any] = {"backend": backend}

    def form(generation: int) -> None:
        extra: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, store=dist.PrefixStore(f"generation{generation}", store), rank=0,
                                world_size=1, **extra)

    _timed(figures, "form", lambda: form(0))
    _timed(figures, "first collective", lambda: _collective(device))
    _timed(figures, "abort", _abort_everything)
    _timed(figures, "form again", lambda: form(1))
    figures["collective after"] = {"value": _timed(figures, "collective after re-forming", lambda: _collective(device))}
    if dist.is_initialized():
        dist.destroy_process_group()
    return figures


def probe_abort_across(backend: str, rank: int, port: int) -> dict[str, Any]:
    """Two ranks, one GPU each: rank 1 kills itself after a first collective; rank 0 starts a
    collective that cannot finish, aborts it, tries ``shrink_group``, forms a group of its own and
    runs a collective there."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    extra: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    figures: dict[str, Any] = {"backend": backend}
    _timed(figures, "form", lambda: dist.init_process_group(backend, store=dist.PrefixStore("generation0", store),
                                                            rank=rank, world_size=2, **extra))
    _timed(figures, "first collective", lambda: _collective(device))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)  # the peer is gone
    pending = torch.ones(1 << 20, device=device)
    work = dist.all_reduce(pending, async_op=True)
    time.sleep(2.0)
    figures["pending collective finished before the abort"] = work.is_completed()
    shrink = getattr(dist, "shrink_group", None)
    if shrink is None:
        figures["shrink_group"] = "not in this torch"
    else:
        # NCCL_SHRINK_ABORT (1): the communicator has an operation pending on the dead peer.
        shrunk = _timed_within(figures, "shrink_group", lambda: shrink([1], shrink_flags=1), 20)
        if shrunk is not None:
            _timed_within(figures, "collective on the shrunk group",
                          lambda: dist.all_reduce(torch.ones(4, device=device), group=shrunk), 20)
    _timed_within(figures, "abort", _abort_everything, 30)
    _timed_within(figures, "pending collective after the abort", work.wait, 10)
    _timed(figures, "form the survivors' group", lambda: dist.init_process_group(
        backend, store=dist.PrefixStore("generation1", store), rank=0, world_size=1, **extra))
    figures["collective after"] = {"value": _timed(figures, "collective after re-forming", lambda: _collective(device))}
    return figures


def run_probe(args: argparse.Namespace) -> int:
    if args.probe == "abort-one":
        figures = probe_abort_one(args.probe_backend)
    else:
        from ddpkit.environments import find_free_port

        port = find_free_port()
        peer = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--probe", "abort-across-peer",
                                 "--probe-backend", args.probe_backend, "--probe-port", str(port)],
                                env=child_environment())
        figures = probe_abort_across(args.probe_backend, 0, port)
        figures["peer exit code"] = peer.wait(timeout=30)
    Path(args.probe_out).write_text(json.dumps(figures, indent=1))
    failed = [name for name in _MUST_NOT_FAIL if isinstance(figures.get(name), dict) and "error" in figures[name]]
    return 1 if failed or figures["collective after"]["value"] != 1.0 else 0


# The probes' steps that must succeed: the pending collective is expected to fail, and shrink_group
# to be refused where torch or the backend lacks it (reported either way).
_MUST_NOT_FAIL = ("form", "first collective", "abort", "form again", "form the survivors' group",
                  "collective after re-forming")


# -- the report ---------------------------------------------------------------------------------


def summary(parts: list[Part], dry_run: bool) -> str:
    facts = parts[0].figures
    lines = [f"# ddpkit GPU check{' (dry run on the CPU)' if dry_run else ''}", "",
             f"{facts.get('date')} on {facts.get('host')}: {facts.get('gpus')} GPU(s) "
             f"{', '.join(sorted(set(facts.get('devices', [])))) or ''}; driver {facts.get('driver')}, "
             f"torch {facts.get('torch')}, CUDA {facts.get('cuda')}, NCCL {facts.get('nccl')}, "
             f"Python {facts.get('python')}.", ""]
    if facts.get("lacking"):
        lines += ["Lacking here: " + "; ".join(facts["lacking"]) + ".", ""]
    lines += ["| part | result | seconds | figures |", "|---|---|---|---|"]
    for part in parts[1:]:
        lines.append(f"| {part.name} | {part.status}{': ' + part.reason if part.reason else ''} | "
                     f"{part.seconds:.1f} | {_figures_line(part)} |")
    return "\n".join(lines) + "\n"


def _figures_line(part: Part) -> str:
    figures = part.figures
    if "counts" in figures:
        failed = [test["name"] for test in figures["tests"] if test["outcome"] in ("failed", "error")]
        return (f"{figures['backend']}; " + ", ".join(f"{count} {kind}" for kind, count in figures["counts"].items())
                + (f"; failed: {', '.join(failed)}" if failed else ""))
    if "models" in figures:
        return "; ".join(f"{name} ddpkit/torch step {model['ddpkit_over_torch_step']:.2f}, host "
                         f"{model['ddpkit_over_torch_host']:.2f} ({model['host_ms'].get('ddpkit', 0):.2f} vs "
                         f"{model['host_ms'].get('torch DDP', 0):.2f} ms)" for name, model in figures["models"].items())
    timed = [f"{name} {value['seconds'] * 1000:.1f} ms" + (f" ({value['error'][:100]})" if "error" in value else "")
             for name, value in figures.items() if isinstance(value, dict) and "seconds" in value]
    return "; ".join(timed + [f"{name}: {value}" for name, value in figures.items() if not isinstance(value, dict)])


def main() -> int:
    parser = argparse.ArgumentParser(description="ddpkit's GPU check: tests, step and host time, CUDA recovery, "
                                                 "NCCL abort and re-form, in one bounded command")
    parser.add_argument("--dry-run", action="store_true", help="the same plan on the CPU with Gloo (CI runs it)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out",
                        help="where gpu_check.json and gpu_check.md go (default: $OUT, else gpu_check_out)")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for every part together (480)")
    parser.add_argument("--probe", choices=["abort-one", "abort-across", "abort-across-peer"], help=argparse.SUPPRESS)
    parser.add_argument("--probe-backend", default="nccl", help=argparse.SUPPRESS)
    parser.add_argument("--probe-out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--probe-port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe == "abort-across-peer":
        probe_abort_across(args.probe_backend, 1, args.probe_port)
        return 0
    if args.probe is not None:
        code = run_probe(args)
        sys.stdout.flush()
        os._exit(code)  # no interpreter teardown: an aborted communicator's threads may hang it

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget)
    environment, machine = environment_part(args.dry_run)
    parts = [environment]
    print(f"ddpkit GPU check: {environment.figures['gpus']} GPU(s), torch {environment.figures['torch']}"
          f"{', dry run on the CPU' if args.dry_run else ''}; report in {out}", flush=True)
    if environment.status == "passed":
        one = "nccl" if machine.nccl else "gloo"
        plan: list[Callable[[], Part]] = [
            lambda: tests_part(machine, budget, out),
            lambda: step_part(machine, budget, out, 1, one, f"world 1 on {one}"
                              + (" (dry run: Gloo on the CPU for NCCL)" if machine.dry_run else "")),
            lambda: step_part(machine, budget, out, 2, "gloo", "world 2 sharing the device over gloo"),
            lambda: step_part(machine, budget, out, min(machine.gpus, 8), "nccl", "one rank per GPU on nccl",
                              skip=None if machine.gpus >= 2 and not machine.dry_run else
                              ("needs NCCL (dry run: no GPU)" if machine.dry_run
                               else f"needs two GPUs: {machine.gpus} here")),
            lambda: abort_part(machine, budget, out, across=False),
            lambda: abort_part(machine, budget, out, across=True),
        ]
        for make in plan:
            part = make()
            parts.append(part)
            print(f"  {part.name}: {part.status}{' (' + part.reason + ')' if part.reason else ''} "
                  f"{part.seconds:.1f} s", flush=True)
    report = {"dry_run": args.dry_run, "parts": [asdict(part) for part in parts]}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_check.md").write_text(summary(parts, args.dry_run))
    print(summary(parts, args.dry_run), flush=True)
    return 1 if any(part.status in ("failed", "timeout") for part in parts) else 0


if __name__ == "__main__":
    sys.exit(main())
