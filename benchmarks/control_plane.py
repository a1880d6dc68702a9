"""The control plane at many nodes, simulated: ddpkit's real coordination against a real store.

Each simulated node runs the launcher's coordination as ``ddpkit run`` does (``NodeCoordination``:
its beat, and the watch's poll of ``ended_elsewhere``, which looks at the job four times a
second: the count of news and the beats this launcher watches in one request, the records
only when the news changed), its health window (published every ``--window`` seconds; node 0's
launcher reads every node's), and its workers' store traffic (each rank's peer watch reading the
failure record, its hang watch counting hang requests and publishing its progress, both told of
news by their launcher and reading the store only every fallback period), with the training
replaced by nothing: only the coordination runs. Many nodes share a process, their tasks run by one
scheduler thread at their periods; the store is a real ``ddpkit store`` process. After a steady
phase one node is killed (its beat and every request of it stop, as when a node's power goes), and
each surviving node's launcher is timed until it knows the node silent (``detect_s``: it watches
the node and found it silent, or read another launcher's report) and until it holds the decision
(``agree_s``): the job ends (default), the world shrinks without it (``--in-place``: ``--nnodes
MIN:MAX`` with MIN one less than the nodes). Under ``--in-place`` each survivor's ranks then meet
the generation the shrink laid out, as ``Group.meet`` does (``formed_s``: until they counted every
member; ``meet_requests_per_s``: what all the ranks asked of the store meanwhile).

    python benchmarks/control_plane.py --nodes 8 64 256 1024 --ranks-per-node 8 [--in-place] [--seconds S] [--json]

Printed per size: the store's requests per second in the steady phase, in all and per node (counted
by every simulated client), the 99th percentile of a probe's request latency (a ``get`` every 20 ms
from a client of its own), the detection and agreement times (median and worst over the survivors)
and the keys the store holds at the end. ``late ms`` is the median time a simulated task ran after
it was due (the worst simulator process): when it nears the periods (250 ms), the simulator or the
store could not keep up and the rates are what was served, not what the design asks for.
``by source`` splits the requests per node among the launcher's watch and coordination, its beat
and its ranks (``per_node_by_source`` in the JSON).

Simulated on one machine, whose cores the store and the simulator share: the figures are the
coordination's, not a cluster's network.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import multiprocessing
import os
import random
import resource
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

_START_SECONDS = 600.0  # for a simulator process to connect and start its nodes
_STEADY_START_SECONDS = 3.0  # after every simulated node started: the steady phase begins
_DETECT_WAIT_SECONDS = 25.0  # after the kill: how long the survivors are watched (--detect-wait)
_PROBE_SECONDS = 0.02
# The launcher's watch: ``launching.watch`` polls every 0.05 s, and looks at the job every 0.25 s
# (``control_plane.nodes``); the simulator polls every 0.1 s, which the looks follow within 0.1 s.
_WATCH_POLL_SECONDS = 0.1
_WORKERS_SECONDS = 1.0  # the ranks' tasks are due every 10 s or more: looked at once a second
_SOCKETS_PER_NODE = 1  # one connection a node (``SimulatedNode``)


# Where the requests come from: each simulated node's launcher (its watch and the coordination), its
# beat thread, and its ranks (the peer and hang watches).
SOURCES = ("launcher", "beat", "workers")


class Counted:
    """A store client that counts its requests (every method call but the timeout's)."""

    def __init__(self, store: Any, counter: list[int], source: list[int]) -> None:
        self._store, self._counter, self._source = store, counter, source

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._store, name)
        if not callable(attribute) or name in ("set_timeout",):
            return attribute
        counter = self._counter

        source = self._source

        def counted(*args: Any) -> Any:
            counter[0] += 1
            source[0] += 1
            return attribute(*args)

        return counted


@dataclass
class NodeTimes:
    node: int
    detected: float | None = None  # when this launcher knew the killed node silent (time.time)
    decided: float | None = None  # when it held the decision (the job ends, or the world shrank)


