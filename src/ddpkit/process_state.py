"""What this process knows beyond any one object, in one place: ``PROCESS``.

A worker is one process with one connection, one default group and one exception hook, and
several of ddpkit's parts must agree on what happened to it (a peer's failure seen, the store's
host found gone, the hang watch started) without passing an object through the user's code. Each
of those facts is a field here, named by the part that owns it, and every module reads and
writes it through ``PROCESS`` (never a copy of a part: ``reset`` replaces them). Tests that run
several jobs in one process call ``PROCESS.reset()`` between them; it forgets, and stops nothing
(a watch's thread already running ends with its process). Imports nothing of ddpkit: every part
may import it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PROCESS", "ConnectionState", "DebugState", "FailureState", "HangState", "ProcessState"]


@dataclass
class FailureState:
    """``diagnostics.failures``: what this process learnt of the other ranks' failures."""

    seen: bool = False  # this process has counted itself among the readers of the failure record
    raised: threading.Event = field(default_factory=threading.Event)  # a PeerFailedError was handed to it
    peers_may_vanish: bool = False  # in-place recovery: a collective failing without a record means a rank vanished
    node_lost: Callable[[], str | None] = lambda: None  # why a node of the group was lost (expect_vanished_peers)
    scope: str | None = None  # what this process's records are bound to (sign_records_in)
    # (id of the store, its address, why, who hosted it) once its host is gone
    gone: tuple[int, tuple[str, int], str, str] | None = None


@dataclass
class DebugState:
    """``diagnostics.debug``: whether debug mode is on (the environment unless set), and each group's
    sequence numbers."""

    forced: bool | None = None
    sequences: dict[int, int] = field(default_factory=dict)
    depth: int = 0  # > 0 inside a fingerprinted collective: the collectives it makes are not checked


@dataclass
class HangState:
    """``diagnostics.hangs``: the hang watch's seconds (None: ``DDPKIT_HANG_SECONDS``) and the watch."""

    seconds: float | None = None
    watch: Any = None  # the HangWatch once one started


@dataclass
class ConnectionState:
    """``group``: the group of this process's connection (torch's default group is one per process,
    and so is ddpkit's account of it), and the threads freeing abandoned groups, which the
    process waits for a little at its exit."""

    group: Any = None  # a ddpkit.membership.group.Group (not imported: every part imports this module)
    freeing: list[threading.Thread] = field(default_factory=list)


class ProcessState:
    """Every process-wide fact of ddpkit's, by the part that owns it (see the module docstring)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything (for tests that run several jobs in one process)."""
        self.failures = FailureState()
        self.debug = DebugState()
        self.hangs = HangState()
        self.connection = ConnectionState()
        self.peer_watch: Any = None  # ``diagnostics.peer_watch``: the watch of this process's peers, once started
        self.peer_watch_lock = threading.Lock()
        self.exception_hook: Callable[..., object] | None = None  # ``diagnostics.exits``: the hook it installed
        self.store_requests_unanswered = threading.Event()  # ``launching.store_client``: a request never answered
        self.refused_keys: set[str] = set()  # ``job_secret``: keys whose forged values were already reported
        # ``pass_through_store``: stores kept alive for the process (torch holds them only weakly).
        self.kept_stores: list[Any] = []
        # ``workers.pool``: the template the pools of this process fork their workers from, by the
        # pid that started it (a child forked from this process starts its own).
        self.pool_templates: dict[int, Any] = {}


#: The one instance.
PROCESS = ProcessState()
