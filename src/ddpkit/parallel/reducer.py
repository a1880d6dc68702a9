"""The gradient synchronisation of one ``DistributedDataParallel`` (torch's C++ Reducer has the same
job): the buckets and the post-accumulate-grad hooks that fill them during backward, their
reductions launched strictly in bucket order (the all-reduce, a comm hook, or ``reduce_function``),
the wait and the copy back with the negotiation of parameters no rank used (``parallel.copy_back``),
and the reductions of zeros
by which a rank that ran out of data shadows the others (``DistributedDataParallel.join``).

How a step goes is told in ``ddpkit.parallel.ddp``'s docstring; the module owns the wrapped model, its
construction checks and broadcasts, forward and the public API, and hands backward to this class.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ddpkit.comm.collective_call import collective_call
from ddpkit.comm.collectives import broadcast_object
from ddpkit.diagnostics.debug import debug_enabled
from ddpkit.diagnostics.failures import CollectiveFailedError, guard
from ddpkit.diagnostics.waits import wait_for
from ddpkit.hooks.contract import GradBucket, check_hook_result
from ddpkit.parallel.bucket_fill import copy_batched, copy_into_bucket
from ddpkit.parallel.buckets import BUCKETS_PER_MODEL, DEFAULT_FIRST_CAP_BYTES, Bucket, assign_buckets
from ddpkit.parallel.compiled_backward import (
    average_in_compiled_graph,
    compiled_backward_problem,
    in_compiled_autograd,
    outside_dynamo,
    under_dynamo,
)
from ddpkit.parallel.copy_back import await_and_copy_back
from ddpkit.parallel.sparse import average_sparse_gradients
from ddpkit.parallel.stand_ins import GradientChange
from ddpkit.parallel.step_overlap import HeldReductions, OverlappedOptimizer, launch_sequence
from ddpkit.parallel.step_state import StepState
from ddpkit.parallel.step_timings import StepClock

__all__ = ["SYNCHRONISATION", "ReducedModule", "Reducer"]

ProcessGroup = Any
TensorsFunction = Callable[[Sequence[Tensor], ProcessGroup], None]
CommHook = Callable[[object, GradBucket], "torch.futures.Future[Any]"]

# Gradients smaller than this (elements) are copied into their bucket in one batched call when
# the bucket completes, not one by one in their hooks: for a small tensor the cost of a
# separate torch call from Python exceeds the cost of moving its data. Larger ones are copied
# (and scaled) at once in one pass, while backward goes on.
_BATCH_BELOW_NUMEL = 16384

# With overlap_optimizer, the synchronised backward whose timing orders the launches (the first
# lays the buckets out again, and the first steps are slower: allocations, page faults).
_WIRE_MEASURED = 3

#: What a backward's synchronisation is called in hang reports and debug-mode fingerprints.
SYNCHRONISATION = "DistributedDataParallel backward"


class ReducedModule(Protocol):
    """What a ``Reducer`` reads from its DDP module at each backward (the user may change them)."""

    require_backward_grad_sync: bool  # False inside no_sync: gradients accumulate locally
    broadcast_buffers: bool
    negotiate_grads: bool
    static_graph: bool


class Reducer:
    """Backward's side of one DDP module. ``owner`` is that module: its settings
    (``ReducedModule``) are read at each backward, pre-sync hooks are called with it, and
    ``sync_buffers`` broadcasts its buffers after a synchronisation."""

    def __init__(self, owner: ReducedModule, sync_buffers: Callable[[], None], trainable: dict[str, nn.Parameter],
                 sparse: list[nn.Parameter], launch_order: list[str], bucket_cap: int, process_group: ProcessGroup,
                 rank: int, world_size: int, gradient_as_bucket_view: bool,
                 reduce_function: TensorsFunction | None, weight: float | None = None) -> None:
        self._owner = owner
        self._sync_buffers = sync_buffers
        self._trainable = trainable
        self._sparse = sparse
        self.bucket_cap = bucket_cap
        # Buckets after the first hold about this share of the model's bytes (0: torch's one jump to
        # bucket_cap; ddpkit.parallel.buckets). Not an argument: benchmarks/links.py compares the two.
        self.bucket_spread = BUCKETS_PER_MODEL
        self._group = process_group
        self._as_view = gradient_as_bucket_view
        self._reduce_function = reduce_function
        self.follow(rank, world_size, weight)
        # The bucket all-reduce calls the group directly with options made once: dist.all_reduce
        # re-checks its arguments on every call, a cost the hot path need not pay.
        self._allreduce_options = dist.AllreduceOptions()
        self._allreduce_options.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # the stub's type is narrower
        self._allreduce_options.asyncOp = True
        self.comm_state: object = None
        self.comm_hook: CommHook | None = None
        # Whether each bucket is averaged elementwise: with no hook and no reduce_function, or with
        # a hook declared ``elementwise_average`` (ddpkit.hooks.contract; ddpkit's allreduce, fp16,
        # bf16). Then DDP divides while copying gradients in (one pass) and the negotiation flags
        # travel in the buffer (no message); otherwise the hook or reduce_function divides, and
        # negotiation takes its own all-reduce. Decided when the hook is registered, not in every
        # backward: the protocol check costs tens of microseconds.
        self.averages_elementwise = reduce_function is None
        # An OrderedDict: RemovableHandle keeps a weak reference to it, which a plain dict does not allow.
        self.pre_sync_hooks: OrderedDict[int, Callable[[Any], None]] = OrderedDict()
        self.joining = False  # inside DistributedDataParallel.join(): a compiled backward cannot be shadowed
        # Whether inductor was told to fuse a compiled backward's all-reduces (compiled_backward.fuse_compiled_reductions).
        self.compiled_reductions_fused = False
        # What changes every step lives in a plain object: writing attributes of an nn.Module goes
        # through its registration checks, several microseconds each.
        self.step = StepState()
        self.clock = StepClock()  # where this rank's steps go (DistributedDataParallel.timings)
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[int, int] = {}  # a parameter's id: its bucket's index
        self.launch_order: list[str] = []
        # overlap_optimizer (ddpkit.parallel.step_overlap): a backward's reductions are left in flight
        # at its end (held) and settled bucket by bucket by the next forward.
        self.overlapped: OverlappedOptimizer | None = None
        self.held = HeldReductions()
        # The order buckets are launched in (every rank the same): by index, or with overlap_optimizer
        # the share of them the wire sends during backward first, then the rest as the next forward
        # needs them (launch_sequence; the share is measured in the third synchronised backward).
        self.sent_during_backward: float | None = None
        self.launch_sequence: list[int] = []
        self.launched_in_backward = 0  # how many of launch_sequence are launched during backward
        self._hook_handles: list[RemovableHandle] = []
        self.set_launch_order([name for name in launch_order if name in trainable])
        # Their hook only makes sure the end of backward runs, also when no dense gradient arrives.
        self._sparse_hook_handles = [p.register_post_accumulate_grad_hook(self._on_sparse_gradient) for p in sparse]

    def follow(self, rank: int, world_size: int, weight: float | None = None) -> None:
        """This rank's place in the group (at construction, and when the group is formed again), and
        its ``weight``: its part of the global batch, what its gradient counts for in the average
        (1/world_size by default; more on a rank that trains a lost rank's share: ``ddpkit.membership.group``)."""
        self._rank, self._world_size = rank, world_size
        self._scale = 1.0 / world_size if weight is None else weight
        # What a gradient is multiplied by before a reduction that averages over the group itself
        # (a comm hook that is not an elementwise average, reduce_function, sparse gradients), so
        # that the average comes out weighted: 1.0 unless the ranks' weights differ.
        self._weighting = 1.0 if weight is None else weight * world_size

    @property
    def sparse_count(self) -> int:
        """How many parameters get sparse gradients (averaged apart from the buckets)."""
        return len(self._sparse)

    def set_launch_order(self, names: list[str]) -> None:
        """(Re)build the buckets for parameters in this launch order, and hook every parameter."""
        for handle in self._hook_handles:
            handle.remove()
        old_views = {id(p): view for bucket in self.buckets for p, view in zip(bucket.parameters, bucket.views)}
        self.launch_order = names
        ordered = [self._trainable[name] for name in names]
        first_cap = min(self.bucket_cap, DEFAULT_FIRST_CAP_BYTES)
        # An elementwise average (no hook, ddpkit's allreduce, fp16, bf16) gets buckets of a share of
        # the model's bytes, and under a hook caps that double too (fp16 and bf16 send fewer bytes
        # than they reduce). A hook that pays per bucket (PowerSGD: two all-reduces that wait for
        # each other, and its factors' products) or reduce_function keeps torch's caps, fewer buckets
        # (ddpkit.parallel.buckets).
        growing = self.comm_hook is not None and self.averages_elementwise
        spread = self.bucket_spread if self.averages_elementwise else 0
        groups = assign_buckets(ordered, cap_bytes=self.bucket_cap, first_cap_bytes=first_cap, growing=growing,
                                spread=spread)
        self.buckets = [Bucket.build(i, [ordered[j] for j in g], [names[j] for j in g], _BATCH_BELOW_NUMEL)
                        for i, g in enumerate(groups)]
        self.bucket_of = {id(p): bucket.index for bucket in self.buckets for p in bucket.parameters}
        self.launch_sequence, self.launched_in_backward = launch_sequence(len(self.buckets), self.sent_during_backward)
        # A parameter frozen after wrapping cannot take a hook (torch refuses). It keeps its slot:
        # the end of backward copies whatever gradient it has (none: zeros, or None when no rank
        # has one), so unfreezing it later is right too, only without overlap for it.
        self._hook_handles = [bucket.parameters[slot].register_post_accumulate_grad_hook(self._make_hook(bucket, slot))
                              for bucket in self.buckets for slot in range(len(bucket.parameters))
                              if bucket.parameters[slot].requires_grad]
        if self._as_view:
            # Gradients that were views into the old buffers move into the new ones (and the old
            # buffers are freed), so .grad stays a bucket view.
            for bucket in self.buckets:
                for parameter, view in zip(bucket.parameters, bucket.views):
                    if parameter.grad is not None and parameter.grad is old_views.get(id(parameter)):
                        view.copy_(parameter.grad)
                        parameter.grad = view

    def use_comm_hook(self, state: object, hook: CommHook, averages_elementwise: bool) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` from now on, in the buckets that suit it
        (``set_launch_order``: an elementwise average gets caps that double, a hook that pays per
        bucket torch's fewer buckets); the buckets were built for no hook."""
        self.comm_state, self.comm_hook = state, hook
        self.averages_elementwise = averages_elementwise
        self.set_launch_order(self.launch_order)

    def _rebuild_buckets_in_observed_order(self) -> None:
        """After the first synchronised backward: rebuild the buckets in the order in which the
        group's first rank saw gradients arrive (torch's Reducer does the same), so each bucket
        fills as early as backward allows even when registration order is not the order of use.
        The order comes from one rank, so every rank builds identical buckets."""
        observed, self.step.observed = self.step.observed, None
        if self._world_size > 1:
            observed = broadcast_object(observed, src=0, group=self._group)
        seen = set(observed or ())
        order = list(observed or ()) + [name for name in self.launch_order if name not in seen]
        if order != self.launch_order:
            self.set_launch_order(order)

    def _measure_wire(self) -> None:
        """With overlap_optimizer, in the ``_WIRE_MEASURED``-th synchronised backward (a warm one, in
        the final buckets; those before it are not deferred): the share of the wire's work that
        backward covered, by the group's first rank, which orders the launches from then on."""
        share = self.step.wire_measure()
        if self._world_size > 1:
            share = broadcast_object(share, src=0, group=self._group)
        self.sent_during_backward = 1.0 if share is None else share
        self.launch_sequence, self.launched_in_backward = launch_sequence(len(self.buckets), self.sent_during_backward)

    def _make_hook(self, bucket: Bucket, slot: int) -> Callable[[Tensor], None]:
        """The post-accumulate-grad hook of one parameter, with its bucket and slot bound (hot path)."""
        view = bucket.views[slot]
        name = bucket.names[slot]
        batched = slot in bucket.batched_slots

        def on_gradient_ready(parameter: Tensor) -> None:
            if not self._owner.require_backward_grad_sync:
                return
            if under_dynamo():
                self._hook_under_dynamo(parameter, on_gradient_ready)
                return
            if not self.step.in_backward:
                self._begin_backward()
            if bucket.ready[slot]:
                return  # a second call in the same backward (retain_graph reuse): already counted
            if self.step.observed is not None:
                self.step.observed.append(name)
            if self.step.defer_copies:
                pass  # a pre-sync hook may still change .grad: everything is copied after it ran
            elif batched:
                bucket.batched.append((parameter, view))
            else:
                copy_into_bucket(parameter, view, self.step.factor, self.step.elementwise, self._as_view)
            bucket.ready[slot] = True
            bucket.pending -= 1
            if bucket.pending == 0 and self.step.overlap:
                self._launch_complete_buckets()

        return on_gradient_ready

    def _hook_under_dynamo(self, parameter: Tensor, hook: Callable[[Tensor], None]) -> None:
        """A hook Dynamo traces, or one whose callees it would compile one by one (an eager
        backward called from a compiled function: the hooks' buckets, collectives and autograd
        callback are not Dynamo's to trace). Inside a compiled autograd backward the reduction
        becomes part of its graph (``ddpkit.parallel.compiled_backward``); otherwise the hook runs
        as written, outside Dynamo."""
        if not in_compiled_autograd():
            outside_dynamo(hook, parameter)
            return
        problem = compiled_backward_problem(self.comm_hook, self._reduce_function, bool(self.pre_sync_hooks),
                                            len(self._sparse), self.joining)
        average_in_compiled_graph(parameter.grad, self._group, self._world_size, self._weighting, problem)

    def _on_sparse_gradient(self, parameter: Tensor) -> None:
        if under_dynamo():
            self._hook_under_dynamo(parameter, self._on_sparse_gradient)  # refused in a compiled backward
            return
        if self._owner.require_backward_grad_sync and not self.step.in_backward:
            self._begin_backward()

    def _begin_backward(self) -> None:
        if self.held:
            # Autograd has already added this backward's first gradient into a bucket still in flight.
            raise RuntimeError(
                "ddpkit DistributedDataParallel(overlap_optimizer=...): a backward began while the last one's "
                "gradients were still being averaged (a second backward after one forward). This mode "
                "finishes the averaging in the next forward: call model.settle() between the two backwards, "
                "or leave overlap_optimizer off.")
        if self.overlapped is not None and self.overlapped.held:
            # The forward applied every bucket of the last step (none is in flight): it is complete
            # and forgotten now, before this backward's gradients are held (a backward inside the
            # forward, which does not settle a step asked for inside it).
            self.overlapped.settle_all()
        self.step.in_backward = True
        # Debug mode checks fingerprints before reducing, so nothing may launch during backward.
        self.step.debug = debug_enabled()
        self.step.defer_copies = bool(self.pre_sync_hooks)
        self.step.overlap = self._reduce_function is None and not self.step.defer_copies and not self.step.debug
        self.step.elementwise = self.averages_elementwise
        self.step.factor = self._scale if self.step.elementwise else self._weighting  # parallel.bucket_fill
        # The engine calls it at the end of backward, also from inside a compiled function, where
        # Dynamo would compile what it calls (the buckets' waits, the order's broadcast) one by one.
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward_as_written)

    def _launch_complete_buckets(self, up_to: int | None = None) -> None:
        """Launch the complete buckets next in the sequence, during backward those launched in it."""
        sequence, step = self.launch_sequence, self.step
        end = self.launched_in_backward if up_to is None else up_to
        while step.next_bucket < end and self.buckets[sequence[step.next_bucket]].pending == 0:
            bucket = self.buckets[sequence[step.next_bucket]]
            self._prepare_launch(bucket)
            step.in_flight.append((bucket, self._start_reduction(bucket, step.elementwise)))
            step.next_bucket += 1

    def _prepare_launch(self, bucket: Bucket) -> None:
        """Everything of a launch but the reduction: the small gradients copied in, the flags."""
        copy_batched(bucket, self.step.factor, self.step.elementwise, self._as_view)
        if self.step.elementwise:
            # The flags after the gradients say which parameters have a gradient on this rank.
            if all(p.grad is not None for p in bucket.parameters):
                bucket.flags.fill_(1)
            else:
                bucket.flags.copy_(torch.tensor([p.grad is not None for p in bucket.parameters]))
                self.step.buckets_missing_grads.add(bucket.index)
        if self.step.first_launch is None:
            self.step.first_launch = time.perf_counter()

    def _start_reduction(self, bucket: Bucket, elementwise: bool) -> Any:
        """Start reducing one bucket: its all-reduce, or the comm hook's future."""
        if self.comm_hook is None:
            # The default group is looked up, not kept: a reference would keep its connections
            # open after destroy_process_group, and peers waiting on them would not be freed.
            group = self._group if self._group is not None else dist.group.WORLD
            if group is None:  # destroyed: torch's own "not initialized" error
                return dist.all_reduce(bucket.buffer, group=self._group, async_op=True)
            return group.allreduce([bucket.buffer], self._allreduce_options)
        is_last = bucket.index == len(self.buckets) - 1
        result = self.comm_hook(self.comm_state, GradBucket(bucket, is_last, prescaled=elementwise, with_flags=elementwise))
        check_hook_result(self.comm_hook, result)
        return result

    def _wait_into_bucket(self, bucket: Bucket, pending: Any) -> None:
        """Wait for one bucket's reduction and leave its result in the bucket's buffer (a hook may
        return another tensor)."""
        result = self._wait(bucket, pending)
        if isinstance(pending, dist.Work):
            return
        result = result[0] if isinstance(result, (list, tuple)) else result
        if result is not bucket.grads and result is not bucket.buffer:
            (bucket.buffer if result.numel() == bucket.buffer.numel() else bucket.grads).copy_(result)

    def _finish_backward_as_written(self) -> None:
        if under_dynamo():
            outside_dynamo(self._finish_backward)
        else:
            self._finish_backward()

    def _finish_backward(self) -> None:
        """End of backward: complete, launch and await every bucket; copy results back."""
        self.step.synced_backwards += 1
        fingerprint = self.step.debug and self._world_size > 1
        self.clock.synchronisation_started()
        try:
            # guard(): an error of this rank's is published to the other ranks (ddpkit.diagnostics.failures)
            with collective_call(SYNCHRONISATION, self._group, fingerprint=fingerprint), guard():
                self._synchronise()
            self.clock.synchronisation_ended()
        finally:
            self.step.end_backward()
            for bucket in self.buckets:
                bucket.reset()

    def _synchronise(self) -> None:
        """Complete, launch and await every bucket; copy results back; then buffers."""
        if self.step.defer_copies:
            # The hooks see the complete local gradients in .grad, and what they leave there is
            # what gets reduced: nothing was copied into the buckets yet.
            for hook in list(self.pre_sync_hooks.values()):
                hook(self._owner)
        self.step.backward_ended = time.perf_counter()
        for bucket in (self.buckets[index] for index in self.launch_sequence[self.step.next_bucket :]):
            for slot, ready in enumerate(bucket.ready):
                if not ready or self.step.defer_copies:  # not ready: an accumulated gradient (no_sync), or zeros
                    copy_into_bucket(bucket.parameters[slot], bucket.views[slot], self.step.factor, self.step.elementwise,
                                     self._as_view)
            bucket.pending = 0
        if self._reduce_function is not None:
            for bucket in self.buckets:
                copy_batched(bucket, self.step.factor, self.step.elementwise, self._as_view)
            self._reduce_with_custom_function(self._reduce_function)
        elif self._holds():
            self._hold_for_the_next_forward()
        else:
            self._launch_complete_buckets(len(self.buckets))
        if not self.held:
            await_and_copy_back(self.buckets, self.step, self._group, self._as_view, self._negotiation_needed(),
                                self._wait_into_bucket)
            self.step.wire_ended = time.perf_counter()
        if self._sparse and self._world_size > 1:
            if self._weighting != 1.0:
                for parameter in self._sparse:
                    if parameter.grad is not None:
                        parameter.grad.mul_(self._weighting)
            average_sparse_gradients(self._sparse, self._group, 1.0 / self._world_size)
        if self._owner.broadcast_buffers:
            self._sync_buffers()
        if self.step.observed is not None:
            self._rebuild_buckets_in_observed_order()
        elif self.overlapped is not None and self.sent_during_backward is None and \
                self.step.synced_backwards >= _WIRE_MEASURED:
            self._measure_wire()

    def _hold_for_the_next_forward(self) -> None:
        """overlap_optimizer: the reductions are settled by the next forward, bucket by bucket
        (``ddpkit.parallel.step_overlap``); the first layers' buckets are launched one at a time
        as it goes."""
        self._launch_complete_buckets()
        queued = [self.buckets[index] for index in self.launch_sequence[self.step.next_bucket :]]
        for bucket in queued:
            self._prepare_launch(bucket)
        self.step.next_bucket = len(self.buckets)
        elementwise = self.step.elementwise
        self.held.hold(self.step.in_flight, queued, self.step.buckets_missing_grads if self._negotiation_needed() else set(),
                       lambda bucket: self._start_reduction(bucket, elementwise))
        self.overlapped.backward_held()  # type: ignore[union-attr]  # _holds checked it

    def _holds(self) -> bool:
        """Whether this backward's reductions are left in flight for the next forward: with
        overlap_optimizer, when they were launched during backward, once the launch order is set
        (``_measure_wire``; the synchronised backwards before are synchronous), and where unused
        parameters are found from the buckets' own flags (a comm hook that is not an elementwise
        average negotiates apart). Not with one bucket: the next forward's first module would wait
        for all of it, so nothing would overlap and the mode's bookkeeping would be pure cost."""
        return (self.overlapped is not None and self.step.overlap and self.sent_during_backward is not None
                and len(self.buckets) > 1 and (self.step.elementwise or not self._negotiation_needed()))


    def settle_held(self, index: int) -> dict[int, GradientChange] | None:
        """Wait for held bucket ``index`` and copy its gradients back; what the user's code did to
        their stand-ins meanwhile (None: none held)."""
        # As at the end of a synchronous backward: a peer's published failure is named, and under
        # in-place recovery a lost peer is PeerLostError, which the step recovers from.
        started = time.perf_counter()
        try:
            with collective_call(SYNCHRONISATION, self._group), guard():
                return self.held.settle(index, self._as_view, self._wait_into_bucket)
        finally:
            self.clock.awaited_seconds += time.perf_counter() - started  # communication (step_timings)

    def _reduce_with_custom_function(self, reduce_function: TensorsFunction) -> None:
        """The user's function reduces every gradient in place (views into the buckets)."""
        reduce_function([view for bucket in self.buckets for view in bucket.views], self._group)
        self.step.next_bucket = len(self.buckets)

    def _wait(self, bucket: Bucket, pending: Any) -> Any:
        """Wait for one bucket's reduction; when it fails or times out, say what that usually means
        (``collective_call`` names the rank instead when a peer published its failure)."""
        try:
            return wait_for(pending, self._group)
        except RuntimeError as error:
            raise CollectiveFailedError(
                f"ddpkit DistributedDataParallel: the gradient reduction of bucket {bucket.index} of "
                f"{len(self.buckets)} (parameters {bucket.names[:3]}{'...' if len(bucket.names) > 3 else ''}) "
                f"did not complete on group rank {self._rank} of {self._world_size}: {error}\n"
                "Another rank of the group did not run this backward: it failed or was killed, skipped "
                "backward, or ran a different number of steps (e.g. uneven batches). Check the other ranks' output."
            ) from error

    def _negotiation_needed(self) -> bool:
        return self._owner.negotiate_grads and not self._owner.static_graph

    def reduce_zeros(self) -> bool:
        pending = []
        # The same collectives, in the same order, as a real backward.
        for bucket in (self.buckets[index] for index in self.launch_sequence):
            bucket.buffer.zero_()
            pending.append((bucket, self._start_reduction(bucket, elementwise=True)))  # join checked it is
        anyone_trained = False
        for bucket, work in pending:
            self._wait_into_bucket(bucket, work)
            anyone_trained = anyone_trained or bool(bucket.flags.real.sum() > 0)
        if anyone_trained:  # mirror the rest of their step
            if self._owner.broadcast_buffers:
                self._sync_buffers()
            if self.step.observed is not None:
                self._rebuild_buckets_in_observed_order()
        return anyone_trained
