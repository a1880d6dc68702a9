"""Overlap and compression where the wire costs: ranks in network namespaces over shaped links.

    python benchmarks/links.py [--rates 1 5 10] [--ranks-per-node 1 2] [--nodes 2] [--models mlp big]
                               [--rounds 15] [--plot scaling.png] [--bucket-caps MB ...] [--torch-layout] [--json]

Two nodes (``--nodes``: any counts), each a network namespace on one bridge (``netns.Nodes``), each node's link shaped
with ``tc qdisc ... tbf rate R`` in both directions (``netem`` is not available here); 1 or 2
Gloo ranks per node, one thread each. Per model and link rate, in one run with the methods
interleaved in a shuffled order each round (noise hits all alike):

- ``C``: the step without synchronisation, each rank training its own copy (the slowest rank's
  time in the round: a synchronised step waits for it);
- ``A``: a raw all-reduce of one flat buffer of every gradient byte, over the link;
- ``A fp16``, ``A bf16``: the same in float16 and bfloat16 (half the bytes, summed by Gloo in
  that type): with ``F``, the floor of ``ddpkit fp16``'s and ``ddpkit bf16``'s steps, which bounds
  how much faster they can be than ddpkit's;
- ``F``: the forward alone (the loss, its graph built and dropped), the slowest rank's;
- ``torch DDP``, ``ddpkit``: each DDP's step, defaults;
- ``ddpkit overlap``: ddpkit with ``overlap_optimizer`` (the step's updates and the gradients'
  last buckets overlap the next forward), timed over ``OVERLAP_STEPS`` steps and the wait for
  the last one's gradients, per step. Where one step's gradients fit in the link's burst
  allowance (``SMALL_BYTES``: LeNet, the 120 tensors), a single step would be sent at the
  veth's speed, not the link's, and 4 back to back at the link's: every method's sample is then
  ``OVERLAP_STEPS`` calls, per call;
- ``ddpkit overlap steady``: the same mode's step in a long run, where a step's gradients still
  travel while the next forward runs (a pipeline's period): in a sample of ``STEADY_STEPS`` steps,
  the median time from a step's start to the next one's, the first step (which waits for nothing)
  and the last (whose wait is the drain) left out. ``ddpkit overlap`` counts that filling and
  draining once every ``OVERLAP_STEPS`` steps, which overstates what a run of thousands of steps pays.
  Not for models under ``SMALL_BYTES`` (one bucket: the mode defers nothing there);
- ``ddpkit fp16``, ``ddpkit bf16``, ``ddpkit PowerSGD``: ddpkit with ``fp16_compress_hook``,
  ``bf16_compress_hook`` and ``powerSGD_hook`` (rank 1, compressing from the first timed step);
- with ``--torch-layout``, ``ddpkit torch layout`` and ``ddpkit fp16 torch layout``: the same with
  torch's bucket caps (1 MB, then ``bucket_cap_mb``) instead of ddpkit's share of the model
  (``ddpkit.parallel.buckets``), to show what the layout gains (PowerSGD keeps torch's caps);
- with ``--bucket-caps 4 10``, ``ddpkit 4 MB buckets``, ``ddpkit fp16 4 MB buckets`` and so on:
  ddpkit without a hook and with ``fp16_compress_hook`` at that ``bucket_cap_mb`` (the first
  bucket stays 1 MB), to choose the bucket size where the wire costs.

Printed per rate and model: medians (ms); for torch DDP and ddpkit, round by round, the overlap
efficiency ``(C + A - T) / min(C, A)`` (1.0: the smaller of compute and communication fully
hidden, 0: none) and the step over ``max(C, A)`` (1.0: nothing but the larger of the two); for
the compressing hooks (which send fewer bytes than ``A``), how many times faster their step is
than ddpkit's without a hook. Where the time goes, per DDP: the step over ``F + A``, the floor of a
step that sends every gradient byte, since no gradient exists before the forward ends (the
backward and the optimizer step can hide under the all-reduce, the forward cannot): 1.0 is
everything else hidden; what lies above it is the backward before the first bucket is ready,
the optimizer step after the last, and the DDP's own work.
With ``--json``, instead of that table, one JSON object a line per (model, rate, world, variant):
``{"model", "rate_gbit", "nodes", "ranks_per_node", "variant", "step_ms", "step_over_max",
"step_over_floor", "C_ms", "A_ms", "F_ms"}`` (medians; the ratios per round, then their median), so
that runs can be compared; the header goes to stderr.
Models: those of ``ddp_step.py`` (``mlp``, ``lenet``, ``many``), ``mlp384``, the same MLP on 384
rows a rank (its compute and its all-reduce of one order at 1 Gbit/s: what overlap can hide), and
``big``, 6 x Linear(2048, 2048) (25.2M parameters, batch 64). Needs root, Linux and iproute2's ``ip`` and ``tc``: without
them it says so and exits 0. The namespaces it makes are removed when it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _timing import interleaved_samples, sgd_step  # noqa: E402
from ddp_step import build as build_step_model  # noqa: E402
from netns import Nodes  # noqa: E402

from ddpkit.distributed import register_ddp_comm_hook  # noqa: E402
from ddpkit.environments import find_free_port  # noqa: E402
from ddpkit.hooks import PowerSGDState, bf16_compress_hook, fp16_compress_hook, powerSGD_hook  # noqa: E402
from ddpkit.parallel.ddp import DistributedDataParallel  # noqa: E402

# A sample of ddpkit overlap: this many steps, then the wait for the last one's gradients.
OVERLAP_STEPS = 4
# A longer sample of it, for the steady state: the mode's step is a period of a pipeline (the wire
# still sends a step's gradients while the next forward runs), so a sample of OVERLAP_STEPS steps
# also holds its filling (the first forward waits for nothing) and its draining (the last step's
# wait). In a sample of STEADY_STEPS steps each step's period, from its start to the next one's,
# is timed; those of the steps between the first and the last are what each step of a long run costs.
STEADY_STEPS = 12
# Gradients under this many bytes fit in the shaped link's burst allowance (``shape``): for such a
# model every method's sample is OVERLAP_STEPS calls, so that each is sent at the link's rate alike.
SMALL_BYTES = 8 * 1024 * 1024
STEADY_ROW = "ddpkit overlap steady"
_STEADY_SAMPLE = f"ddpkit overlap x{STEADY_STEPS}"  # a raw sample; reported as STEADY_ROW


def build(name: str) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]], Callable[..., torch.Tensor]]:
    if name == "big":
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(6):
            layers += [nn.Linear(2048, 2048), nn.ReLU()]
        return nn.Sequential(*layers), lambda step: (torch.randn(64, 2048), torch.randn(64, 2048)), nn.functional.mse_loss
    if name == "mlp384":
        model, _, loss = build_step_model("mlp")
        return model, lambda step: (torch.randn(384, 1024), torch.randn(384, 1024)), loss
    return build_step_model(name)


def measure(model_name: str, rounds: int, bucket_caps: list[float], torch_layout: bool) -> dict[str, list[float]]:
    """In every rank: the samples of each method (ms per round); C is this rank's own."""
    base, batch, loss_fn = build(model_name)
    x, y = batch(0)

    def copy() -> nn.Module:
        clone, _, _ = build(model_name)
        clone.load_state_dict(base.state_dict())
        return clone

    def trainer(model: nn.Module) -> Callable[[], None]:
        return sgd_step(model, loss_fn, x, y)

    def ddpkit(hook: Callable[..., object] | None = None, state: object = None, **options: Any) -> nn.Module:
        model = DistributedDataParallel(copy(), **options)
        if hook is not None:
            register_ddp_comm_hook(model, ddp_comm_state=state, ddp_comm_hook=hook)
        return model

    flat = torch.zeros(sum(p.numel() for p in base.parameters()))
    flat16, flat_bf16 = flat.half(), flat.bfloat16()
    forward_only = copy()
    methods: dict[str, Callable[[], object]] = {
        "C": trainer(copy()),
        "A": lambda: dist.all_reduce(flat),
        "A fp16": lambda: dist.all_reduce(flat16),
        "A bf16": lambda: dist.all_reduce(flat_bf16),
        "F": lambda: loss_fn(forward_only(x), y),
        "torch DDP": trainer(nn.parallel.DistributedDataParallel(copy())),
        "ddpkit": trainer(ddpkit()),
        "ddpkit fp16": trainer(ddpkit(fp16_compress_hook)),
        "ddpkit bf16": trainer(ddpkit(bf16_compress_hook)),
        "ddpkit PowerSGD": trainer(ddpkit(powerSGD_hook, PowerSGDState(None, matrix_approximation_rank=1,
                                                                        start_powerSGD_iter=1))),
    }
    def overlapped(count: int, periods: list[list[float]] | None = None) -> Callable[[], None]:
        """ddpkit with overlap_optimizer: ``count`` steps and the wait for the last one's gradients,
        so that a sample holds its own communication and none of the one before. ``periods``: a
        list per call of each step's period (ms) but the first's and the last's."""
        model = copy()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        ddp = DistributedDataParallel(model, overlap_optimizer=optimizer)

        def steps() -> None:
            starts = []
            for _ in range(count):
                starts.append(time.perf_counter())
                optimizer.zero_grad()
                loss_fn(ddp(x), y).backward()
                optimizer.step()
            ddp.settle()
            if periods is not None:
                periods.append([(later - start) * 1000 for start, later in zip(starts[1:-1], starts[2:])])
        return steps

    small = sum(p.numel() * p.element_size() for p in base.parameters()) < SMALL_BYTES
    steady_periods: list[list[float]] = []
    methods["ddpkit overlap"] = overlapped(OVERLAP_STEPS)
    if not small:  # one bucket: nothing is deferred, and the other samples are means of OVERLAP_STEPS calls
        methods[_STEADY_SAMPLE] = overlapped(STEADY_STEPS, steady_periods)
    if torch_layout:  # --torch-layout: the gain of ddpkit's bucket layout (ddpkit.parallel.buckets)
        # PowerSGD has no such row: its buckets are torch's already (it pays per bucket).
        for name, hook in (("ddpkit", None), ("ddpkit fp16", fp16_compress_hook)):
            model = ddpkit(hook)
            model._reducer.bucket_spread = 0  # torch's caps: 1 MB, then bucket_cap_mb
            model._reducer.set_launch_order(model._reducer.launch_order)
            methods[f"{name} torch layout"] = trainer(model)
    for cap in bucket_caps:  # --bucket-caps: ddpkit with other bucket sizes (the first bucket stays 1 MB)
        methods[f"ddpkit {cap:g} MB buckets"] = trainer(ddpkit(bucket_cap_mb=cap))
        methods[f"ddpkit fp16 {cap:g} MB buckets"] = trainer(ddpkit(fp16_compress_hook, bucket_cap_mb=cap))
    if small:
        methods = {name: method if name == "ddpkit overlap" else _repeated(method) for name, method in methods.items()}
    samples = interleaved_samples(methods, rounds)
    samples.pop(_STEADY_SAMPLE, None)
    per_step = {name: [value / OVERLAP_STEPS for value in values] if small or name == "ddpkit overlap" else values
                for name, values in samples.items()}
    # Per round the median period, as a one-step sample of the other methods is one step's time: a
    # spell in which the shaped link resends (spurious retransmissions, docs/hazards.md) slows one step
    # in ten or so, which the other methods' medians over rounds leave out as this one's does.
    if steady_periods:
        per_step[STEADY_ROW] = [statistics.median(periods) for periods in steady_periods[-rounds:]]
    return per_step


