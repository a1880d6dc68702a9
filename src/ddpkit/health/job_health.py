"""The job's health as ``ddpkit run`` sees it (issue 49): each window, the ranks' step phases
(``diagnostics.step_windows``, read from the files the workers append to) make one line on the
console (``--report-every``), one JSON line in ``--metrics FILE`` (``JobWindow``: the format
``ddpkit report`` and the tests read), and the stragglers are named.

A straggler is a rank whose own compute (forward + backward) or data wait (between steps, the
optimizer step apart) is above the other ranks' median by ``--straggler-factor`` (1.2) in
``CONFIRM_WINDOWS`` windows in a row (and ``CONFIRM_SECONDS``), by at least ``MIN_SHARE`` of the step: a difference of
microseconds in a phase of microseconds is noise, not a slow rank. Only windows the steps filled
(``FILLED``) count: not a run's first (its start-up) or last, nor one with a recovery. It is named once, and again
only when that changes (another phase, or no longer slow). The others' waits are not compared:
a synchronised step makes every other rank wait for the slow one in the gradients' all-reduce.
For the same reason a node whose network link is slow shows in no rank's phases: across nodes,
each launcher times its own sending once a window (``health.link_probe``), and a node whose
link time is above the other nodes' median by the factor, and by ``LINK_FLOOR_SECONDS``, is named
for its link (as its first rank, with the node).

torch-free, as the launcher is.
"""

from __future__ import annotations

import json
import math
import socket
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from ddpkit.control_plane.launcher_records import LauncherRecords, NodeContactLostError
from ddpkit.diagnostics.step_windows import RankWindow, read_windows
from ddpkit.health.link_probe import LINK_FLOOR_SECONDS, PROBE_BYTES, LinkProbe, neighbours_of, say_where
from ddpkit.logs import get_logger
from ddpkit.store import keys

__all__ = ["CONFIRM_SECONDS", "CONFIRM_WINDOWS", "MIN_SHARE", "Comparison", "JobHealth", "JobWindow", "SharedWindows",
           "Straggler", "compare_links", "compare_ranks", "read_job_windows", "read_job_windows_and_malformed"]

_log = get_logger("launching")

#: Windows in a row a rank must be slow in before it is named (and well again before that is said),
#: and the least time they must cover: with short windows a spell of a busy host is not a straggler.
CONFIRM_WINDOWS = 2
CONFIRM_SECONDS = 5.0
#: The least a slow phase must exceed the others' median by, as a share of the step.
MIN_SHARE = 0.05
#: The share of a window its steps must fill for the window to name stragglers.
FILLED = 0.8
#: The phases compared across ranks (and across nodes: the link), and how the console names them.
PHASE_NAMES = {"compute": "compute (forward + backward)", "data": "data wait (between steps, the optimizer apart)",
               "link": f"node's link (its launcher sending {PROBE_BYTES // 2**20} MiB to its neighbours')"}
RANK_PHASES = ("compute", "data")


class Comparison(NamedTuple):
    """A rank's phase against the others' median: by ``factor``, and over it by ``share`` of the
    step; ``significant`` when that excess is more than noise (``MIN_SHARE``, ``LINK_FLOOR_SECONDS``)."""

    rank: int
    phase: str
    factor: float
    share: float
    significant: bool


@dataclass(frozen=True)
class Straggler:
    """A rank slower than the others in one phase: by ``factor`` over their median, since ``since``."""

    rank: int
    node: int
    host: str
    phase: str  # a key of PHASE_NAMES
    factor: float
    since: float  # the start of the first window it was slow in (seconds since the epoch)

    def describe(self) -> str:
        others = "other nodes'" if self.phase == "link" else "other ranks'"
        return (f"rank {self.rank} (node {self.node}, host {self.host}): its {PHASE_NAMES[self.phase]} is "
                f"{self.factor:.2f}x the {others} median since {_clock(self.since)}")


