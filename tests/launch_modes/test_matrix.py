"""Launch mode x script kind (issue 30): a torchrun command line works with ``ddpkit run`` in its
place, for a plain torch script (``env://``), ddpkit's own connection, Lightning's Trainer and
HF Accelerate. Each cell runs under ``ddpkit run``, one launcher per node (loopback, and two
network namespaces): the same world, the parameters of one process trained on the concatenated
batches, exit 0, no process left. The ddpkit script runs under torchrun too, with the same flags,
in each environment torchrun gives it (``torchrun_beside``), and must end as under ``ddpkit run``.

The table in docs/launching.md ("Launch modes and script kinds") is this matrix's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ddpkit.environments import find_free_port

from .cells import MODES, Mode, Run, largest_difference, run_cell
from .jobs import common

# Modes whose every cell another mode's covers: with --max-restarts 1 and no failure, the flags of
# the mode with rank 1 SIGKILLed, whose first attempt runs the same (its second, the restart, is more).
_SUBSUMED = {"static nodes, restarts": "static nodes, a rank killed", "c10d, restarts": "c10d, a rank killed"}

# (kind, mode): plain scripts in every mode; ddpkit's connection in every mode but the two ways of
# naming the script and --standalone (a c10d rendezvous on this host, as the c10d mode's); Lightning
# and Accelerate on one node, at a c10d rendezvous, and restarted across nodes after a SIGKILL (each
# of their starts costs seconds of imports on two cores). No cell of a subsumed mode.
CELLS = [("plain", name) for name in MODES if name not in _SUBSUMED] + [
    ("ddpkit", name) for name in MODES
    if MODES[name].run_as == "script" and name not in _SUBSUMED and name != "standalone"] + [
    (kind, name) for kind in ("lightning", "accelerate") for name in ("one node", "c10d", "static nodes, a rank killed")]

_FRAMEWORKS = {"lightning": "lightning", "accelerate": "accelerate"}


def processes_per_node(kind: str, mode: Mode) -> int:
    """Two per node, as in the issue's command lines; one per node for the frameworks across nodes."""
    return 1 if mode.nnodes > 1 and kind in _FRAMEWORKS else 2


def torchrun_beside(kind: str, mode: Mode) -> bool:
    """Whether the cell runs torchrun too: for the ddpkit script (under torchrun it connects through
    torchrun's environment and store) in each environment torchrun gives it: one node, static nodes
    and c10d (the other modes give the same environment and store: the store outside the nodes is
    reached as c10d's). The plain, Lightning and Accelerate scripts under torchrun would test torch
    and the frameworks, at 5-10 s a cell on two cores; under ``ddpkit run`` every cell is checked
    against one process trained on the concatenated batches."""
    return kind == "ddpkit" and mode.name in ("one node", "static nodes", "c10d")


def check(run: Run, world: int, launcher: str) -> None:
    assert run.codes == [0] * len(run.codes), f"{launcher}: {run.describe()}"
    reports = run.reports()
    last = max(attempt for *_, attempt in reports)
    finished = sorted((w, total, rank) for w, total, rank, attempt in reports if attempt == last)
    assert finished == [(world, world, rank) for rank in range(world)], f"{launcher}: {run.describe()}"
    assert run.final is not None, f"{launcher}: rank 0 saved no parameters\n{run.describe()}"
    assert largest_difference(run.final, common.reference(world)) < 1e-6, f"{launcher}: {run.describe()}"
    assert run.left == [], f"{launcher} left processes {run.left}\n{run.describe()}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kind", "mode_name"), CELLS,
                         ids=[f"{kind}-{name.replace(', ', '-').replace(' ', '_')}" for kind, name in CELLS])
def test_a_torchrun_command_line_with_ddpkit_run_in_its_place(kind: str, mode_name: str, tmp_path: Path) -> None:
    framework = _FRAMEWORKS.get(kind)
    if framework is not None and importlib.util.find_spec(framework) is None:
        pytest.skip(f"needs {framework} (pip install -e '.[test]' installs it; .ci/run does)")
    mode = MODES[mode_name]
    nproc = processes_per_node(kind, mode)
    world = nproc * mode.nnodes
    ours = run_cell("ddpkit run", mode, kind, tmp_path, find_free_port(), nproc)
    check(ours, world, "ddpkit run")
    if mode.no_torchrun is None and torchrun_beside(kind, mode):
        theirs = run_cell("torchrun", mode, kind, tmp_path, find_free_port(), nproc)
        check(theirs, world, "torchrun")
        assert ours.final is not None and theirs.final is not None
        assert largest_difference(ours.final, theirs.final) < 1e-6


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kind", "mode_name"), [("plain", "c10d"), ("plain", "static nodes, a rank killed"),
                                                 ("ddpkit", "static nodes, a rank killed")])
def test_across_network_namespaces(kind: str, mode_name: str, two_namespaces: list[tuple[str, str]],
                                   tmp_path: Path) -> None:
    """Two hosts that reach each other only through a veth pair, at node 0's address. ddpkit run
    alone: the namespaces share this machine's host name, which resolves to 127.0.0.1, and
    torchrun's agents and Gloo take the host name's address, so torchrun's c10d cell here waited
    past its bound (without --local-addr and GLOO_SOCKET_IFNAME per node); the loopback cells
    compare the two launchers."""
    ours = run_cell("ddpkit run", MODES[mode_name], kind, tmp_path, find_free_port(), 2, namespaces=two_namespaces)
    check(ours, 4, "ddpkit run")