def _repeated(method: Callable[[], object]) -> Callable[[], None]:
    def calls() -> None:
        for _ in range(OVERLAP_STEPS):
            method()
    return calls


def rank_main(args: argparse.Namespace) -> None:
    """One rank, inside its node's namespace: every model measured, rank 0 writes the samples."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {}
    for model_name in args.models:
        samples = measure(model_name, args.rounds, args.bucket_caps, args.torch_layout)
        for local in ("C", "F"):  # a synchronised step waits for the slowest rank
            every_rank = [None] * dist.get_world_size()
            dist.all_gather_object(every_rank, samples[local])
            samples[local] = [max(times) for times in zip(*every_rank)]  # type: ignore[call-overload]
        results[model_name] = samples
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def shape(nodes: Nodes, gigabits: float) -> None:
    """Each node's link at ``gigabits`` per second in both directions: the node's end and the switch's."""
    rate, burst = f"{gigabits:g}gbit", f"{max(256, int(512 * gigabits))}kb"
    for name, link in zip(nodes.names, nodes.links, strict=True):
        for namespace, device in ((name, link), (nodes.switch, f"{link}s")):
            subprocess.run(["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst",
                            burst, "latency", "50ms"], check=True, capture_output=True, timeout=30)


def run_ranks(nodes: Nodes, per_node: int, models: list[str], rounds: int, bucket_caps: list[float],
              torch_layout: bool) -> dict[str, dict[str, list[float]]]:
    """Start ``per_node`` ranks in each node's namespace and return rank 0's samples by model."""
    folder = Path(tempfile.mkdtemp(prefix="ddpkit-links-"))
    out = folder / "samples.json"
    port = find_free_port()
    world = per_node * len(nodes.names)
    processes = []
    try:
        for rank in range(world):
            node = rank // per_node
            env = {**os.environ, "MASTER_ADDR": nodes.addresses[0], "MASTER_PORT": str(port), "RANK": str(rank),
                   "WORLD_SIZE": str(world), "GLOO_SOCKET_IFNAME": nodes.links[node], "OMP_NUM_THREADS": "1"}
            processes.append(subprocess.Popen(
                [*nodes.prefix(node), sys.executable, __file__, "--rank-of-nodes", "--out", str(out), "--rounds",
                 str(rounds), "--models", *models, "--bucket-caps", *map(str, bucket_caps),
                 *(["--torch-layout"] if torch_layout else [])],
                env=env, stderr=subprocess.PIPE, text=True))
        for process in processes:
            _, err = process.communicate(timeout=3600)
            if process.returncode != 0:
                raise RuntimeError(f"a rank exited {process.returncode}:\n{err[-3000:]}")
        return dict(json.loads(out.read_text()))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
        shutil.rmtree(folder, ignore_errors=True)