class SimulatedNode:
    """One node: its launcher's coordination and its ranks' store traffic, driven by its process's
    scheduler (``Scheduler``) at the periods ``ddpkit run`` uses."""

    def __init__(self, node: int, args: argparse.Namespace, port: int, counter: list[int],
                 by_source: dict[str, list[int]], decided: Any, slot: int) -> None:
        from ddpkit.control_plane.node_world import Shrinking
        from ddpkit.control_plane.nodes import NodeCoordination
        from ddpkit.health.job_health import SharedWindows
        from ddpkit.store.client import connect

        self.node, self.args, self.counter = node, args, counter
        self.killed = False
        shrinking = Shrinking(min_nodes=args.size - 1, nproc_per_node=args.ranks_per_node,
                              spares_possible=False) if args.in_place else None
        # One connection for the node's launcher, beat and ranks: the scheduler runs their tasks one at
        # a time, and a simulator of a thousand nodes could not open and serve three thousand.
        connection = connect("127.0.0.1", port, 60.0)
        client = Counted(connection, counter, by_source["launcher"])
        client.seconds = 60.0  # what ``BoundedStore`` says of its bound (its errors name it)
        self.nodes = NodeCoordination(client, node, args.size, "127.0.0.1", port,  # type: ignore[arg-type]
                                      survivors_go_on=args.in_place, shrinking=shrinking, join_seconds=600.0)
        self.beat = self.nodes.heartbeats.beats_through(Counted(connection, counter, by_source["beat"]))
        self.windows = SharedWindows(self.nodes.records, self.nodes.world.nodes)
        if args.in_place:  # for its ranks' meeting, as ``ddpkit run`` relays it to its workers
            self.nodes.looks.relay_news_to(news_file(args, node))
        self._workers_client = Counted(connection, counter, by_source["workers"])
        # Where this launcher's decision is told to its ranks' meeting (``meet_ranks``, another process).
        self._decided, self._slot = decided, slot
        self.times = NodeTimes(node)
        self.ended = False  # this launcher took the job for ended (it would end its workers)
        # Each node's workers started at their own moment: their periods do not line up across nodes.
        from ddpkit.diagnostics import hangs, relayed_news

        self._next_read = time.monotonic() + random.uniform(0, relayed_news.FALLBACK_SECONDS)
        self._next_progress = time.monotonic() + random.uniform(
            0, hangs._progress_seconds(hangs.DEFAULT_HANG_SECONDS))  # noqa: SLF001
        self._entered = 0

    def kill(self) -> None:
        """The node's power goes: its beat and every request of it stop."""
        self.killed = True
        self.nodes.heartbeats.stop()

    def watch(self) -> None:
        """The launcher's watch: ``ended_elsewhere``, as ``launching.watch.watch`` asks it each poll."""
        killed_node = self.args.size - 1
        nodes = self.nodes
        ended = nodes.ended_elsewhere()
        nodes.tidy()
        now = time.time()
        knows = (killed_node in nodes.heartbeats._silent_since or killed_node in nodes.looks.reports
                 or killed_node not in nodes.world.nodes() or nodes._lost is not None)  # noqa: SLF001
        if knows and self.times.detected is None:
            self.times.detected = now
        if (killed_node not in nodes.world.nodes() or ended) and self.times.decided is None:
            self.times.decided = now
            if self.args.in_place and not ended:
                self._decided[self._slot] = time.monotonic()
        self.ended = ended

    def workers(self) -> None:
        """The ranks' own store traffic in a quiet job (``diagnostics.peer_watch``, ``diagnostics.hangs``):
        their launcher relays the job's count of news to them (``diagnostics.relayed_news``, a local
        file), so each rank reads the failure record and the count of hang requests only every
        fallback period, and publishes its progress every ``hangs._progress_seconds`` of the
        default hang time."""
        from ddpkit.diagnostics import hangs, relayed_news
        from ddpkit.diagnostics.failures import read_failure_record, record_signer
        from ddpkit.store import keys

        store, ranks = self._workers_client, range(self.node * self.args.ranks_per_node,
                                                   (self.node + 1) * self.args.ranks_per_node)
        signer = record_signer()
        if time.monotonic() >= self._next_read:
            self._next_read = time.monotonic() + relayed_news.FALLBACK_SECONDS
            for _ in ranks:
                read_failure_record(store, timeout=None)
                store.add(signer.key(keys.HANG_REQUESTS), 0)
        if time.monotonic() >= self._next_progress:
            self._next_progress = time.monotonic() + hangs._progress_seconds(hangs.DEFAULT_HANG_SECONDS)  # noqa: SLF001
            self._entered += 1
            for rank in ranks:
                store.set(signer.key(keys.hang_progress(rank)), f"#{self._entered} all_reduce")

    def window(self) -> None:
        """The node's health window (``health.job_health``): its ranks' windows published, and node 0's
        launcher reads every node's."""
        start = time.time() - self.args.window
        self.windows.publish(start, self.node, "host", [], None)
        if self.node == 0:
            self.windows.collect(start)


