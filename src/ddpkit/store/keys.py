"""Every key ddpkit writes in a job's store, spelled once. Imports nothing: the launcher, the
workers and the diagnostics all read it.

The job's store (the launcher's, ``ddpkit store``'s, or rank 0's) holds, under the job's
namespace (``NAMESPACE`` without a job secret; ``signed_namespace`` with one, ``ddpkit.store.job_secret``):

    <namespace>attempt/<a>/generation/<g>/     one formation of the workers' group (``generation_prefix``)
        member/<rank>                           who holds a rank in it (``member``)
        layout, grow, finished, node_lost       the launchers' records of that generation
        arrived                                 how many of its members arrived
        failure, failure_seen, peer_lost        the diagnostics' records, in the group's store
        hang/...                                the hang watch's requests and answers
        (torch's own keys for the group)
    <namespace>launchers/                       the launchers' agreement across nodes (``launcher_record``):
        beat/<node>, left/<node>, removed/<node>, takeover/<node>/<launcher>, return/<node>/<generation>,
        node-losses, generation                 job-wide (``JOB_WIDE``)
        attempt/<a>/failed/<node>, succeeded/<node>, cause/<node>, preempted/<node>, arrived/<node>,
        stop, open                              one attempt's (a name/<node> has a name/count beside it)
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
    "ARRIVED", "ARRIVED_NODE", "BEAT", "CAUSE", "FAILED", "GENERATION_COUNT", "JOB_WIDE", "LEFT", "NODE_LOSSES", "OPEN",
    "LINK_PROBE", "PREEMPTED", "REMOVED_NODE", "SILENT", "STEP_ASIDE", "STOP", "STORE_HOST", "SUCCEEDED", "count_of",
    "launcher_record", "log_entry", "node_return", "of", "step_aside", "takeover",
    "FAILURE", "FAILURE_SEEN", "FINISHED", "GROW", "HANG_REQUESTS", "LAUNCHERS", "LAYOUT", "NAMESPACE",
    "NODE_LOST", "PEER_LOST", "REJOIN", "RENDEZVOUS", "RENDEZVOUS_CLOSED", "RENDEZVOUS_ID", "RENDEZVOUS_TICKETS",
    "WAITING", "BLOCK_PART", "REJOIN_PART",
    "generation_prefix", "hang_process", "launchers_news", "hang_progress", "hang_reporter", "hang_stack",
    "launcher_prefixes", "member",
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
WAITING = "waiting"
REJOIN = "rejoin"
# Parts of a generation formed within it (``Group.form_part``): the survivors alone, for a block
# between steps, then every member again.
BLOCK_PART, REJOIN_PART = "block/", "rejoin/"

# -- the diagnostics' records (in the group's store) --------------------------------------------

FAILURE = "failure"
FAILURE_SEEN = "failure_seen"
PEER_LOST = "peer_lost"
HANG_REQUESTS = "hang/requests"


def hang_stack(request: int, rank: int) -> str:
    return f"hang/stack/{request}/{rank}"


def hang_reporter(sequence: int) -> str:
    return f"hang/reporter/{sequence}"


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


#: The attempt of a launchers' record that belongs to the whole job, not one attempt.
JOB_WIDE = -1

# The launchers' records (``control_plane.launcher_records``): a name, or a name and a node (``of``).
BEAT, LEFT, REMOVED_NODE, FAILED, SUCCEEDED = "beat", "left", "removed", "failed", "succeeded"
CAUSE, PREEMPTED, ARRIVED_NODE, STOP, OPEN = "cause", "preempted", "arrived", "stop", "open"
NODE_LOSSES, GENERATION_COUNT = "node-losses", "generation"
#: The log of nodes reported silent by a launcher that watches their beat (``control_plane.heartbeats``).
SILENT = "silent"
HEALTH = "health"  # health/<window start>/<node>: a node's ranks' step windows (``health.job_health``)
LINK_PROBE = "link-probe"  # link-probe/<node>: where its launcher's link probe listens (``health.link_probe``)
STEP_ASIDE = "step-aside"  # the count beside the requests ``step_aside`` (``control_plane.node_claims``)
STORE_HOST = "store-host"  # the node whose launcher hosts the job's store (a c10d rendezvous's endpoint)
#: A count raised after every launchers' record written (not signed): a launcher whose last read of it
#: is still the count reads none of the records it watches (``LauncherRecords.news``).
NEWS = "news"


def launchers_news(namespace: str) -> str:
    """The job's count of news (``NEWS``) under the job's ``namespace``: the launchers raise it with
    each record, and ranks whose launcher relays it with each record the others must react to."""
    return namespace + launcher_record(NEWS, JOB_WIDE)


def launcher_record(name: str, attempt: int) -> str:
    """The key (under the job's namespace) of the launchers' record ``name`` of ``attempt``, or of
    the whole job (``JOB_WIDE``)."""
    return f"{LAUNCHERS}{name}" if attempt == JOB_WIDE else f"{LAUNCHERS}attempt/{attempt}/{name}"


def of(name: str, node: int) -> str:
    """The record ``name`` of one node (``beat``, ``failed``...): ``name/<node>``."""
    return f"{name}/{node}"


def count_of(name: str) -> str:
    """The count beside the records ``name/<node>`` (a hint to read them; not signed)."""
    return f"{name}/count"


def log_entry(name: str, index: int | str) -> str:
    """Entry ``index`` of the launchers' log ``name`` (``LauncherRecords.append``)."""
    return f"{name}/log/{index}"


def takeover(node: int, launcher: str) -> str:
    """A spare's claim on ``node``'s place after its launcher ``launcher`` went silent."""
    return f"takeover/{node}/{launcher}"


def step_aside(node: int, launcher: str) -> str:
    """Node 0's request that ``node``'s launcher ``launcher`` (a straggler's) hand its place to a spare node."""
    return f"{STEP_ASIDE}/{node}/{launcher}"


def node_return(node: int, removal: str) -> str:
    """A spare's claim on bringing back ``node``, removed in the generation ``removal``."""
    return f"return/{node}/{removal}"


def launcher_prefixes(namespace: str) -> tuple[str, ...]:
    """The keys that belong to the launchers and outlive attempts: theirs under the job's
    namespace, and the rendezvous id outside it."""
    return f"{namespace}{LAUNCHERS}", f"{namespace}{RENDEZVOUS}", f"{NAMESPACE}{RENDEZVOUS}"


# -- others' -------------------------------------------------------------------------------------


def pool_started(rank: int) -> str:
    return f"{NAMESPACE}pool/started/{rank}"


def torchrun_attempt_prefix(attempt: int) -> str:
    return f"{NAMESPACE}torchrun/attempt/{attempt}/"