def per_round(samples: dict[str, list[float]], name: str) -> tuple[float, float, float]:
    """Medians over rounds, for DDP ``name``: the overlap efficiency, step / max(C, A) and step / (F + A)."""
    efficiency, over_larger, over_floor = [], [], []
    for c, a, f, t in zip(samples["C"], samples["A"], samples["F"], samples[name], strict=True):
        efficiency.append((c + a - t) / min(c, a))
        over_larger.append(t / max(c, a))
        over_floor.append(t / (f + a))
    return statistics.median(efficiency), statistics.median(over_larger), statistics.median(over_floor)


def report(rate: float, nodes: int, per_node: int, results: dict[str, dict[str, list[float]]]) -> None:
    print(f"{rate:g} Gbit/s, {nodes} nodes x {per_node} rank(s):", flush=True)
    for model_name, samples in results.items():
        medians = "  ".join(f"{name} {statistics.median(values):.1f}" for name, values in samples.items())
        print(f"  {model_name:6s} ms: {medians}")
        # --bucket-caps and --torch-layout
        capped = [name for name in samples if name.endswith(("MB buckets", "torch layout"))]
        steady = [STEADY_ROW] if STEADY_ROW in samples else []
        for name in ["torch DDP", "ddpkit", "ddpkit overlap", *steady, *(name for name in capped if "fp16" not in name)]:
            efficiency, over_larger, over_floor = per_round(samples, name)
            print(f"  {'':6s} {name:21s} overlap efficiency {efficiency:5.2f}   step/max(C, A) {over_larger:5.3f}"
                  f"   step/(F + A) {over_floor:5.3f}")
        # A compressing hook sends fewer bytes than A: its gain is measured against ddpkit without one.
        for name in ("ddpkit fp16", "ddpkit bf16", "ddpkit PowerSGD", *(name for name in capped if "fp16" in name)):
            faster = statistics.median(plain / hooked for plain, hooked in zip(samples["ddpkit"], samples[name]))
            print(f"  {'':6s} {name:16s} {faster:5.2f}x faster than ddpkit without a hook", end="")
            if (raw := f"A {name.split()[1]}") in samples:  # "ddpkit fp16 ..." -> "A fp16"
                # Its floor, as F + A is ddpkit's: no faster than the forward and the 16-bit all-reduce.
                floors = [f + a16 for f, a16 in zip(samples["F"], samples[raw], strict=True)]
                over_floor = statistics.median(t / floor for t, floor in zip(samples[name], floors))
                bound = statistics.median(plain / floor for plain, floor in zip(samples["ddpkit"], floors))
                print(f"; step/(F + {raw}) {over_floor:5.3f}, so at most {bound:5.2f}x", end="")
            print()
    sys.stdout.flush()


