"""Every key ddpkit writes in a job's store, spelled once. Imports nothing: the launcher, the
workers and the diagnostics all read it.

The job's store (the launcher's, ``ddpkit store``'s, or rank 0's) holds, under the job's
namespace (``NAMESPACE`` without a job secret; ``signed_namespace`` with one, ``ddpkit.job_secret``):

    <namespace>attempt/<a>/generation/<g>/     one formation of the workers' group (``generation_prefix``)
        member/<rank>                           who holds a rank in it (``member``)
        layout, grow, finished, node_lost       the launchers' records of that generation
        arrived                                 how many of its members arrived
        failure, failure_seen, peer_lost        the diagnostics' records, in the group's store
        hang/...                                the hang watch's requests and answers
        (torch's own keys for the group)
    <namespace>launchers/...                    the launchers' agreement across nodes (``LAUNCHERS``:
                                                launching/nodes.py spells its names under it)
    <namespace>rendezvous/...                   the c10d rendezvous's tickets and closed world
    ddpkit/rendezvous/id                        unsigned, outside any job: which --rdzv-id an endpoint serves
    ddpkit/pool/started/<rank>                  the function pool's start barrier (``pool_started``)
    ddpkit/torchrun/attempt/<a>/                each torchrun attempt's keys (``torchrun_attempt_prefix``)

A group formed without a launcher's store (rank 0's, torchrun's) keeps the diagnostics' records
under the namespace itself. The launchers' keys (``LAUNCHER_PREFIXES``) outlive attempts; every
other key is cleared before the workers start again.
"""

from __future__ import annotations

__all__ = [
    "ARRIVED", "FAILURE", "FAILURE_SEEN", "FINISHED", "GROW", "HANG_REQUESTS", "LAUNCHERS", "LAYOUT", "NAMESPACE",
    "NODE_LOST", "PEER_LOST", "RENDEZVOUS", "RENDEZVOUS_CLOSED", "RENDEZVOUS_ID", "RENDEZVOUS_TICKETS",
    "generation_prefix", "hang_process", "hang_progress", "hang_stack", "launcher_prefixes", "member",
    "pool_started", "rendezvous_ticket", "signed_namespace", "torchrun_attempt_prefix",
]

#: The namespace of a job without a secret.
NAMESPACE = "ddpkit/"


def signed_namespace(digest: str) -> str:
    """The namespace of a job whose secret hashes to ``digest`` (``JobSecret.namespace``)."""
    return f"{NAMESPACE}job-{digest}/"


# -- a generation of the workers' group ---------------------------------------------------------


def generation_prefix(namespace: str, attempt: int, generation: int) -> str:
    return f"{namespace}attempt/{attempt}/generation/{generation}/"


def member(rank: int) -> str:
    return f"member/{rank}"


LAYOUT = "layout"
GROW = "grow"
FINISHED = "finished"
NODE_LOST = "node_lost"
ARRIVED = "arrived"

# -- the diagnostics' records (in the group's store) --------------------------------------------

FAILURE = "failure"
FAILURE_SEEN = "failure_seen"
PEER_LOST = "peer_lost"
HANG_REQUESTS = "hang/requests"


def hang_stack(request: int, rank: int) -> str:
    return f"hang/stack/{request}/{rank}"


def hang_progress(rank: int) -> str:
    return f"hang/progress/{rank}"


def hang_process(rank: int) -> str:
    return f"hang/process/{rank}"


# -- the launchers' ------------------------------------------------------------------------------

LAUNCHERS = "launchers/"
RENDEZVOUS = "rendezvous/"
RENDEZVOUS_CLOSED = f"{RENDEZVOUS}closed"
RENDEZVOUS_TICKETS = f"{RENDEZVOUS}tickets"
#: Outside any job's namespace and unsigned: what tells another job that the endpoint is taken.
RENDEZVOUS_ID = f"{NAMESPACE}{RENDEZVOUS}id"


def rendezvous_ticket(number: int) -> str:
    return f"{RENDEZVOUS}ticket/{number}"


def launcher_prefixes(namespace: str) -> tuple[str, ...]:
    """The keys that belong to the launchers and outlive attempts: theirs under the job's
    namespace, and the rendezvous id outside it."""
    return f"{namespace}{LAUNCHERS}", f"{namespace}{RENDEZVOUS}", f"{NAMESPACE}{RENDEZVOUS}"


# -- others' -------------------------------------------------------------------------------------


def pool_started(rank: int) -> str:
    return f"{NAMESPACE}pool/started/{rank}"


def torchrun_attempt_prefix(attempt: int) -> str:
    return f"{NAMESPACE}torchrun/attempt/{attempt}/"