@dataclass(frozen=True)
class JobWindow:
    """One window of the job: one line of ``--metrics``."""

    start: float
    seconds: float
    steps_per_second: float
    step_median: float
    step_p90: float
    ranks: list[dict[str, Any]]  # RankWindow's fields, with "node" and "host"
    slowest: dict[str, Any] | None  # a Straggler's fields, whether or not over the factor
    stragglers: list[dict[str, Any]]  # those named (Straggler's fields)
    recoveries: int  # restarts and in-place replacements so far in the job
    links: dict[str, float] = field(default_factory=dict)  # node -> its link time (across nodes; ``link_probe``)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def rank_windows(self) -> list[RankWindow]:
        return [RankWindow.from_dict(rank) for rank in self.ranks]

    def line(self) -> str:
        """The console's health line."""
        slowest = ""
        if self.slowest is not None:
            slow = Straggler(**self.slowest)
            slowest = (f"; slowest rank {slow.rank} (node {slow.node}): {slow.phase} {slow.factor:.2f}x the others' "
                       "median")
        return (f"ddpkit run: health {_clock(self.start)} +{self.seconds:g}s: {len(self.ranks)} ranks, "
                f"{self.steps_per_second:.1f} steps/s, step {1000 * self.step_median:.1f} ms "
                f"(p90 {1000 * self.step_p90:.1f} ms){slowest}")


def read_job_windows(path: str) -> list[JobWindow]:
    """Every window in a ``--metrics`` file (lines that are not one are passed over)."""
    return read_job_windows_and_malformed(path)[0]


def read_job_windows_and_malformed(path: str) -> tuple[list[JobWindow], list[int]]:
    """Every window in a ``--metrics`` file, and the numbers (from 1) of its lines that are not one (a
    line cut short by a job that ended while writing it, or another file's)."""
    windows, malformed = [], []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                windows.append(JobWindow(**json.loads(line)))
            except (ValueError, TypeError):
                malformed.append(number)
    return windows, malformed


def compare_ranks(ranks: Sequence[RankWindow]) -> list[Comparison]:
    """Each rank's phases against the other ranks' median, the significant first, then the largest factor."""
    if len(ranks) < 2:
        return []
    step = statistics.median(rank.step for rank in ranks)
    compared = []
    for rank in ranks:
        others = [other for other in ranks if other.rank != rank.rank]
        for phase in RANK_PHASES:
            value, usual = getattr(rank, phase), statistics.median(getattr(other, phase) for other in others)
            share = (value - usual) / step if step > 0 else 0.0
            compared.append(Comparison(rank.rank, phase, _factor(value, usual), share, share >= MIN_SHARE))
    return _in_order(compared)


def compare_links(links: Mapping[int, float], first_ranks: Mapping[int, int], step: float) -> list[Comparison]:
    """Each node's link time (``links``, by node) against the other nodes' median, as its first rank's
    (``first_ranks``: nodes without one this window are left out), in the order of ``compare_ranks``."""
    compared = []
    for node, seconds in links.items():
        others = [other for where, other in links.items() if where != node]
        if not others or node not in first_ranks:
            continue
        usual = statistics.median(others)
        compared.append(Comparison(first_ranks[node], "link", _factor(seconds, usual),
                                   (seconds - usual) / step if step > 0 else 0.0, seconds - usual >= LINK_FLOOR_SECONDS))
    return _in_order(compared)


def _factor(value: float, usual: float) -> float:
    return value / usual if usual > 0 else (float("inf") if value > 0 else 1.0)


def _in_order(compared: list[Comparison]) -> list[Comparison]:
    return sorted(compared, key=lambda entry: (entry.significant, entry.factor), reverse=True)


class NodeRecord(NamedTuple):
    """What one node's launcher published for a window: its host, its ranks' windows, its link time."""

    host: str
    windows: list[RankWindow]
    link: float | None


