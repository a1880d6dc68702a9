"""Helpers for tests that run real `ddpkit run` launchers as the nodes of one job (c10d rendezvous,
in-place recovery, the store outside the nodes: `ddpkit store`): start them, wait for what they
write, kill a node (its launcher and everything it started), and end them all within a bound; and
a job whose node 1 can be killed in a chosen phase of a step, with its single-process reference."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from helpers import descendants
from torch import nn

# Across nodes the launchers ask for a job secret: the records in the store are then signed.
SECRET = {"DDPKIT_JOB_SECRET": "a-secret-for-the-spare-node-tests-0123456789"}


def start_store(port: int, namespace: str | None = None, address: str = "127.0.0.1") -> subprocess.Popen[str]:
    """`ddpkit store` on ``port`` (in ``namespace``), once it serves."""
    store = subprocess.Popen([*(["ip", "netns", "exec", namespace] if namespace else []),
                              sys.executable, "-m", "ddpkit", "store", "--host", address, "--port", str(port)],
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert store.stdout is not None and "serving" in store.stdout.readline()
    return store


# The rendezvous's last call (--rdzv-conf last_call_timeout) for launchers started together as MAX
# nodes: it closes as soon as the last arrives, so a long one costs nothing, and it has to outlast
# the slowest launcher's start (torch's import on a loaded machine: with one second the CI saw a
# job of --nnodes 1:2 start without its second node, which then never reached the test's fault).
EVERY_NODE_LAST_CALL = 60.0


def start_launcher(folder: Path, port: int, name: str, nnodes: str, namespace: str | None = None,
                   address: str = "127.0.0.1", rdzv_id: str = "spare", max_restarts: int = 1, nproc_per_node: int = 2,
                   last_call: float = 1.0, **variables: str) -> subprocess.Popen[bytes]:
    """A launcher of two ranks running ``folder``/job.py, its output in ``folder``/``name``.out and .err
    (``max_restarts``: the lost nodes the job recovers from, and the ranks each node replaces;
    ``last_call``: how long the first rendezvous waits for more than MIN nodes)."""
    command = [*(["ip", "netns", "exec", namespace] if namespace else []),
               sys.executable, "-m", "ddpkit", "run", "--nnodes", nnodes, "--nproc-per-node", str(nproc_per_node),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{address}:{port}", "--rdzv-id", rdzv_id,
               "--rdzv-conf", f"last_call_timeout={last_call:g}", "--recovery", "in-place",
               "--max-restarts", str(max_restarts), "job.py"]
    with open(folder / f"{name}.out", "wb") as out, open(folder / f"{name}.err", "wb") as err:
        return subprocess.Popen(command, cwd=folder, stdout=out, stderr=err, env={**os.environ, **SECRET, **variables})


def start_together(folder: Path, port: int, nnodes: str, count: int, **options: Any) -> list[subprocess.Popen[bytes]]:
    """``count`` launchers (launcher0, launcher1, ...) started at once as one job of ``nnodes``; when
    they are its MAX, the first rendezvous waits for every one of them (``EVERY_NODE_LAST_CALL``)."""
    most = int(nnodes.split(":")[-1])
    last_call = EVERY_NODE_LAST_CALL if count >= most else 1.0
    return [start_launcher(folder, port, f"launcher{n}", nnodes, last_call=last_call, **options) for n in range(count)]


def wait_for(condition: Callable[[], object], what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def text(folder: Path, name: str) -> str:
    return (folder / name).read_text(errors="replace")


def node_of(folder: Path, node: int, launchers: int = 2) -> int:
    """Which launcher (by the number in its file names) the rendezvous made node ``node``."""
    return next(n for n in range(launchers) if f"this is node {node} of" in text(folder, f"launcher{n}.err"))


def kill_node(launcher: subprocess.Popen[bytes]) -> None:
    """A node lost: its launcher and everything it started, killed with SIGKILL."""
    for pid in [launcher.pid, *descendants(launcher.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def end_all(processes: list[subprocess.Popen[bytes]], timeout: float) -> list[int]:
    """The exit codes of ``processes`` once all ended within ``timeout``; whatever is left is killed."""
    deadline = time.monotonic() + timeout
    try:
        return [process.wait(timeout=max(1.0, deadline - time.monotonic())) for process in processes]
    finally:
        for process in processes:
            kill_node(process)
            process.wait()


STEPS, BATCH, WORLD, PAUSE_AT = 16, 4, 4, 5

# A job of two nodes of two ranks, with momentum SGD on an MLP, the data in order (no shuffle, so that
# ``one_process_reference`` knows every rank's batches) and a checkpoint saved every PAUSE_AT steps.
# The rank PAUSED_RANK (as the launcher started it: node 1's first is 2) stops where PHASE says (forward,
# allreduce, optimizer, save) in optimizer step PAUSE_AT + 1 and writes the file "paused": the test then
# kills its node ("connecting:0": before it forms the first generation of the group, so before it writes its
# address). PHASE may also list "where:S" entries ("forward:5,allreduce:9"): in optimizer step S + 1
# (a save: the one after step S) the process with that rank then, the first or a spare node's that took its
# place, stops there and writes "paused<S>". With GATES (optimizer steps, "7,9"), every rank waits after each
# of those steps S until the file "go-on<S>" exists. With JOINER_PAUSE (set for one joining launcher), its
# process that takes PAUSED_RANK's place in a later generation (a node joining) stops once, after it was
# counted in, where that says ("connecting": before it forms torch's group, so before it writes its address;
# "receiving": in the first collective of the state transfer) and writes the file "joiner-paused-<where>".
PHASE_JOB = textwrap.dedent(
    f"""
    import os, time, torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import ddpkit
    from ddpkit.hooks import allreduce_hook, elementwise_average

    PHASES = dict((entry.split(":") + [""])[:2] for entry in os.environ["PHASE"].split(","))

    def pause(where):  # once each: a spare that takes the rank redoes the step
        if where not in PHASES or os.environ["RANK"] != os.environ["PAUSED_RANK"]:
            return
        at, marker = (int(PHASES[where]), "paused" + PHASES[where]) if PHASES[where] else ({PAUSE_AT}, "paused")
        if strategy.progress.steps == at and not os.path.exists(marker):
            open(marker, "w").write(where)
            time.sleep(600)  # until its node is killed

    def pause_joiner(where):
        if (os.environ.get("JOINER_PAUSE") == where and os.environ["RANK"] == os.environ["PAUSED_RANK"]
                and int(os.environ.get("DDPKIT_GENERATION", "0")) > 0 and not os.path.exists(f"joiner-paused-{{where}}")):
            open(f"joiner-paused-{{where}}", "w").write(where)
            time.sleep(600)  # until its node is killed

    import torch.distributed, ddpkit.training.state_transfer
    connect, gather = torch.distributed.init_process_group, ddpkit.training.state_transfer.all_gather_object
    def connecting(*args, **kwargs):
        pause_joiner("connecting")
        pause("connecting")  # (in generation 0 too: "connecting:0")
        return connect(*args, **kwargs)

    torch.distributed.init_process_group = connecting
    ddpkit.training.state_transfer.all_gather_object = lambda *args: (pause_joiner("receiving"), gather(*args))[1]

    @elementwise_average
    def pausing_allreduce(state, bucket):
        pause("allreduce")  # every other rank waits in this bucket's all-reduce
        return allreduce_hook(state, bucket)

    strategy = ddpkit.DDPStrategy(ddp_comm_hook=pausing_allreduce)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    model.register_forward_pre_hook(lambda *_: pause("forward"))
    model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    optimizer.register_step_pre_hook(lambda *_: pause("optimizer"))
    generator = torch.Generator().manual_seed(1)
    samples = {STEPS * BATCH * WORLD}
    data = TensorDataset(torch.randn(samples, 8, generator=generator), torch.randn(samples, 2, generator=generator))
    loader = strategy.setup_dataloader(DataLoader(data, batch_size={BATCH}))
    for _ in strategy.epochs(1):
        for x, y in strategy.batches(loader):
            with strategy.step():
                optimizer.zero_grad()
                strategy.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
            if strategy.global_rank == 0:
                open(f"step{{strategy.progress.steps}}", "w").close()
            gates = os.environ.get("GATES", "").split(",")
            while str(strategy.progress.steps) in gates and not os.path.exists(f"go-on{{strategy.progress.steps}}"):
                time.sleep(0.05)  # held until the test lets the job go on
            if strategy.progress.steps % {PAUSE_AT} == 0:
                pause("save")
                strategy.save_checkpoint("checkpoint.pt", {{"model": model.state_dict(), "steps": strategy.progress.steps}})
    if strategy.global_rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], "final.pt")
    print(f"rank {{os.environ['RANK']}}: rank {{strategy.global_rank}} of {{strategy.world_size}} done, recovered "
          f"{{strategy.recovered_in_place}}", flush=True)
    strategy.teardown()
    """
)


def one_process_reference(steps: int = STEPS, world: int = WORLD, lr: float = 0.1) -> list[torch.Tensor]:
    """One process on the concatenated global batches: DistributedSampler without shuffling gives
    rank r the samples r, r + ``world``, ...; each global batch is every rank's next BATCH of those
    (PHASE_JOB's run, and tests/slow_node_job.py's with its own steps, world and learning rate)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    samples = steps * BATCH * world
    x, y = torch.randn(samples, 8, generator=generator), torch.randn(samples, 2, generator=generator)
    for step in range(steps):
        rows = [rank + world * (step * BATCH + i) for rank in range(world) for i in range(BATCH)]
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def assert_as_one_process(folder: Path, errors: str, reference: list[torch.Tensor] | None = None) -> None:
    """The job's final parameters (``folder``/final.pt) are within 1e-6 of ``reference`` (by default
    ``one_process_reference()``)."""
    parameters = torch.load(folder / "final.pt")
    expected = one_process_reference() if reference is None else reference
    difference = max((a - b).abs().max().item() for a, b in zip(parameters, expected, strict=True))
    assert difference <= 1e-6, f"{difference:.3e} from one process on the concatenated batches\n{errors}"
