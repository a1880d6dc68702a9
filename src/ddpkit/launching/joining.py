"""How one node's launcher joins a job across nodes: it hosts the job's store (node 0's, or the
rendezvous endpoint's host's launcher: ``launching.store_host``), meets the other launchers at the
rendezvous (``launching.rendezvous``), connects to their agreement (``launching.nodes``), and, on
NCCL under in-place recovery, tells the workers of a generation through the store that ranks
were lost.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

from ddpkit._network import listen_on, store_bind_address
from ddpkit.environments import Recovery
from ddpkit.launching.config import LaunchConfig, LaunchError
from ddpkit.launching.nodes import NodeCoordination, Shrinking, may_wait_beyond_max
from ddpkit.launching.processes import WorkerProcesses
from ddpkit.launching.rendezvous import RendezvousSettings, claim_endpoint, join
from ddpkit.launching.store_host import StoreHost
from ddpkit.launching.watch import failure_of
from ddpkit.logs import get_logger
from ddpkit.membership.generations import announce_node_lost
from ddpkit.store.client import GaveUpWaiting, GiveUp, connect
from ddpkit.store.job_secret import job_secret

__all__ = ["announce_loss", "connect_nodes", "host_rendezvous", "host_store", "join_rendezvous"]

_log = get_logger("launching")


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
    """This launcher's part in the agreement between the nodes (``launching.nodes``), connected
    after its workers started, so that the import of torch's store client overlaps theirs.

    None when it stopped waiting for the store because a signal came (``watch`` passes it on to
    the workers) or every worker here ended meanwhile (their end is this node's outcome); a
    failure of a worker meanwhile is ``NodeContactLostError``."""
    try:
        return NodeCoordination.connect(config.master_addr, port, config.node_rank, config.nnodes, config.store_waits,
                                        functools.partial(failure_of, workers),
                                        lambda: None not in workers.exit_codes(), stop_waiting)
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
    # With --nnodes MIN:MAX under in-place recovery the world may shrink to MIN nodes (``launching.nodes``).
    shrinking = None if config.max_nodes is None else Shrinking(
        min_nodes=config.nnodes, nproc_per_node=config.nproc_per_node, spares_possible=place.nnodes < config.max_nodes)
    config = dataclasses.replace(config, node_rank=place.node_rank or 0, nnodes=place.nnodes,
                                 master_addr=endpoint.host, master_port=endpoint.port)
    nodes = None
    if config.coordinates_nodes:
        nodes = NodeCoordination(store, -1 if place.node_rank is None else place.node_rank, config.nnodes,
                                 endpoint.host, endpoint.port, hosts_store=hosts_store, give_up=stop_waiting,
                                 join_seconds=waits.join_timeout, in_place=config.recovery is Recovery.IN_PLACE,
                                 shrinking=shrinking, node_losses_allowed=config.max_restarts)
        if not spare:  # a spare says it is alive once it took a node's place
            nodes.beat_through(connect(endpoint.host, endpoint.port, waits.join_timeout, stop_waiting))
            if hosts_store:  # a node that must not step aside (``launching.straggler_replacement``)
                nodes.step_asides.say_store_host()
    return config, nodes, spare