def json_lines(rate: float, nodes: int, per_node: int, results: dict[str, dict[str, list[float]]]) -> None:
    """``--json``: one object a line per model and DDP variant (see the module docstring)."""
    for model_name, samples in results.items():
        for name in samples:
            if name in ("C", "F") or name.startswith("A"):
                continue
            _, over_larger, over_floor = per_round(samples, name)
            print(json.dumps({"model": model_name, "rate_gbit": rate, "nodes": nodes, "ranks_per_node": per_node,
                              "variant": name, "step_ms": round(statistics.median(samples[name]), 3),
                              "step_over_max": round(over_larger, 4), "step_over_floor": round(over_floor, 4),
                              **{f"{key}_ms": round(statistics.median(samples[key]), 3) for key in ("C", "A", "F")}}))
    sys.stdout.flush()


Scaling = dict[tuple[float, str, int, int], dict[str, list[float]]]  # (rate, model, nodes, ranks a node): samples


def worlds_by_rate_and_model(scaling: Scaling) -> dict[tuple[float, str], list[tuple[int, int]]]:
    """Each (rate, model)'s worlds measured, (nodes, ranks a node), fewest ranks first."""
    worlds: dict[tuple[float, str], list[tuple[int, int]]] = {}
    for rate, model_name, count, per_node in sorted(scaling, key=lambda key: (key[0], key[1], key[2] * key[3], key[2])):
        worlds.setdefault((rate, model_name), []).append((count, per_node))
    return worlds