class Scheduler:
    """Runs each simulated node's beat, watch, ranks and window at their periods, from one thread
    (a thread per node and task would spend the simulator's CPU switching between them)."""

    def __init__(self, simulated: list[SimulatedNode], args: argparse.Namespace) -> None:
        self.simulated = simulated
        self._queue: list[tuple[float, int, int, str]] = []
        self._late: list[float] = []
        self._stopped = threading.Event()
        self._sequence = 0
        self.measuring = False  # lateness is counted in the steady phase only
        beat_seconds = simulated[0].nodes.heartbeats.beat_seconds
        self.periods = {"beat": beat_seconds, "watch": _WATCH_POLL_SECONDS, "workers": _WORKERS_SECONDS, "window": args.window}
        now = time.monotonic()
        for index, _ in enumerate(simulated):
            for kind, period in self.periods.items():
                self._push(now + random.uniform(0, period), index, kind)

    def _push(self, due: float, index: int, kind: str) -> None:
        self._sequence += 1
        heapq.heappush(self._queue, (due, self._sequence, index, kind))

    def run(self) -> None:
        while not self._stopped.is_set() and self._queue:
            due, _, index, kind = heapq.heappop(self._queue)
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            elif self.measuring:
                self._late.append(-wait)
            node = self.simulated[index]
            if node.killed or node.ended:
                continue
            try:
                if kind == "beat":
                    if not node.beat():
                        continue
                else:
                    getattr(node, kind)()
            except Exception:  # noqa: BLE001 - the store went away at the end of the run
                return
            # A task run late is next due a period after it ran, as a late launcher's loop would be.
            self._push(max(due + self.periods[kind], time.monotonic()), index, kind)

    def stop(self) -> None:
        self._stopped.set()

    def lateness(self) -> float:
        """The median of how late a task ran after it was due (seconds): the simulator's own lag."""
        return statistics.median(self._late) if self._late else 0.0


def news_file(args: argparse.Namespace, node: int) -> str:
    """Where a simulated node's launcher relays the job's news to its ranks (``DDPKIT_NEWS_FILE``)."""
    return os.path.join(args.news_folder, f"news{node}")


