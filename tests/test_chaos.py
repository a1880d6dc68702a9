"""The chaos soak in CI (issue 33, item 4): five runs of ``benchmarks/chaos.py`` with a fixed draw
of faults, which covers every kind this machine can inject (without root: no disk-full, and two
nodes on loopback without link-down). None may hang, end wrong or leave a process behind."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

CHAOS = Path(__file__).resolve().parents[1] / "benchmarks" / "chaos.py"
# A draw whose first five runs have every kind of fault at least once and each of the four set-ups,
# the world that may shrink with a node's launcher killed among them, and a rank killed in the
# example's block between steps in a world that may shrink (a run costs 5-50 s of CI on two cores:
# five runs, not the eight of the draw before, whose runs repeated kinds). Not ``alone``: a fault
# lands at a time drawn into a run, and the run must end exact or naming it whenever it lands, so
# a test beside the soak only moves where each fault lands.
# A draw's kinds depend on the seed alone: ``chaos.plan`` with any duration lists them.
SEED = "5424"


@pytest.mark.timeout(900)
def test_five_runs_of_the_chaos_soak_end_exact_or_naming_the_cause(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(CHAOS), "--runs", "5", "--seed", SEED, "--epochs", "2",
                             "--samples", "4096"], cwd=tmp_path, capture_output=True, text=True, timeout=850)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    last = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"chaos: 5 runs: \d+ exact, \d+ ended naming the root cause, \d+ refused naming why, 0 hung, 0 wrong, "
                        r"0 left behind", last), output[-6000:]


def test_the_soaks_draw_has_every_kind_of_fault_and_every_set_up() -> None:
    """What SEED's comment says of its first five runs (root's kinds: link-down and disk-full too)."""
    sys.path.insert(0, str(CHAOS.parent))
    try:
        import chaos
    finally:
        sys.path.remove(str(CHAOS.parent))
    planner = random.Random(int(SEED))
    runs = [chaos.plan(index, planner, 10.0, namespaces=True, disk=True) for index in range(5)]
    assert {fault.kind for run in runs for fault in run.faults} == set(chaos.KINDS)
    assert {run.setup for run in runs} == set(chaos.SETUPS)
    shrinking = [{fault.kind for fault in run.faults} for run in runs if run.setup == "shrink"]
    assert any("kill-launcher" in kinds for kinds in shrinking) and any("kill-in-block" in kinds for kinds in shrinking)
