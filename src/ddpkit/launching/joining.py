"""How one node's launcher joins a job across nodes: it hosts the job's store (node 0's, or the
rendezvous endpoint's host's launcher: ``launching.store_host``), meets the other launchers at the
rendezvous (``launching.rendezvous``), connects to their agreement (``control_plane.nodes``), and, on
NCCL under in-place recovery, tells the workers of a generation through the store that ranks
were lost.
"""

from __future__ import annotations

import dataclasses
import functools
import socket
import time
from collections.abc import Callable, Mapping

from ddpkit._network import listen_on, store_bind_address
from ddpkit.control_plane.nodes import NodeContactLostError, NodeCoordination, Shrinking, may_wait_beyond_max
from ddpkit.launching.config import LaunchConfig, LaunchError
from ddpkit.launching.rendezvous import RendezvousSettings, StoreWaits, claim_endpoint, join
from ddpkit.launching.store_host import StoreHost
from ddpkit.launching.watch import failure_of
from ddpkit.logs import get_logger
from ddpkit.membership.generations import announce_node_lost
from ddpkit.store.client import BoundedStore, GaveUpWaiting, GiveUp, StoreUnreachableError, connect, never_give_up
from ddpkit.store.job_secret import job_secret
from ddpkit.workers.processes import WorkerProcesses

__all__ = ["announce_loss", "connect_nodes", "host_rendezvous", "host_store", "join_rendezvous"]

_log = get_logger("launching")

# How long a launcher whose workers failed before it reached the store still tries to, to tell the
# other nodes (which would otherwise wait for this node's ranks): a network that flapped as the job
# started comes back within it; a node 0 that is gone does not.
_ANNOUNCE_SECONDS = 20.0
# ... unless the store's port refuses connections that long: the store is gone (a node 0 that is
# only starting listens within it).
_REFUSED_SECONDS = 3.0


def announce_loss(config: LaunchConfig, port: int, environment: Mapping[str, str], attempt: int, generation: int,
                   why: str) -> None:
    """Tell the workers of ``generation`` through the job's store that ranks were lost (``why``): on
    NCCL a SIGKILLed peer closes nothing the survivors notice, and their kernels would wait for it
    until the group's timeout. Their peer watch reads this, aborts their communicators, and they
    recover (``diagnostics.peer_watch``)."""
    store = connect(config.master_addr, port, config.store_waits.read_timeout)
    announce_node_lost(store, job_secret(environment), attempt, generation, why)


def connect_nodes(config: LaunchConfig, port: int, workers: WorkerProcesses,
                   stop_waiting: GiveUp) -> NodeCoordination | None:
    """This launcher's part in the agreement between the nodes (``control_plane.nodes``), connected
    after its workers started, so that the import of torch's store client overlaps theirs.

    None when it stopped waiting for the store because a signal came (``watch`` passes it on to
    the workers) or every worker here ended meanwhile (their end is this node's outcome); a
    failure of a worker meanwhile is ``NodeContactLostError``."""
    try:
        return reach_the_nodes(config.master_addr, port, config.node_rank, config.nnodes, config.store_waits,
                               functools.partial(failure_of, workers), lambda: None not in workers.exit_codes(),
                               stop_waiting)
    except GaveUpWaiting as stopped:
        _log.warning(f"ddpkit run: node {config.node_rank}'s launcher stopped waiting for the job's store at "
                     f"{config.master_addr}:{port} ({stopped.reason}); the other nodes' launchers are not told how "
                     "this node's workers end.")
        return None


def host_store(address: str, port: int, across_nodes: bool, environment: Mapping[str, str]) -> StoreHost:
    """The store host of node 0, listening only on the master address (``_network.store_bind_address``)."""
    bind = store_bind_address(address, across_nodes)
    try:
        listener = listen_on(bind, port)
    except OSError as error:
        raise LaunchError(
            f"the job's store cannot listen on {bind or 'every interface'} port {port} ({error.strerror or error}): "
            "give --master-port a free port (or leave it out: ddpkit run picks one), and --master-addr an address of "
            "this machine (node 0).") from None
    store_host = StoreHost(address, port, environment, listener.fileno())
    listener.close()  # the store host holds its own copy
    return store_host


def host_rendezvous(rendezvous: RendezvousSettings, environment: Mapping[str, str]) -> StoreHost | None:
    """The store host of the rendezvous when the endpoint is this host's and free (handed the socket
    this launcher bound, so two launchers on one host cannot both host it); else None."""
    listener = claim_endpoint(rendezvous.endpoint)
    if listener is None:
        return None
    store_host = StoreHost(rendezvous.endpoint.host, rendezvous.endpoint.port, environment, listener.fileno())
    listener.close()  # the store host holds its own copy
    return store_host