class NodeMeeting:
    """One surviving node's ranks meeting the generation the shrink laid out, as ``Group.meet`` does:
    each claims its rank, counts itself in and reads the layout (the last to arrive raises the job's
    news), then counts the arrivals when their launcher's relayed news changed (reading the layout
    again) and at ``meet_periods`` of the layout's size, and looks at the launchers' records."""

    def __init__(self, node: int, args: argparse.Namespace) -> None:
        from ddpkit.diagnostics.relayed_news import RelayedNews

        self.node, self.args = node, args
        self.next_count = 0.0  # when the ranks count the arrivals next
        self.news = RelayedNews(news_file(args, node))
        self._members = 0
        self._next_look = 0.0

    def meet(self, store: Any, fresh: bool) -> float | None:
        """One round of the meeting through ``store`` (``fresh``: the relayed news changed): the
        seconds until the next count, or None once every member arrived."""
        from ddpkit.membership import generations
        from ddpkit.membership.generations import meet_periods
        from ddpkit.store import keys
        from ddpkit.store.job_secret import RecordSigner, job_secret

        secret, generation = job_secret(), 1
        arrived_key = generations.generation_prefix(secret, 0, generation) + keys.ARRIVED
        ranks = range(self.node * self.args.ranks_per_node, (self.node + 1) * self.args.ranks_per_node)
        world = self.args.size * self.args.ranks_per_node
        now = time.monotonic()
        if not self._members:
            for rank in ranks:
                generations.claim_rank(store, secret, 0, generation, rank, f"simulated:{rank}")
                generations.announce_waiting(store, secret, 0, generation, f"simulated:{rank}")
                arrived = store.add(arrived_key, 1)
                self._members = len(generations.layout_at(store, secret, 0, generation, world).members)
                if arrived == self._members:
                    store.add(keys.launchers_news(RecordSigner(secret).namespace), 1)
        else:
            for _ in ranks:
                if fresh:
                    self._members = len(generations.layout_at(store, secret, 0, generation, world).members)
                arrived = store.add(arrived_key, 0)
        count_every, look_every = meet_periods(self._members)
        if now >= self._next_look:
            self._next_look = now + look_every
            for _ in ranks:
                generations.job_finished(store, secret, 0, generation)
                generations.node_lost(store, secret, 0, generation)
                generations.waiting_for(store, secret, 0, generation + 1)
                self._members = len(generations.layout_at(store, secret, 0, generation, world).members)
        return None if arrived >= self._members else count_every


def meet_ranks(nodes: list[int], args: argparse.Namespace, port: int, secret: str, decided: Any, formed: Any,
               requests: Any, stopped: Any) -> None:
    """The ranks of one simulator process's nodes meeting the shrunk world's generation (``NodeMeeting``),
    from a process and a connection of their own: in ``ddpkit run`` they are other processes than
    the launcher, and a thread beside the launchers' scheduler shared the interpreter's lock and
    its process's core with the launchers it simulates. A node's ranks meet once
    its launcher held the decision (``decided``, monotonic, 0 until then); when every member arrived,
    the time goes to ``formed`` (wall clock)."""
    from ddpkit.store.client import connect

    os.environ["DDPKIT_JOB_SECRET"] = secret
    counter = [0]
    store = Counted(connect("127.0.0.1", port, 60.0), counter, [0])
    meetings = [NodeMeeting(node, args) for node in nodes]
    # At most this long between two looks at a node's relayed news (``Group.meet`` looks every 10 ms: the
    # simulator's CPU is spared), and until a node's ranks meet.
    pause = 0.05
    while not stopped.wait(pause):
        meeting = [slot for slot, _ in enumerate(nodes) if decided[slot] and not formed[slot]]
        for slot in meeting:
            fresh = meetings[slot].news.changed()
            if time.monotonic() < meetings[slot].next_count and not fresh:
                continue
            try:
                delay = meetings[slot].meet(store, fresh)
            except Exception:  # noqa: BLE001 - the store went away at the end of the run
                break
            if delay is None:
                formed[slot] = time.time()
            else:
                meetings[slot].next_count = time.monotonic() + delay
        requests.value = counter[0]
        due = [meetings[slot].next_count for slot in meeting if not formed[slot]]
        pause = min(0.05, max(0.001, min(due, default=math.inf) - time.monotonic()))
    requests.value = counter[0]
    os._exit(0)  # threads in torch's store client would abort the interpreter's finalisation


def host_nodes(nodes: list[int], args: argparse.Namespace, port: int, secret: str, go: Any, phases: Any,
               results: Any, decided: Any) -> None:
    """A simulator process: ``nodes`` started, said ready, then through the phases the main process
    sets (``phases``: wall-clock times of the steady phase, the kill and the end), then their results."""
    os.environ["DDPKIT_JOB_SECRET"] = secret
    counter = [0]
    by_source: dict[str, list[int]] = {source: [0] for source in SOURCES}
    simulated = [SimulatedNode(node, args, port, counter, by_source, decided, slot) for slot, node in enumerate(nodes)]
    scheduler = Scheduler(simulated, args)
    threading.Thread(target=scheduler.run, daemon=True).start()
    results.put("ready")
    go.wait()
    steady, kill, end = phases[:]
    _sleep_until(steady)
    counted, began = counter[0], time.time()
    scheduler.measuring = True
    from_each = {source: by_source[source][0] for source in SOURCES}
    _sleep_until(kill)
    elapsed = time.time() - began
    steady_ops = (counter[0] - counted) / elapsed
    steady_by_source = {source: (by_source[source][0] - from_each[source]) / elapsed for source in SOURCES}
    late = scheduler.lateness()
    for node in simulated:
        if node.node == args.size - 1:
            node.kill()
    _sleep_until(end)
    scheduler.stop()
    results.put({"ops_per_s": steady_ops, "by_source": steady_by_source, "late_s": late,
                 "times": [(node.node, node.times.detected, node.times.decided) for node in simulated
                           if node.node != args.size - 1]})
    results.close()
    results.join_thread()
    # Threads still in torch's store client would abort the interpreter's finalisation (docs/hazards.md).
    os._exit(0)


