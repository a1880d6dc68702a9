"""What a rank killed with SIGKILL costs: in-place recovery beside a full restart and torchrun; and
with ``--nodes``, what a whole node killed costs.

    python benchmarks/recovery.py [--ranks 2 4] [--runs 3] [--modes in-place restart torchrun] [--steps 40]
    python benchmarks/recovery.py --nodes 2 3 [--runs 20] [--node-modes shrink spare-node torchrun] [--netns]

The 8x1024 MLP of ``ddp_step.py`` (``--width`` to change it; batch 64 per rank, one thread per rank), trained with
``DDPStrategy``'s loop (``epochs``/``batches``/``step``) by a script this benchmark writes to a
temporary folder. Each rank appends (step, wall time) to a file after every step and saves
nothing else but a checkpoint every 10 steps, rank 0 the final parameters. Per run, one rank
(chosen at random) is killed with SIGKILL right after a random step between 5 and steps - 10, so
that the kill lands in the next step, or in the checkpoint save after steps 10, 20, ... (between
steps: in place covers a save too):

- ``in-place``: ``ddpkit run --recovery in-place --max-restarts 1`` (a warm spare takes the rank);
- ``restart``: ``ddpkit run --max-restarts 1``: every worker starts again and resumes from the checkpoint;
- ``torchrun``: ``torchrun --max-restarts 1``, the same script resuming from the checkpoint.

Printed per mode: the seconds from the kill to the next step the killed rank's successor
completed (a step completes on every rank together: it has an all-reduce), the steps trained
twice (since the checkpoint), runs that finished, and the largest difference of the final
parameters to a run without the fault (the same command, nothing killed). Figures, with the
command, in benchmarks/README.md.

Node modes (``--nodes N ...``): N launchers of 2 ranks each, the c10d rendezvous, the same MLP
(``--width``, 512 by default there) fed by a dataset of deterministic samples through
``DDPStrategy.setup_dataloader``; each run kills one whole node (its launcher and every process it
started, SIGKILL) right after a random step, as above:

- ``shrink``: ``ddpkit run --nnodes N-1:N --recovery in-place``, the store outside the nodes
  (``ddpkit store``), no spare: the survivors go on with the lost node's shares of each global batch;
- ``spare-node``: ``ddpkit run --nnodes N:N+1 --recovery in-place``, one more launcher waiting as a
  spare node, which takes the lost node's ranks;
- ``torchrun``: ``torchrun --nnodes 1:N --max-restarts 1`` (its c10d rendezvous, hosted by node 0's
  agent, so a node other than 0 is killed): the survivors' workers start again in a smaller world
  and resume from the checkpoint, with another global batch (its final parameters differ).

ddpkit's own restart needs the lost node back (a static world), so it is not a node mode. With
``--netns`` every node runs in a network namespace of its own, on one bridge (``netns.Nodes``).
The difference is to the fault-free ``shrink`` run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _processes import descendants, waits_for_its_input
from netns import Nodes

from ddpkit.environments import find_free_port

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from torch import nn
    import ddpkit

    steps, width = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(8) for layer in (nn.Linear(width, width), nn.ReLU())])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    strategy = ddpkit.DDPStrategy()
    model, optimizer = strategy.setup(model, optimizer)
    rank = strategy.global_rank
    with open(f"pid.{rank}", "w") as handle:
        handle.write(str(os.getpid()))
    first = 0
    state = strategy.load_checkpoint("checkpoint.pt") if strategy.restart_count > 0 else None
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first = state["batch"]
    batches = [(torch.randn(64, width, generator=torch.Generator().manual_seed(1000 * step + rank)),)
               for step in range(steps)]
    log = open(f"steps.{rank}", "a", buffering=1)
    for epoch in strategy.epochs(1):
        for (x,) in strategy.batches(batches, skip=first):
            with strategy.step():
                optimizer.zero_grad()
                strategy.backward(model(x).square().mean())
                optimizer.step()
                done = strategy.progress.batch + 1
            log.write(f"{done} {time.time()}\\n")
            if done % 10 == 0 and done < steps:
                strategy.save_checkpoint("checkpoint.pt", {"model": model.state_dict(),
                                                           "optimizer": optimizer.state_dict(), "batch": done})
    if strategy.is_global_zero:
        torch.save(model.state_dict(), "final.pt")
    strategy.teardown()
    """
)