def print_scaling(scaling: Scaling, out: TextIO = sys.stdout) -> None:
    """How the step grows with the ranks: per rate and model, each world's medians of C and A, and
    each DDP's step over max(C, A) and over F + A (a DDP that scales keeps both flat while A grows
    with the ranks and C with what the ranks share of the CPU)."""
    print("how the step grows with the ranks (medians; step/max(C, A) and step/(F + A) per round):", file=out)
    for (rate, model_name), worlds in worlds_by_rate_and_model(scaling).items():
        print(f"  {rate:g} Gbit/s, {model_name}:", file=out)
        print(f"    {'ranks':>12s} {'C ms':>7s} {'F ms':>6s} {'A ms':>7s}   {'torch DDP':>19s}   {'ddpkit':>19s}", file=out)
        for count, per_node in worlds:
            samples = scaling[(rate, model_name, count, per_node)]
            ratios = [per_round(samples, name)[1:] for name in ("torch DDP", "ddpkit")]
            cells = "   ".join(f"{larger:9.3f} {floor:9.3f}" for larger, floor in ratios)
            medians = [statistics.median(samples[key]) for key in ("C", "F", "A")]
            print(f"    {count * per_node:3d} ({count}x{per_node:<2d})  {medians[0]:7.1f} {medians[1]:6.1f} "
                  f"{medians[2]:7.1f}   {cells}", file=out)
    out.flush()