# How many of its last windows a node keeps in the store: node 0 reads one as the next ends.
_KEPT_WINDOWS = 2


class SharedWindows:
    """Across nodes (the launchers' records in the job's store, ``launcher_records``): every node's
    launcher publishes its ranks' windows and its link time, and node 0's reads them all and
    reports the job's."""

    def __init__(self, records: LauncherRecords, world: Callable[[], list[int]]) -> None:
        self.records, self.world = records, world
        self._published: list[str] = []  # this node's windows in the store, oldest first

    def publish(self, start: float, node: int, host: str, windows: Iterable[RankWindow], link: float | None) -> None:
        """This node's windows starting at ``start``, for node 0's launcher to read (``collect``).
        No launcher polls for them: the news is not raised (every launcher would read the records
        again, N times a window). The windows before the last ``_KEPT_WINDOWS`` are deleted (node 0
        read them long ago): the store's keys do not grow with the run's length."""
        value = json.dumps({"host": host, "windows": [asdict(window) for window in windows], "link": link})
        name = keys.of(f"{keys.HEALTH}/{start:.0f}", node)
        self.records.put(name, value, keys.JOB_WIDE, news=False)
        self._published.append(name)
        while len(self._published) > _KEPT_WINDOWS:
            self.records.call("delete_key", self.records.key(self._published.pop(0), keys.JOB_WIDE))

    def collect(self, start: float) -> tuple[dict[int, NodeRecord], list[int]]:
        """What the nodes of the world published for the window ``start``, by node, and the world's nodes."""
        published, world = {}, self.world()
        for node in world:
            value = self.records.read(keys.of(f"{keys.HEALTH}/{start:.0f}", node), keys.JOB_WIDE)
            if value is not None:
                record = json.loads(value)
                link = record.get("link")
                published[node] = NodeRecord(str(record["host"]),
                                             [RankWindow.from_dict(window) for window in record["windows"]],
                                             None if link is None else float(link))
        return published, world


@dataclass
class _Watched:
    """A (rank, phase) slow in ``count`` windows in a row since ``since``."""

    since: float
    count: int = 0