def command(mode: str, ranks: int, steps: int, width: int) -> list[str]:
    if mode == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--max-restarts", "1",
                "--master-port", str(find_free_port()), "train.py", str(steps), str(width)]
    recovery = ["--recovery", "in-place"] if mode in ("in-place", "fault-free") else []
    return [sys.executable, "-m", "ddpkit", "run", *recovery, "--max-restarts", "1", "--nproc-per-node", str(ranks),
            "train.py", str(steps), str(width)]


def completed(folder: Path, rank: int) -> list[tuple[int, float]]:
    path = folder / f"steps.{rank}"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2:  # (node modes add the pid)
            rows.append((int(parts[0]), float(parts[1])))
    return rows


def run(mode: str, ranks: int, steps: int, width: int, kill: bool, seed: int) -> dict[str, Any] | None:
    """One run; None when it did not finish."""
    chooser = random.Random(seed)
    # After a step that a checkpoint save follows, the kill lands in the save (between steps).
    kill_after = chooser.randrange(5, steps - 9)
    victim = chooser.randrange(ranks)
    return run_script(mode, SCRIPT, command(mode, ranks, steps, width), kill_after if kill else None, victim)


def run_script(mode: str, script: str, argv: list[str], kill_after: int | None, victim: int,
               timeout: float = 600) -> dict[str, Any] | None:
    """Run ``argv`` in a temporary folder holding ``script`` as train.py (it writes ``pid.RANK`` and a
    ``steps.RANK`` line per step, rank 0 ``final.pt``), SIGKILL rank ``victim`` once it completed step
    ``kill_after`` (None: no kill); the seconds to its successor's next step, the steps trained twice
    and a copy of ``final.pt`` (``final_file``). None when it did not finish (within ``timeout``
    seconds: then it and every process it started are killed)."""
    folder = Path(tempfile.mkdtemp(prefix=f"ddpkit-recovery-{mode}-"))
    (folder / "train.py").write_text(script)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    process = subprocess.Popen(argv, cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    result: dict[str, Any] = {}
    try:
        if kill_after is not None and mode == "in-place":
            # Its warm spare ready, as in a job that ran a while: a kill while it still imports torch
            # (a small model reaches step 5 within a second) measures those imports instead.
            while not any(waits_for_its_input(pid) for pid in descendants(process.pid)):
                if process.poll() is not None:
                    return None
                time.sleep(0.01)
        if kill_after is not None:
            while not any(step >= kill_after for step, _ in completed(folder, victim)):
                if process.poll() is not None:
                    return None
                time.sleep(0.002)
            killed_at_step = max(step for step, _ in completed(folder, victim))
            os.kill(int((folder / f"pid.{victim}").read_text()), signal.SIGKILL)
            killed = time.time()
        try:
            _, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"  {mode}: not finished after {timeout:.0f} s", file=sys.stderr)
            return None
        if process.returncode != 0 or not (folder / "final.pt").exists():
            print(f"  {mode}: exit {process.returncode}\n{stderr[-1500:]}", file=sys.stderr)
            return None
        if kill_after is not None:
            after = [(step, moment) for step, moment in completed(folder, victim) if moment > killed]
            result["seconds"] = after[0][1] - killed
            result["trained_twice"] = killed_at_step + 1 - after[0][0]
        kept = folder.parent / f"{folder.name}.final.pt"
        shutil.copy(folder / "final.pt", kept)
        result["final_file"] = str(kept)
        return result
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # and any worker it left behind
        process.wait()
        shutil.rmtree(folder, ignore_errors=True)


def difference(path: str, reference: dict[str, torch.Tensor]) -> float:
    final = torch.load(path, weights_only=True)
    os.remove(path)
    return max((final[name] - reference[name]).abs().max().item() for name in reference)


# -- node modes ---------------------------------------------------------------------------------------

