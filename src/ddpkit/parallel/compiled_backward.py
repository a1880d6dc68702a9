"""The reducer under ``torch.compile``: whether Dynamo is tracing, running code as written where it
must not be traced, and what a compiled autograd backward (``torch._dynamo.config.compiled_autograd``)
needs: each gradient averaged by a functional all-reduce inside the compiled graph, which inductor
fuses into buckets of the DDP's cap, as torch's Python reducer does. Nothing may wait for the end
of backward there, so what a backward of ddpkit's negotiates or runs around the reduction (comm
hooks, ``reduce_function``, sparse gradients, ``join``, debug mode) is refused, named.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ddpkit.diagnostics.debug import debug_enabled
from ddpkit.variables import DDPKIT_DEBUG

__all__ = ["average_in_compiled_graph", "compiled_backward_problem", "fuse_compiled_reductions",
           "in_compiled_autograd", "outside_dynamo", "under_dynamo"]


def under_dynamo() -> bool:
    """Whether Dynamo is tracing this code, or would compile the functions it calls (its frame
    callback is set: a backward run eagerly from inside a compiled function). About 100 ns: every
    hook asks it. Traced, ``is_compiling()`` is True and the callback is never read."""
    return torch.compiler.is_compiling() or bool(torch._C._dynamo.eval_frame.get_eval_frame_callback())


@torch.compiler.disable  # type: ignore[untyped-decorator]  # torch's decorator is unannotated
def outside_dynamo(function: Callable[..., None], *args: Any) -> None:
    """``function(*args)`` run as written: Dynamo stops its trace here, and compiles nothing it calls."""
    function(*args)


def in_compiled_autograd() -> bool:
    """Whether the hook asking runs inside a compiled autograd backward (its reduction becomes part
    of the graph) rather than in an eager backward that Dynamo would otherwise compile piece by piece."""
    from torch._dynamo import compiled_autograd

    return bool(compiled_autograd.in_compiled_autograd_region)


def compiled_backward_problem(comm_hook: object, reduce_function: object, pre_sync_hooks: bool, sparse_count: int,
                              joining: bool) -> str | None:
    """What of a DDP's settings a compiled autograd backward cannot do, or None."""
    if comm_hook is not None:
        return f"the comm hook {getattr(comm_hook, '__name__', repr(comm_hook))}"
    if reduce_function is not None:
        return "reduce_function"
    if pre_sync_hooks:
        return "a one-argument comm hook (it runs before the synchronisation)"
    if sparse_count:
        return f"the sparse gradients of {sparse_count} embedding weight(s) (sparse=True)"
    if joining:
        return "DistributedDataParallel.join() (a finished rank shadows buckets the graph does not have)"
    if debug_enabled():
        return f"debug mode ({DDPKIT_DEBUG}: its fingerprints precede each reduction)"
    return None


def average_in_compiled_graph(grad: Tensor | None, group: Any, world_size: int, weighting: float,
                              problem: str | None) -> None:
    """Average ``grad`` over ``group`` in place, by a functional all-reduce traced into the compiled
    backward (``problem``: what of the DDP's settings forbids it, raised, with or without a
    gradient). Every rank's graph must use the same parameters: nothing negotiates which have a gradient."""
    import torch.distributed._functional_collectives as functional

    if problem is not None:
        raise NotImplementedError(
            f"ddpkit DistributedDataParallel: a compiled autograd backward (torch._dynamo.config.compiled_autograd) "
            f"reduces each gradient inside the compiled graph, and {problem} cannot run there. Run this model's "
            "backward without compiled autograd (torch.compile still compiles its forward and backward), or "
            "leave that setting out.")
    if grad is None:
        return
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("ddpkit DistributedDataParallel: backward after the default process group was destroyed.")
    if weighting != 1.0:
        grad = grad * weighting
    # grad / world, as torch's Python reducer: the form inductor's DDP fusion recognises.
    grad.copy_(functional.all_reduce(grad / world_size, "sum", group))


def fuse_compiled_reductions(bucket_cap_bytes: int) -> bool:
    """Once compiled autograd is on, have inductor fuse the all-reduces a compiled backward traces
    (one per gradient) into buckets of ``bucket_cap_bytes``, each awaited as late as the graph
    allows (its DDP-communication passes, which torch's DDP turns on in its Python-reducer mode);
    True once done. Called by every forward until then; it does not import torch._dynamo."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None or not dynamo.config.compiled_autograd:
        return False
    from torch._inductor import config as inductor_config

    inductor_config._fuse_ddp_communication = True
    inductor_config._fuse_ddp_bucket_size = max(1, round(bucket_cap_bytes / 2**20))
    return True
