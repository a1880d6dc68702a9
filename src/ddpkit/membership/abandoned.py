"""Leaving a torch group a rank of which vanished: the group is freed in a thread of its own.

``Group.abort`` destroys torch's default group and hands the only reference to it here. Freeing it
closes its connections, which is what frees a survivor blocked on this rank in a collective that
ddpkit cannot interrupt (docs/hazards.md, "A survivor held by a survivor that already recovered").
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Any

from ddpkit.logs import get_logger
from ddpkit.process_state import PROCESS
from ddpkit.variables import DDPKIT_RECOVERY_TIMEOUT_SECONDS

__all__ = ["free_in_background"]

_log = get_logger("recovery")


def free_in_background(abandoned: list[Any], generation: int) -> None:
    """Free the torch group ``Group.abort`` left (the one item of ``abandoned``, the only reference
    to it) from a daemon thread: freeing closes its connections, so that a survivor still blocked in
    a collective of it that ddpkit cannot interrupt (the user's own ``torch.distributed`` call)
    fails at once and recovers too, instead of waiting for this rank until the group's timeout.
    Freeing first waits for any collective of the group still pending in a Gloo thread (up to the
    group's timeout, minutes; torch releases the GIL meanwhile), hence the thread: the recovery
    goes on without it. A process that ends while a thread frees a group would abort in the
    interpreter's finalisation: at exit, each is given ``_FREEING_AT_EXIT_SECONDS`` to finish
    (``ddpkit run``'s workers leave without finalising, ``diagnostics.exits``, and do not wait).
    A group still referenced elsewhere is not freed: that is said (``_free``)."""
    freeing = threading.Thread(target=_free, args=(abandoned, generation), name="ddpkit-free-abandoned-group",
                               daemon=True)
    freeing.start()
    if not PROCESS.connection.freeing:
        atexit.register(_let_the_freeing_finish)
    PROCESS.connection.freeing.append(freeing)


# How long after dropping its reference the freeing thread looks whether the group was freed.
_FREED_LOOK_SECONDS = 0.5


def _free(abandoned: list[Any], generation: int) -> None:
    """Drop the only reference ddpkit held; when something else still holds the group a moment
    later (the script's object, an autograd graph that saved it), say so: that is what keeps another
    survivor waiting on this rank."""
    held = weakref.ref(abandoned[0])
    abandoned.clear()
    time.sleep(_FREED_LOOK_SECONDS)
    if held() is not None:
        _log.warning(
            f"ddpkit: the torch group of generation {generation}, which this rank left, is still referenced elsewhere "
            "in this process, so its connections stay open: another survivor blocked on this rank in a "
            f"torch.distributed call of its own waits until {DDPKIT_RECOVERY_TIMEOUT_SECONDS} ends the job. Keep "
            "process groups out of objects that outlive a step (an autograd graph of torch.distributed.nn's "
            "collectives saves its group: do not keep the loss of a step that used one).")


# How long the process waits at its exit for the threads ``free_in_background`` started.
_FREEING_AT_EXIT_SECONDS = 5.0


def _let_the_freeing_finish() -> None:
    deadline = time.monotonic() + _FREEING_AT_EXIT_SECONDS
    for thread in PROCESS.connection.freeing:
        thread.join(max(0.0, deadline - time.monotonic()))