def plot_scaling(scaling: Scaling, path: str) -> None:
    """Step over max(C, A) against the ranks, a line per DDP, rate and model."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("links.py: --plot needs matplotlib (pip install -e '.[plot]'); the table above has the figures")
        return
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for (rate, model_name), worlds in worlds_by_rate_and_model(scaling).items():
        for name in ("torch DDP", "ddpkit"):
            ratios = [per_round(scaling[(rate, model_name, count, per_node)], name)[1] for count, per_node in worlds]
            axes.plot([count * per_node for count, per_node in worlds], ratios, marker="o",
                      label=f"{name}, {model_name}, {rate:g} Gbit/s")
    axes.set_xticks(sorted({count * per_node for *_, count, per_node in scaling}))
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_xlabel("ranks (nodes x ranks per node)")
    axes.set_ylabel("step / max(C, A)")
    axes.set_title("links.py: how the step grows with the ranks")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"links.py: the plot is in {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 5, 10], help="link rates, Gbit/s")
    parser.add_argument("--ranks-per-node", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2], help="node counts (a namespace each)")
    parser.add_argument("--plot", metavar="PNG", help="draw how the step grows with the ranks (needs matplotlib)")
    parser.add_argument("--models", nargs="+", default=["mlp", "big"], choices=["mlp", "mlp384", "lenet", "many", "big"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--bucket-caps", type=float, nargs="*", default=[], metavar="MB",
                        help="also time ddpkit with these bucket_cap_mb (the default is 25)")
    parser.add_argument("--torch-layout", action="store_true",
                        help="also time ddpkit and fp16 with torch's bucket caps (1 MB, then bucket_cap_mb)")
    parser.add_argument("--json", action="store_true", help="one JSON object a line per model, rate and variant")
    parser.add_argument("--rank-of-nodes", action="store_true", help=argparse.SUPPRESS)  # one rank, in its namespace
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of_nodes:
        rank_main(args)
        return
    if (why := Nodes.unavailable()) is not None or shutil.which("tc") is None:
        print(f"links.py: {why or 'shaping a link needs iproute2`s `tc`'}; nothing measured")
        return
    print(f"torch {torch.__version__}, Gloo, 1 thread per rank, {args.rounds} rounds, methods interleaved",
          file=sys.stderr if args.json else sys.stdout)
    scaling: Scaling = {}
    for count in args.nodes:
        for per_node in args.ranks_per_node:
            for rate in random.Random(per_node).sample(args.rates, len(args.rates)):
                with Nodes(count) as nodes:
                    shape(nodes, rate)
                    results = run_ranks(nodes, per_node, args.models, args.rounds, args.bucket_caps, args.torch_layout)
                (json_lines if args.json else report)(rate, count, per_node, results)
                for model_name, samples in results.items():
                    scaling[(rate, model_name, count, per_node)] = samples
    if len({(count, per_node) for *_, count, per_node in scaling}) > 1:
        print_scaling(scaling, sys.stderr if args.json else sys.stdout)  # --json: stdout holds only JSON lines
        if args.plot:
            plot_scaling(scaling, args.plot)
    elif args.plot:
        print(f"links.py: no plot written to {args.plot}: the step against the ranks needs two worlds or more "
              "(give --nodes or --ranks-per-node two values)")


if __name__ == "__main__":
    main()