def join_rendezvous(config: LaunchConfig, rendezvous: RendezvousSettings, hosts_store: bool,
                     stop_waiting: GiveUp) -> tuple[LaunchConfig, NodeCoordination | None, bool]:
    """Meet the other nodes' launchers at the endpoint: the job as a static one with this node's
    rank and the world's number of nodes, the agreement between the launchers (several nodes, or
    spare nodes), and whether this launcher is a spare node (``launching.spare_node``: it has no
    node rank yet). ``stop_waiting`` ends the wait with ``GaveUpWaiting``."""
    endpoint = rendezvous.endpoint
    waits = config.store_waits
    place, store = join(endpoint, rendezvous.run_id, config.nnodes, waits, stop_waiting, config.max_nodes,
                        beyond_max=may_wait_beyond_max if config.max_nodes is not None else None)
    spare = place.node_rank is None
    # With --nnodes MIN:MAX under in-place recovery the world may shrink to MIN nodes (``control_plane.nodes``).
    shrinking = None if config.max_nodes is None else Shrinking(
        min_nodes=config.nnodes, nproc_per_node=config.nproc_per_node, spares_possible=place.nnodes < config.max_nodes)
    config = dataclasses.replace(config, node_rank=place.node_rank or 0, nnodes=place.nnodes,
                                 min_nodes=None if shrinking is None else shrinking.min_nodes,
                                 master_addr=endpoint.host, master_port=endpoint.port)
    nodes = None
    if config.coordinates_nodes:
        nodes = NodeCoordination(store, -1 if place.node_rank is None else place.node_rank, config.nnodes,
                                 endpoint.host, endpoint.port, hosts_store=hosts_store, give_up=stop_waiting,
                                 join_seconds=waits.join_timeout, survivors_go_on=config.survivors_go_on,
                                 shrinking=shrinking, node_losses_allowed=config.max_restarts)
        if not spare:  # a spare says it is alive once it took a node's place
            nodes.beat_through(connect(endpoint.host, endpoint.port, waits.join_timeout, stop_waiting))
            if hosts_store:  # a node that must not step aside (``health.straggler_replacement``)
                nodes.step_asides.say_store_host()
    return config, nodes, spare


def reach_the_nodes(address: str, port: int, node_rank: int, nnodes: int, waits: StoreWaits,
                    workers_failed: Callable[[], str | None] = never_give_up,
                    workers_ended: Callable[[], bool] = lambda: False,
                    give_up: GiveUp = never_give_up) -> NodeCoordination:
    """Reach the job's store on node 0, waiting for it to come up (up to ``waits.join_timeout``;
    each request then bounded by ``waits.read_timeout``). The workers start before this: when
    they fail meanwhile (``workers_failed`` describes how) the store is not awaited any longer
    (``NodeContactLostError``): node 0's launcher may have ended after its workers met this
    node's, and a store that is gone never comes up. It is still tried for ``_ANNOUNCE_SECONDS``
    after the failure: when it answers (a network that flapped), the failure is announced as any
    other, and the other nodes do not wait for this node's ranks. When the workers all ended
    without a failure (``workers_ended``), or ``give_up`` gives a reason (a stop signal), the
    wait ends with ``GaveUpWaiting``; ``give_up`` is also what ``finish`` and ``meet`` ask while
    they wait."""
    failure: list[str] = []
    failed_at: list[float] = []
    refused_since: list[float] = []  # since when the store's port has refused connections, after the failure

    def store_gone() -> bool:
        """The store's port has refused connections for ``_REFUSED_SECONDS`` (its host answers,
        nothing listens: a store that is gone; a network that flapped times out instead)."""
        if not _refuses_connections(address, port):
            refused_since.clear()
            return False
        refused_since[:1] = refused_since[:1] or [time.monotonic()]
        return time.monotonic() - refused_since[0] >= _REFUSED_SECONDS

    def stop_waiting() -> str | None:
        if not failure and (failed := workers_failed()) is not None:
            failure.append(failed)
            failed_at.append(time.monotonic())
        if failure:
            if time.monotonic() - failed_at[0] > _ANNOUNCE_SECONDS or store_gone():
                return failure[0]
            return give_up()
        return "every worker of this node ended" if workers_ended() else give_up()

    join_seconds = waits.join_timeout
    try:
        store = connect(address, port, join_seconds, stop_waiting)
    except GaveUpWaiting as stopped:
        if not failure or stopped.reason != failure[0]:
            raise
        raise NodeContactLostError(
            f"node {node_rank}'s launcher could not reach the job's store at {address}:{port}, and meanwhile "
            f"{failure[0]}; since then its port refused connections for {_REFUSED_SECONDS:g} s, or nothing "
            f"answered within {_ANNOUNCE_SECONDS:g} s: the launcher that hosts the store (node 0's) ended or its "
            "host is unreachable. Its output says why.") from None
    except StoreUnreachableError as error:
        raise NodeContactLostError(
            f"node {node_rank}'s launcher could not reach the job's store at {address}:{port} (hosted by the "
            f"launcher of node 0) within {join_seconds:g} s (--rdzv-conf join_timeout): {error}. Start "
            "`ddpkit run --node-rank 0` with the same --master-addr and --master-port, and check that this host "
            "can reach it.") from None
    coordination = NodeCoordination(BoundedStore(store, waits.read_timeout), node_rank, nnodes, address, port,
                                    give_up=give_up, join_seconds=join_seconds)
    coordination.beat_through(connect(address, port, waits.read_timeout))
    return coordination


def _refuses_connections(address: str, port: int) -> bool:
    """Whether ``address:port`` refuses a connection: its host answers, and nothing listens there
    (a store that is gone; a network that flapped times out or is unreachable instead)."""
    try:
        socket.create_connection((address, port), timeout=1.0).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False