NODE_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset
    import ddpkit
    from ddpkit.membership.group import current_group

    steps, width, data_world = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)

    class Samples(Dataset):  # deterministic: sample i is the same whichever rank reads it
        def __len__(self):
            return steps * 64 * data_world
        def __getitem__(self, index):
            return torch.randn(width, generator=torch.Generator().manual_seed(index))

    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(8) for layer in (nn.Linear(width, width), nn.ReLU())])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    strategy = ddpkit.DDPStrategy()
    model, optimizer = strategy.setup(model, optimizer)
    loader = strategy.setup_dataloader(DataLoader(Samples(), batch_size=64))
    first = 0
    state = strategy.load_checkpoint("checkpoint.pt") if strategy.restart_count > 0 else None
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first = state["batch"]
    with open(f"pid.{os.environ['RANK']}", "w") as handle:
        handle.write(str(os.getpid()))
    while not os.path.exists("go"):  # the benchmark says when the job is set up (a spare node's spares waiting)
        time.sleep(0.01)
    log = open(f"steps.{os.environ['RANK']}", "a", buffering=1)
    for epoch in strategy.epochs(1):
        for x in strategy.batches(loader, skip=first):
            with strategy.step():
                optimizer.zero_grad()
                strategy.backward(model(x).square().mean())
                optimizer.step()
                done = strategy.progress.batch + 1
            generation = group.generation if (group := current_group()) is not None else 0
            log.write(f"{done} {time.time()} {os.getpid()} {generation}\\n")
            if done % 10 == 0 and done < steps:
                strategy.save_checkpoint("checkpoint.pt", {"model": model.state_dict(),
                                                           "optimizer": optimizer.state_dict(), "batch": done})
    if strategy.is_global_zero:
        torch.save(model.state_dict(), "final.pt")
    strategy.teardown()
    """
)

_NODE_SECRET = {"DDPKIT_JOB_SECRET": "the-node-recovery-benchmark-0123456789abcdef"}


class NodeJob:
    """One run of a node mode: its launchers (node i's output in launcher{i}.err), its store."""

    def __init__(self, mode: str, nodes: int, steps: int, width: int, namespaces: Nodes | None) -> None:
        self.mode, self.nodes, self.namespaces = mode, nodes, namespaces
        self.folder = Path(tempfile.mkdtemp(prefix=f"ddpkit-node-recovery-{mode}-"))
        (self.folder / "train.py").write_text(NODE_SCRIPT)
        self.arguments = ["train.py", str(steps), str(width), str(2 * nodes)]
        self.address = namespaces.addresses[0] if namespaces else "127.0.0.1"
        self.port = find_free_port()
        self.store: subprocess.Popen[str] | None = None
        self.launchers: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        if self.mode != "torchrun":  # the store outside the nodes: any node can be lost
            self.store = subprocess.Popen([*self._prefix(0), sys.executable, "-m", "ddpkit", "store", "--host",
                                           self.address, "--port", str(self.port)],
                                          text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            assert self.store.stdout is not None and "serving" in self.store.stdout.readline()
        for node in range(self.nodes):
            self.launchers.append(self._launcher(node))
            if node == 0 and self.mode == "torchrun":  # node 0's agent binds the endpoint and hosts the rendezvous
                self._wait(self._endpoint_listens, "rendezvous endpoint")
        if self.mode == "spare-node":
            self._wait(lambda: all("this is node" in self._err(node) for node in range(self.nodes)), "the rendezvous")
            self.launchers.append(self._launcher(self.nodes))
            # Its warm spares ready, as a spare node that waited a while is: a kill while they still
            # import torch measures the imports on two cores shared with the training.
            self._wait(lambda: "waits as a spare node" in self._err(self.nodes)
                       and self._blocked_on_their_input(self.nodes) >= 2, "the spare node's warm spares")
        (self.folder / "go").touch()  # the ranks train from now on: a short job cannot end before the spares wait

    def _launcher(self, number: int) -> subprocess.Popen[bytes]:
        node = min(number, self.nodes - 1)  # the spare lives beside the last node
        if self.mode == "torchrun":
            command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", f"1:{self.nodes}",
                       "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                       f"{self.address}:{self.port}", "--rdzv-id", "bench", "--rdzv-conf", "last_call_timeout=5",
                       "--max-restarts", "1", "--local-addr", self._local_address(node)]
        else:
            nnodes = f"{self.nodes - 1}:{self.nodes}" if self.mode == "shrink" else f"{self.nodes}:{self.nodes + 1}"
            command = [sys.executable, "-m", "ddpkit", "run", "--nnodes", nnodes, "--nproc-per-node", "2",
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.address}:{self.port}", "--rdzv-id", "bench",
                       "--rdzv-conf", "last_call_timeout=1", "--recovery", "in-place", "--max-restarts", "1"]
        env = {**os.environ, **_NODE_SECRET, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        if self.namespaces and self.mode == "torchrun":  # ddpkit run chooses the interface towards the endpoint itself
            env["GLOO_SOCKET_IFNAME"] = self.namespaces.links[node]
        with open(self.folder / f"launcher{number}.err", "wb") as err:
            return subprocess.Popen([*self._prefix(node), *command, *self.arguments], cwd=self.folder, env=env,
                                    stdout=subprocess.DEVNULL, stderr=err)

    def _blocked_on_their_input(self, number: int) -> int:
        """How many of launcher ``number``'s processes wait in a read of their standard input: its
        warm spares once they imported what the script needs (``workers.worker``)."""
        return sum(waits_for_its_input(pid) for pid in descendants(self.launchers[number].pid))

    def _endpoint_listens(self) -> bool:
        try:
            subprocess.run([*self._prefix(0), sys.executable, "-c", "import socket, sys; socket.create_connection("
                            f"({self.address!r}, {self.port}), timeout=1)"], check=True, capture_output=True, timeout=10)
            return True
        except subprocess.CalledProcessError:
            return False

    def _prefix(self, node: int) -> list[str]:
        return self.namespaces.prefix(node) if self.namespaces else []

    def _local_address(self, node: int) -> str:
        return self.namespaces.addresses[node] if self.namespaces else "127.0.0.1"

    def _err(self, number: int) -> str:
        return (self.folder / f"launcher{number}.err").read_text(errors="replace")

    def _wait(self, condition: Any, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline or any(launcher.poll() is not None for launcher in self.launchers):
                raise RuntimeError(f"{self.mode}: waited in vain for {what}:\n" + "\n".join(self._err(n)[-1500:]
                                                                            for n in range(len(self.launchers))))
            time.sleep(0.05)

    def first_rank_of(self, number: int) -> int:
        """The lowest job rank (``RANK``) among launcher ``number``'s workers, once they wrote their pids."""
        def ranks() -> list[int]:
            mine = set(descendants(self.launchers[number].pid))
            found = []
            for path in self.folder.glob("pid.*"):
                text = path.read_text().strip()
                if text and int(text) in mine:
                    found.append(int(path.name[4:]))
            return found

        self._wait(lambda: len(ranks()) == 2, f"the workers of launcher {number}")
        return min(ranks())

    def kill(self, number: int) -> None:
        """The node of launcher ``number``: its launcher and every process it started, SIGKILL."""
        for pid in [self.launchers[number].pid, *descendants(self.launchers[number].pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def finish(self, lost: int | None) -> bool:
        """Whether every launcher but the one lost ended with 0 and the final parameters were written."""
        codes = []
        for number, launcher in enumerate(self.launchers):
            try:
                codes.append(launcher.wait(timeout=600) if number != lost else 0)
            except subprocess.TimeoutExpired:
                codes.append(None)
        if any(code != 0 for code in codes) or not (self.folder / "final.pt").exists():
            print(f"  {self.mode}: exit codes {codes}\n" + "\n".join(self._err(n)[-1500:]
                                                                 for n in range(len(self.launchers))), file=sys.stderr)
            return False
        return True

    def close(self) -> None:
        for number, launcher in enumerate(self.launchers):
            self.kill(number)
            launcher.wait()
        if self.store is not None:
            self.store.kill()
            self.store.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def run_nodes(mode: str, nodes: int, steps: int, width: int, kill: bool, seed: int,
              namespaces: Nodes | None) -> dict[str, Any] | None:
    """One run of a node mode; None when it did not finish."""
    job = NodeJob(mode, nodes, steps, width, namespaces)
    chooser = random.Random(seed)
    kill_after = chooser.randrange(5, steps - 9)
    # torchrun's rendezvous lives in node 0's agent (the first started): losing it ends the job.
    lost = chooser.randrange(1 if mode == "torchrun" else 0, nodes)
    result: dict[str, Any] = {}
    try:
        job.start()
        if kill:
            watched = job.first_rank_of(lost)
            while not any(step >= kill_after for step, _ in completed(job.folder, watched)):
                if any(launcher.poll() is not None for launcher in job.launchers):
                    job.finish(None)
                    return None
                time.sleep(0.002)
            # Read once every rank trained steps (so wrote its pid): a rank missing here would count as new.
            old_world = {int(path.read_text()) for path in job.folder.glob("pid.*") if path.read_text().strip()}
            killed_at_step = max(step for step, _ in completed(job.folder, watched))
            job.kill(lost)
            killed = time.time()
        if not job.finish(lost if kill else None):
            return None
        if kill:
            # Every step completes on every rank together (it has an all-reduce): the first one any rank
            # trained after the loss is the next completed step, whoever trains it.
            after = sorted((moment, step) for rank in range(2 * nodes)
                           for step, moment in steps_after_the_loss(job.folder, rank, old_world))
            result["seconds"] = after[0][0] - killed
            result["trained_twice"] = killed_at_step + 1 - after[0][1]
        kept = job.folder.parent / f"{job.folder.name}.final.pt"
        shutil.copy(job.folder / "final.pt", kept)
        result["final_file"] = str(kept)
        return result
    finally:
        job.close()


def steps_after_the_loss(folder: Path, rank: int, old_world: set[int]) -> list[tuple[int, float]]:
    """(step, wall time) of each step of rank ``rank``'s log trained after the loss: by a process
    started since (a spare, a restarted worker), or in a later generation of ddpkit's group. A
    step the old world completes right after the kill (the lost rank had sent its part) is not."""
    path = folder / f"steps.{rank}"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) == 4 and (int(parts[2]) not in old_world or int(parts[3]) > 0):
            rows.append((int(parts[0]), float(parts[1])))
    return rows


def main_nodes(args: argparse.Namespace) -> None:
    if args.netns and (why := Nodes.unavailable()) is not None:
        print(f"--netns: {why}; nothing measured")
        return
    for nodes in args.nodes:
        with contextlib.ExitStack() as stack:
            namespaces = stack.enter_context(Nodes(nodes)) if args.netns else None
            where = "network namespaces on a bridge" if args.netns else "loopback"
            compare_modes(lambda mode, kill, seed, nodes=nodes, namespaces=namespaces: run_nodes(
                "shrink" if mode == "fault-free" else mode, nodes, args.steps, args.width, kill=kill, seed=seed,
                namespaces=namespaces), args.node_modes, args.runs, 1000 * nodes,
                f"{nodes} nodes x 2 ranks ({where}), 8x{args.width} MLP, {args.steps} steps, kill -9 of a random node "
                f"after a random step, {args.runs} runs per mode (interleaved)")

def report(outcomes: dict[str, list[dict[str, Any]]], failures: dict[str, int], reference: str) -> None:
    for mode, done in outcomes.items():
        if not done:
            print(f"  {mode:10s} no run finished ({failures[mode]} failed)")
            continue
        seconds = [o["seconds"] for o in done]
        twice = statistics.median(o["trained_twice"] for o in done)
        print(f"  {mode:10s} kill -> next step: median {statistics.median(seconds):.2f} s (min {min(seconds):.2f}, "
              f"max {max(seconds):.2f}); steps trained twice: median {twice:g}; "
              f"finished {len(done)}/{len(done) + failures[mode]}; max |difference| to {reference} "
              f"{max(o['difference'] for o in done):.2e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--modes", nargs="+", default=["in-place", "restart", "torchrun"],
                        choices=["in-place", "restart", "torchrun"])
    parser.add_argument("--nodes", type=int, nargs="+", help="node modes: kill a whole node of N (2 ranks each)")
    parser.add_argument("--node-modes", nargs="+", default=["shrink", "spare-node", "torchrun"],
                        choices=["shrink", "spare-node", "torchrun"])
    parser.add_argument("--netns", action="store_true", help="node modes: each node in a network namespace")
    parser.add_argument("--width", type=int, help="the MLP's width (default 1024 for ranks, 512 for --nodes)")
    args = parser.parse_args()
    if args.nodes:
        args.width = args.width or 512
        main_nodes(args)
        return
    args.width = args.width or 1024
    for ranks in args.ranks:
        compare_modes(lambda mode, kill, seed, ranks=ranks: run(mode, ranks, args.steps, args.width, kill, seed),
                      args.modes, args.runs, 1000 * ranks, f"{ranks} ranks, 8x{args.width} MLP, {args.steps} steps, "
                      f"kill -9 of a random rank after a random step, {args.runs} runs per mode (interleaved)")


def compare_modes(run_mode: Callable[[str, bool, int], dict[str, Any] | None], modes: list[str], runs: int,
                  first_seed: int, header: str) -> None:
    """The fault-free run (``run_mode("fault-free", False, 0)``), ``header``, then ``runs`` rounds of every
    mode with a kill, the modes interleaved in each round (seeds ``first_seed``, ``first_seed + 1``...);
    the report."""
    clean = run_mode("fault-free", False, 0)
    if clean is None:
        raise SystemExit(f"the fault-free run did not finish ({header})")
    reference = torch.load(str(clean["final_file"]), weights_only=True)
    os.remove(str(clean["final_file"]))
    print(header, flush=True)
    outcomes: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    failures = dict.fromkeys(modes, 0)
    for index in range(runs):
        for mode in random.Random(index).sample(modes, len(modes)):
            outcome = run_mode(mode, True, first_seed + index)
            if outcome is None:
                failures[mode] += 1
                continue
            outcome["difference"] = difference(str(outcome.pop("final_file")), reference)
            outcomes[mode].append(outcome)
    report(outcomes, failures, "the fault-free run")


if __name__ == "__main__":
    main()