def _sleep_until(when: float) -> None:
    time.sleep(max(0.0, when - time.time()))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def refuse_what_this_machine_cannot(size: int, processes: int) -> None:
    """A size that needs more open files than this process may have is refused, naming the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = size * _SOCKETS_PER_NODE // processes + 64
    if needed > soft:
        raise SystemExit(f"control_plane.py: {size} nodes need about {needed} open files per simulator process "
                         f"(--processes {processes}); this shell allows {soft} (ulimit -n; the hard limit is {hard}). "
                         f"Raise it (ulimit -n {min(hard, needed * 2)}) or give more --processes.")


def measure(size: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    port = free_port()
    store_process = subprocess.Popen([sys.executable, "-m", "ddpkit", "store", "--host", "127.0.0.1", "--port", str(port)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert store_process.stdout is not None
        store_process.stdout.readline()  # it serves
        probe = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        probe.set("probe", "1")
        processes = min(args.processes, size)
        args.size = size
        args.news_folder = tempfile.mkdtemp(prefix="control-plane-news-")
        context = multiprocessing.get_context("spawn")
        results, go, phases = context.Queue(), context.Event(), context.Array("d", 3)
        secret = secrets.token_hex(32)
        hosted = [list(range(index, size, processes)) for index in range(processes)]
        # Per simulator process: when each of its launchers decided, and when each node's ranks formed
        # the next generation (their meeting runs in a process of its own: ``meet_ranks``).
        decided_at = [context.Array("d", len(nodes), lock=False) for nodes in hosted]
        formed_at = [context.Array("d", len(nodes), lock=False) for nodes in hosted]
        meet_requests = [context.Value("q", 0, lock=False) for _ in hosted]
        meetings_stopped = context.Event()
        workers = [context.Process(target=host_nodes, args=(nodes, args, port, secret, go, phases, results, decided_at[index]),
                                   daemon=True) for index, nodes in enumerate(hosted)]
        meetings = [context.Process(target=meet_ranks, args=(nodes, args, port, secret, decided_at[index], formed_at[index],
                                                             meet_requests[index], meetings_stopped), daemon=True)
                    for index, nodes in enumerate(hosted)] if args.in_place else []
        for worker in workers + meetings:
            worker.start()
        for _ in workers:
            if results.get(timeout=_START_SECONDS) != "ready":
                raise RuntimeError("a simulator process did not start its nodes")
        steady = time.time() + _STEADY_START_SECONDS
        kill = steady + args.seconds
        phases[:] = [steady, kill, kill + args.detect_wait]
        go.set()
        latencies: list[float] = []
        _sleep_until(steady)
        while time.time() < kill:
            began = time.perf_counter()
            probe.get("probe")
            latencies.append(time.perf_counter() - began)
            time.sleep(_PROBE_SECONDS)
        gathered = [results.get(timeout=args.detect_wait + 120) for _ in workers]
        meetings_stopped.set()
        keys = probe.num_keys()
        for worker in workers + meetings:
            worker.join(timeout=10)
    finally:
        store_process.terminate()
        store_process.wait(timeout=10)
        if getattr(args, "news_folder", None):
            shutil.rmtree(args.news_folder, ignore_errors=True)
    ops = sum(result["ops_per_s"] for result in gathered)
    late = max(result["late_s"] for result in gathered)
    detected = [when - kill for result in gathered for _, when, _ in result["times"] if when is not None]
    decided = [when - kill for result in gathered for _, _, when in result["times"] if when is not None]
    formed = [when - kill for times, nodes in zip(formed_at, hosted) for slot, when in enumerate(times)
              if when and nodes[slot] != size - 1]
    survivors = size - 1
    latencies.sort()
    return {
        "nodes": size, "ranks_per_node": args.ranks_per_node, "in_place": args.in_place,
        "store_ops_per_s": round(ops), "ops_per_node_per_s": round(ops / size, 1),
        "per_node_by_source": {source: round(sum(result["by_source"][source] for result in gathered) / size, 1)
                               for source in SOURCES},
        "late_ms": round(late * 1e3, 1),
        "store_p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))] * 1e3, 2) if latencies else None,
        "detect_s": _spread(detected, survivors), "agree_s": _spread(decided, survivors), "keys": keys,
        # --in-place: until each survivor's ranks counted every member of the shrunk generation, and
        # what they asked of the store meanwhile (per second of that phase, from the decision on).
        "formed_s": _spread(formed, survivors) if args.in_place else None,
        "meet_requests_per_s": (round(sum(requests.value for requests in meet_requests)
                                      / max(1e-3, max(formed) - min(decided))) if args.in_place and formed else None),
    }


def _spread(seconds: list[float], expected: int) -> dict[str, Any]:
    """Median and worst, and how many of the ``expected`` survivors got there within the wait."""
    if not seconds:
        return {"min": None, "median": None, "p99": None, "max": None, "of": f"0/{expected}"}
    ordered = sorted(seconds)
    return {"min": round(ordered[0], 2), "median": round(statistics.median(ordered), 2),
            "p99": round(ordered[int(0.99 * (len(ordered) - 1))], 2), "max": round(ordered[-1], 2),
            "of": f"{len(seconds)}/{expected}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--in-place", action="store_true", help="in-place recovery, the world free to shrink by one node")
    parser.add_argument("--seconds", type=float, default=10.0, help="the steady phase (default 10)")
    parser.add_argument("--processes", type=int, default=4, help="simulator processes (default 4)")
    parser.add_argument("--window", type=float, default=60.0,
                        help="the health windows' length (ddpkit run --report-every; default 60)")
    parser.add_argument("--detect-wait", type=float, default=_DETECT_WAIT_SECONDS,
                        help="how long the survivors are watched after the kill (default 25 s)")
    parser.add_argument("--json", action="store_true", help="one JSON line per size")
    args = parser.parse_args()
    for size in args.nodes:
        if size < 2:
            raise SystemExit(f"control_plane.py: --nodes {size}: a node must be lost and others notice: give 2 or more")
        refuse_what_this_machine_cannot(size, min(args.processes, size))
    if not args.json:
        print(f"{'nodes':>6} {'ranks':>5} {'ops/s':>9} {'per node':>9} {'late ms':>7} {'p99 ms':>7} "
              f"{'detect s (med/max)':>19} {'agree s (med/max)':>18} {'keys':>7}")
    for size in args.nodes:
        row = measure(size, args)
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        detect, agree = row["detect_s"], row["agree_s"]
        print(f"{row['nodes']:>6} {row['ranks_per_node']:>5} {row['store_ops_per_s']:>9} {row['ops_per_node_per_s']:>9} "
              f"{row['late_ms']:>7} {row['store_p99_ms']!s:>7} "
              f"{detect['median']!s:>8}/{detect['max']!s:<5} {detect['of']:>5} "
              f"{agree['median']!s:>7}/{agree['max']!s:<5} {agree['of']:>5} {row['keys']:>7}  by source "
              + ", ".join(f"{source} {rate}" for source, rate in row["per_node_by_source"].items())
              + (f"; formed s {row['formed_s']['median']}/{row['formed_s']['max']} ({row['formed_s']['of']}), "
                 f"meeting {row['meet_requests_per_s']} req/s" if row["formed_s"] else ""), flush=True)


if __name__ == "__main__":
    main()