@dataclass
class JobHealth:
    """Reads the workers' window files, and each window prints the health line, appends to the
    metrics file and names the stragglers (see the module docstring)."""

    seconds: float  # the windows' length
    report: bool  # print the health line (--report-every > 0)
    metrics_path: str | None  # --metrics
    factor: float  # --straggler-factor
    node: int = 0
    recoveries: Callable[[], int] = lambda: 0
    host: str = field(default_factory=socket.gethostname)
    _offsets: dict[str, int] = field(default_factory=dict)
    _pending: dict[float, dict[int, RankWindow]] = field(default_factory=dict)
    _done: float = 0.0  # the start of the last window reported
    _watched: dict[tuple[int, str], _Watched] = field(default_factory=dict)
    _named: dict[tuple[int, str], Straggler] = field(default_factory=dict)
    _well: dict[tuple[int, str], int] = field(default_factory=dict)  # a named one's windows in a row not slow
    _next_read: float = 0.0
    shared: SharedWindows | None = None  # across nodes: set once the launchers' agreement is connected
    # Told each straggler as it is named (``--stragglers replace``: ``health.straggler_replacement``);
    # True when its node is being replaced: its ranks are then watched afresh (a slow replacement is named again).
    on_named: Callable[[Straggler], bool] | None = None
    each_read: Callable[[], None] | None = None  # called at each read of the windows (a replacement's follow-up)
    _published: float = 0.0  # the start of the last window published to the other nodes
    probe: LinkProbe | None = None  # across nodes: this node's link time each window

    def across_nodes(self, shared: SharedWindows, address: str | None) -> None:
        """Report across nodes through ``shared`` (node 0's launcher reports every node's ranks), and
        time this node's link from ``address`` (this host's, towards the others; None: not timed),
        with one probe for the launcher's life."""
        self.shared = shared
        if address is None:
            return
        if self.probe is None:
            try:
                self.probe = LinkProbe(address, self.seconds, lambda: self.node)
            except OSError as error:
                _log.warning(f"ddpkit run: node {self.node}'s link probe cannot listen on {address} ({error}): its link "
                             "is not timed, and a slow link of this node is not named")
                return
        try:
            say_where(shared.records, self.node, self.probe)
        except NodeContactLostError:
            return  # the store is gone: the watch's own checks end the attempt

    def poll(self, files: Iterable[str], ranks: int, now: float | None = None) -> None:
        """Read what the workers wrote (``files``, of this node's ``ranks`` ranks) and report each
        window that every rank wrote, or that ended a whole window ago; cheap between reads.
        Across nodes (``shared``), each node publishes its ranks' windows and node 0 reports."""
        now = time.time() if now is None else now
        if now < self._next_read:
            return
        self._next_read = now + min(1.0, self.seconds / 4)
        if self.each_read is not None:
            self.each_read()
        for path in files:
            windows, self._offsets[path] = read_windows(path, self._offsets.get(path, 0))
            for window in windows:
                if window.start > self._done:
                    self._pending.setdefault(window.start, {})[window.rank] = window
        for start in sorted(self._pending):
            written, late = self._pending[start], now >= start + 2 * self.seconds + 1.0
            if len(written) < ranks and not late:
                break  # later windows wait for this one: the console stays in order
            placed = {rank: (self.node, self.host) for rank in written}
            links: dict[int, float] = {}
            if self.shared is not None:
                try:
                    gathered = self._gather(self.shared, start, written, late)
                except NodeContactLostError:
                    return  # the store is gone: the watch's own checks end the attempt, not the report
                if gathered is None:
                    break
                written, placed, links = gathered
            del self._pending[start]
            self._done = start
            if written and (self.shared is None or self.node == 0):
                self.window(sorted(written.values(), key=lambda window: window.rank), placed, links)

    def _gather(self, shared: SharedWindows, start: float, written: dict[int, RankWindow], late: bool
                ) -> tuple[dict[int, RankWindow], dict[int, tuple[int, str]], dict[int, float]] | None:
        """Across nodes: publish this node's ranks' windows of ``start`` (once), with its link time;
        on node 0, every node's ranks' windows, where they are and the nodes' link times (None:
        wait for a node that did not publish yet, unless it is ``late``)."""
        if start > self._published:
            link = self.probe.taken_in(start) if self.probe is not None else None
            shared.publish(start, self.node, self.host, written.values(), link)
            self._published = start
            if self.probe is not None:  # the world may have changed: the next window's neighbours
                world = shared.world()
                self.probe.aim(neighbours_of(shared.records, self.node, world),
                               world.index(self.node) if self.node in world else 0, len(world))
        if self.node != 0:
            return written, {}, {}
        published, world = shared.collect(start)
        if len(published) < len(world) and not late:
            return None
        return ({window.rank: window for node in sorted(published) for window in published[node].windows},
                {window.rank: (node, record.host) for node, record in published.items() for window in record.windows},
                {node: record.link for node, record in published.items() if record.link is not None})

    def window(self, ranks: list[RankWindow], placed: dict[int, tuple[int, str]] | None = None,
               links: Mapping[int, float] | None = None) -> JobWindow:
        """Report one window of ``ranks``' records (all of the same start), each rank on the node
        and host ``placed`` says (by default this launcher's), with the nodes' ``links`` times."""
        placed, links = placed or {}, links or {}
        first = ranks[0]
        first_ranks: dict[int, int] = {}
        for rank in sorted(placed):
            first_ranks.setdefault(placed[rank][0], rank)
        compared = _in_order([*compare_ranks(ranks),
                              *compare_links(links, first_ranks, statistics.median(rank.step for rank in ranks))])
        # A window its steps did not fill (the run's first, with its start-up, and last; one with a
        # recovery) names nobody: its medians are of a few steps, or of steps unlike the others.
        filled = all(rank.covered >= FILLED * rank.seconds for rank in ranks)
        slowest = None
        if compared:
            rank, phase, factor, _, _ = compared[0]
            slowest = Straggler(rank, *placed.get(rank, (self.node, self.host)), phase, round(factor, 3), first.start)
        # Those whose node is being replaced are in this window's record, and watched afresh after it.
        handed_on = self._name_stragglers(compared, first.start, placed) if filled else []
        job = JobWindow(
            start=first.start, seconds=first.seconds,
            # Over the time the steps took, not the window's: a run's first and last windows are partly idle.
            steps_per_second=statistics.median(rank.steps / rank.covered if rank.covered > 0 else 0.0 for rank in ranks),
            step_median=statistics.median(rank.step for rank in ranks), step_p90=max(rank.step_p90 for rank in ranks),
            ranks=[{**asdict(rank), **dict(zip(("node", "host"), placed.get(rank.rank, (self.node, self.host)),
                                                   strict=True))} for rank in ranks],
            slowest=None if slowest is None else asdict(slowest),
            stragglers=[asdict(straggler) for straggler in [*self._named.values(), *handed_on]],
            recoveries=self.recoveries(), links={str(node): seconds for node, seconds in sorted(links.items())})
        if self.report:
            _log.warning(job.line())
        if self.metrics_path is not None:
            try:
                with open(self.metrics_path, "a", encoding="utf-8") as handle:
                    handle.write(job.to_json() + "\n")
            except OSError as error:
                _log.error(f"ddpkit run: --metrics {self.metrics_path}: cannot append to it ({error}); the job goes "
                           "on without it. Give a file in a folder that exists and that you can write to.")
                self.metrics_path = None
        return job

    @property
    def confirm_windows(self) -> int:
        """Windows in a row that name a straggler, or say it is well again."""
        return max(CONFIRM_WINDOWS, math.ceil(CONFIRM_SECONDS / self.seconds))

    def _name_stragglers(self, compared: list[Comparison], start: float,
                         placed: dict[int, tuple[int, str]]) -> list[Straggler]:
        """Name the ranks slow for long enough, and say those well again; the stragglers whose node
        ``on_named`` is replacing (no longer watched)."""
        slow = {(entry.rank, entry.phase): entry.factor for entry in compared
                if entry.factor >= self.factor and entry.significant}
        for key in list(self._watched):
            if key not in slow:
                del self._watched[key]
        for key, factor in slow.items():
            watched = self._watched.setdefault(key, _Watched(start))
            watched.count += 1
            if watched.count >= self.confirm_windows and key not in self._named:
                node, host = placed.get(key[0], (self.node, self.host))
                straggler = Straggler(key[0], node, host, key[1], round(factor, 3), watched.since)
                self._named[key] = straggler
                _log.warning(f"ddpkit run: straggler: {straggler.describe()}")
                if self.on_named is not None and self.on_named(straggler):
                    self._forget_node(node, placed)
                    return [straggler]
        for key in list(self._named):
            self._well[key] = 0 if key in slow else self._well.get(key, 0) + 1
            if self._well[key] < self.confirm_windows:
                continue
            straggler, _ = self._named.pop(key), self._well.pop(key)
            _log.warning(f"ddpkit run: rank {straggler.rank} (node {straggler.node}) is no longer a straggler: its "
                         f"{PHASE_NAMES[straggler.phase]} is within {self.factor:g}x the others' median again")
        return []


    def _forget_node(self, node: int, placed: dict[int, tuple[int, str]]) -> None:
        """Watch the ranks of ``node`` afresh (another node takes them over)."""
        ranks = {rank for rank, (where, _) in placed.items() if where == node}
        for record in (self._watched, self._named, self._well):
            for key in [key for key in record if key[0] in ranks]:
                del record[key]


def _clock(seconds: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(seconds))
