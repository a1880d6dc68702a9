"""What one launcher reads of the job, and how often: a look (``JobLook.look``) at most every
``LOOK_SECONDS``, whoever asks, reads the job's count of records written (``LauncherRecords.news``)
and the beats this launcher watches (``heartbeats.watched``, and the nodes reported silent) in one
request. Only when the count changed does it read what the count may announce: the world's
removals and returns, who left, the nodes reported silent. Its readers (the watch's
``ended_elsewhere``, ``silent_node``, ``finish``, a spare node's wait) each ask whether news came
since they last asked (``news_since``), and read the records they need only then. A quiet job so
costs a launcher one request a look, whatever the number of nodes; the count is also relayed to
this node's workers (``diagnostics.relayed_news``).
"""

from __future__ import annotations

import time

from ddpkit.control_plane.heartbeats import Heartbeats, watched
from ddpkit.control_plane.launcher_records import LauncherRecords
from ddpkit.control_plane.node_world import NodeWorld
from ddpkit.diagnostics.relayed_news import write_news_file
from ddpkit.logs import get_logger
from ddpkit.store import keys

__all__ = ["LOOK_SECONDS", "JobLook"]

_log = get_logger("launching")

# How often a launcher looks at the job: a failure or a stop on another node reaches this one's
# watch within it, and a lost node is known within the silent time and a look.
LOOK_SECONDS = 0.25


class JobLook:
    """One launcher's looks at the job: what the last one read."""

    def __init__(self, records: LauncherRecords, heartbeats: Heartbeats, world: NodeWorld) -> None:
        self._records, self._heartbeats, self._world = records, heartbeats, world
        self.seconds = LOOK_SECONDS  # between two looks (a spare node waiting looks more often)
        self.looked_at = -LOOK_SECONDS  # when (time.monotonic)
        self.beats: dict[int, str | None] = {}  # the last beat of each node read (None: it never beat)
        self.left: set[int] = set()  # the nodes whose launchers said they left
        # Nodes another launcher reported silent (``Heartbeats.report_silent``), with the beat they
        # went silent at, until this launcher reads another beat of them or they leave the world.
        self.reports: dict[int, str] = {}
        self.lost_node: int | None = None  # the node this launcher took for lost (then not watched)
        self._news: int | None = None
        self._news_seen: dict[str, tuple[int, int]] = {}  # each reader's last (attempt, count)
        self._reports_read = 0
        # Where the count goes for this node's workers' watches, and the count last written there.
        self._news_file: str | None = None
        self._news_relayed: int | None = None

    def look(self) -> None:
        """Read the count of news and the watched beats, unless a look was made within ``LOOK_SECONDS``;
        read what the news may say when the count changed, and relay it to this node's workers."""
        now = time.monotonic()
        if now - self.looked_at < self.seconds:
            return
        nodes = self._watched_nodes()
        news, beats = self._records.news_and_reads([keys.of(keys.BEAT, node) for node in nodes], keys.JOB_WIDE)
        self.looked_at = now
        self.beats = dict(zip(nodes, beats, strict=True))
        for node, reported in list(self.reports.items()):
            if node in self.beats and self.beats[node] != reported:
                del self.reports[node]  # heard again: alive after all, or a spare node beats as it
        if news != self._news:
            self._news = news
            self._read_news()
        if self._news_file is not None and news != self._news_relayed:
            try:
                write_news_file(self._news_file, news)
                self._news_relayed = news
            except OSError as error:  # its folder went with its workers: they read the store themselves
                _log.debug(f"ddpkit run: no longer relaying news to {self._news_file}: {error}")
                self._news_file = None

    def _read_news(self) -> None:
        """What a change of the count may say that every look needs: the world's removals, who left,
        and the nodes reported silent (each read from where this launcher stopped)."""
        world = self._world
        world.refresh()
        nodes = set(world.nodes())
        self.left = set(world.nodes_left())
        for node, beat in self._heartbeats.reports_after(self._reports_read):
            self._reports_read += 1
            if node != self._records.node_rank:
                self.reports[node] = beat
        for node in [node for node in self.reports if node not in nodes or node in self.left]:
            del self.reports[node]

    def _watched_nodes(self) -> list[int]:
        """The nodes whose beats this launcher reads: those it watches and those reported silent."""
        live = [node for node in self._world.nodes()
                if node not in self.left and node not in self.reports and node != self.lost_node]
        return sorted(set(watched(live, self._records.node_rank)) | set(self.reports))

    def news_since(self, reader: str) -> bool:
        """Whether a launcher may have written a record since ``reader`` last asked, in this attempt
        (looking first, at most once a ``LOOK_SECONDS``)."""
        self.look()
        # The attempt too: what the records said of the attempt before (a failure) is not this one's.
        seen = (self._records.attempt, self._news if self._news is not None else -1)
        fresh = self._news_seen.get(reader) != seen
        self._news_seen[reader] = seen
        return fresh

    def relay_news_to(self, path: str | None) -> None:
        """From now on, write the count of news to ``path`` as it is read, for this node's workers'
        watches (``DDPKIT_NEWS_FILE``: they read the store when it changed); None: stop, the
        attempt's workers are gone."""
        self._news_file, self._news_relayed = path, None
        self.looked_at = -LOOK_SECONDS  # read (and written there) at the next look

    def silent_launchers(self) -> dict[int, str]:
        """The nodes reported silent that still are, with the beat they went silent at: what a spare
        node waits for (``launching.spare_node``). A report read at this look is believed before its
        node's beat is read (at the next look): a claim names the silent launcher, so one that beat
        again meanwhile is not taken over by it."""
        self.look()
        return {node: beat for node, beat in self.reports.items() if self.beats.get(node, beat) == beat}
