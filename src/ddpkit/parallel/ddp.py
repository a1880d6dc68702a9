"""``DistributedDataParallel``: pytorch-pfn-extras' module, with torch Reducer's overlap.

How a step goes:

1. Construction checks that every rank has the same parameters and buffers (by name, shape
   and dtype; registration order may differ), raising on every rank otherwise, then copies the
   group's first rank's values to all. Buckets follow that rank's reverse registration order
   until the first synchronised backward, then are rebuilt once in the order in which that
   rank saw the gradients arrive (as torch's Reducer does).
2. During backward, each parameter's post-accumulate-grad hook copies its gradient into its
   bucket, already multiplied by 1/world_size (one pass, torch's arithmetic); small gradients
   are copied together, and divided in one pass, when their bucket completes. Buckets launch
   their asynchronous all-reduce strictly in index order: bucket i starts as soon as it and
   every bucket before it are complete. So every rank issues the same collectives in the
   same order, whatever its graph, and never waits for a bucket another rank cannot fill.
3. At the end of backward (an autograd callback) the buckets still incomplete are filled
   with zeros where a rank has no gradient and launched. Each bucket carries one flag per
   parameter ("this rank has a gradient") after its gradients, so with ``negotiate_grads``
   the reduction also tells which parameters have no gradient on any rank; those keep
   ``grad=None``. Negotiation therefore costs no collective of its own (with a comm hook or
   ``reduce_function``, which see only gradients, it is one small all-reduce). Every
   reduction is awaited and copied back before backward returns, so the optimizer sees
   averaged gradients.
4. Embedding weights with ``sparse=True`` get sparse gradients: they stay out of the buckets
   and are averaged as sparse tensors after them (``ddpkit.parallel.sparse``); comm hooks and
   ``reduce_function`` see only the dense buckets. A sparse gradient of any other parameter
   (``F.embedding(..., sparse=True)`` on a plain parameter) is averaged densified in its
   bucket and comes back dense: correct, at the cost of the whole tensor's bytes.
5. Buffers are broadcast from the group's first rank after backward, and before a forward
   when forwards ran without a backward (evaluation).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ddpkit._allocator import keep_freed_memory
from ddpkit.collective_call import collective_call
from ddpkit.collectives import all_gather_object, broadcast_object
from ddpkit.connection import distributed_available
from ddpkit.diagnostics.debug import debug_enabled
from ddpkit.diagnostics.failures import CollectiveFailedError, guard
from ddpkit.diagnostics.waits import run_collective, wait_for
from ddpkit.group import Membership, current_group
from ddpkit.hooks.contract import (
    GradBucket,
    check_comm_hook,
    check_hook_result,
    check_pre_sync_hook,
    describe_hook,
    is_elementwise_average,
)
from ddpkit.parallel.buckets import (
    DEFAULT_CAP_BYTES,
    DEFAULT_FIRST_CAP_BYTES,
    Bucket,
    assign_buckets,
)
from ddpkit.parallel.sparse import average_sparse_gradients, sparse_gradient_parameters

__all__ = ["DistributedDataParallel"]

ProcessGroup = Any
TensorsFunction = Callable[[Sequence[Tensor], ProcessGroup], None]

# Gradients smaller than this (elements) are copied into their bucket in one batched call when
# the bucket completes, not one by one in their hooks: for a small tensor the cost of a
# separate torch call from Python exceeds the cost of moving its data. Larger ones are copied
# (and scaled) at once in one pass, while backward goes on.
_BATCH_BELOW_NUMEL = 16384

# What a backward's synchronisation is called in hang reports and debug-mode fingerprints.
_SYNCHRONISATION = "DistributedDataParallel backward"

# torch DDP keyword arguments that ddpkit honours; any other is ignored with a warning.
# output_device is honoured in that outputs stay on the process's one device.
_HONOURED_KWARGS = {
    "bucket_cap_mb", "gradient_as_bucket_view", "find_unused_parameters", "static_graph",
    "device_ids", "output_device",
}


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper: gradients averaged over ``process_group`` after every backward.

    Arguments follow pytorch-pfn-extras; torch DDP's keyword arguments are accepted:
    ``bucket_cap_mb`` (25), ``gradient_as_bucket_view`` (True by default, unlike torch's False:
    after backward each ``.grad`` is a view into its bucket's buffer, so gradients are stored once
    and never copied back; ``zero_grad()`` either way keeps them right. False gives each ``.grad``
    storage of its own, as torch's default does), ``find_unused_parameters`` (an alias of
    ``negotiate_grads``), ``static_graph`` (a promise that every rank uses every parameter
    in every step: negotiation is skipped), ``device_ids``/``output_device`` (one device per
    process). Others are ignored with one warning naming them.

    ``reduce_function(tensors, group)`` replaces the whole reduction (in place, after
    backward, no overlap); ``broadcast_function(tensors, group)`` replaces the broadcasts of
    parameters at construction and of buffers.
    """

    def __init__(
        self,
        module: nn.Module,
        broadcast_buffers: bool = True,
        negotiate_grads: bool = True,
        process_group: ProcessGroup = None,
        reduce_function: TensorsFunction | None = None,
        broadcast_function: TensorsFunction | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if not distributed_available():
            raise RuntimeError(
                "DistributedDataParallel needs a process group, and none exists yet. Connect first, e.g. "
                "ddpkit.init_dist_connection(ddpkit.detect_environment()), then wrap the model."
            )
        ignored = sorted(set(kwargs) - _HONOURED_KWARGS)
        if ignored:
            warnings.warn(f"ddpkit.DistributedDataParallel ignores these torch DDP arguments: {', '.join(ignored)}.",
                          stacklevel=2)
        self.module = module
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.negotiate_grads = bool(kwargs.get("find_unused_parameters", negotiate_grads))
        self.static_graph = bool(kwargs.get("static_graph", False))
        # True by default: no copy back and one copy of the gradients (benchmarks/ddp_step.py --variants).
        self.gradient_as_bucket_view = bool(kwargs.get("gradient_as_bucket_view", True))
        #: When False (inside ``no_sync``), backward accumulates gradients locally.
        self.require_backward_grad_sync = True
        self._reduce_function = reduce_function
        self._broadcast_function = broadcast_function
        self._rank = dist.get_rank(process_group)
        if self._rank < 0:
            raise ValueError(
                f"Global rank {dist.get_rank()} is not a member of the process group given to DistributedDataParallel "
                f"(members: {dist.get_process_group_ranks(process_group)})."
            )
        self._world_size = dist.get_world_size(process_group)
        # The bucket all-reduce calls the group directly with options made once: dist.all_reduce
        # re-checks its arguments on every call, a cost the hot path need not pay.
        self._allreduce_options = dist.AllreduceOptions()
        self._allreduce_options.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # the stub's type is narrower
        self._allreduce_options.asyncOp = True
        self._source = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        self.device = self._check_device(module, kwargs.get("device_ids"))
        # Gradients and activations freed and reallocated every step stay in the process instead of
        # being page-faulted in again (ddpkit._allocator); ddpkit run's workers have it already.
        keep_freed_memory()

        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                f"{type(module).__name__} has no parameters that require grad, so there is nothing to synchronise. "
                "Wrap the module you train (or set requires_grad=True on its parameters)."
            )
        launch_order = self._check_same_module_everywhere(module)
        self._broadcast_state()

        # Embeddings with sparse=True get sparse gradients: averaged as sparse tensors after the
        # dense buckets (ddpkit.parallel.sparse), in the group's first rank's order, never put in a bucket.
        sparse_ids = sparse_gradient_parameters(module)
        self._trainable = {name: p for name, p in named if id(p) not in sparse_ids}
        by_name = dict(named)
        self._sparse = [by_name[name] for name in launch_order if name in by_name and id(by_name[name]) in sparse_ids]
        cap_mb = kwargs.get("bucket_cap_mb")
        self._bucket_cap = DEFAULT_CAP_BYTES if cap_mb is None else int(float(cap_mb) * 1024 * 1024)
        self._scale = 1.0 / self._world_size
        group = current_group() if process_group is None else None
        if group is not None:  # the default group, which in-place recovery forms again
            group.on_reconfigure(self._follow_membership)
        # (submodule, name) of every buffer: read afresh each sync, so reassigned buffers are seen,
        # without walking the module tree every step.
        self._buffer_slots = [(owner, name) for _, owner in module.named_modules()
                              for name, buffer in owner._buffers.items() if buffer is not None]
        self._comm_state: object = None
        self._comm_hook: Callable[[object, GradBucket], torch.futures.Future[Any]] | None = None
        # Whether each bucket is averaged elementwise: with no hook and no reduce_function, or with
        # a hook declared ``elementwise_average`` (ddpkit.hooks.contract; ddpkit's allreduce, fp16,
        # bf16). Then DDP divides while copying gradients in (one pass) and the negotiation flags
        # travel in the buffer (no message); otherwise the hook or reduce_function divides, and
        # negotiation takes its own all-reduce. Decided when the hook is registered, not in every
        # backward: the protocol check costs tens of microseconds.
        self._averages_elementwise = self._reduce_function is None
        # An OrderedDict: RemovableHandle keeps a weak reference to it, which a plain dict does not allow.
        self._pre_sync_hooks: OrderedDict[int, Callable[[DistributedDataParallel], None]] = OrderedDict()
        # What changes every step lives in a plain object: writing attributes of an nn.Module goes
        # through its registration checks, several microseconds each.
        self._step = _StepState()
        self._buckets: list[Bucket] = []
        self._hook_handles: list[RemovableHandle] = []
        self._set_launch_order([name for name in launch_order if name in self._trainable])
        # Their hook only makes sure the end of backward runs, also when no dense gradient arrives.
        self._sparse_hook_handles = [p.register_post_accumulate_grad_hook(self._on_sparse_gradient) for p in self._sparse]

    # -----------------------------------------------------------------------------------------
    # Construction helpers

    def _check_device(self, module: nn.Module, device_ids: Sequence[int | torch.device] | None) -> torch.device:
        devices = {t.device for t in [*module.parameters(), *module.buffers()]}
        if len(devices) > 1:
            raise ValueError(
                f"The module's tensors are on several devices {sorted(map(str, devices))}; ddpkit needs one device per "
                "process. Move the module with module.to(device) before wrapping it."
            )
        device = devices.pop() if devices else torch.device("cpu")
        if device.type == "cuda":
            wanted = device_ids[0] if device_ids else torch.cuda.current_device()
            expected = torch.device("cuda", wanted) if isinstance(wanted, int) else torch.device(wanted)
            if device != expected:
                raise ValueError(
                    f"The module is on {device} but this process's device is {expected}. Call "
                    "torch.cuda.set_device(local_rank) and module.to(local_rank) before wrapping, with device_ids=[local_rank]."
                )
        return device

    def _check_same_module_everywhere(self, module: nn.Module) -> list[str]:
        """Compare parameter and buffer names, shapes and dtypes across ranks; raise on all if they differ.

        Returns the group's first rank's parameter names in reverse registration order: the
        order in which buckets are built and launched, identical on every rank.
        """
        mine = {
            "parameters": [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()],
            "buffers": [(n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()],
        }
        everyone = all_gather_object(mine, self.process_group)
        reference = everyone[0]
        for rank, theirs in enumerate(everyone[1:], start=1):
            for kind in ("parameters", "buffers"):
                problem = _first_difference(reference[kind], theirs[kind], rank)
                if problem is not None:
                    raise ValueError(
                        f"The {kind} of the wrapped module differ between ranks of the group: {problem}. "
                        "Every rank must build the same model before wrapping it."
                    )
        return [name for name, *_ in reversed(reference["parameters"])]

    def _broadcast_state(self, source: int = 0) -> None:
        """Give every rank the parameters and buffers of group rank ``source``."""
        tensors = [p.data for _, p in sorted(self.module.named_parameters())]
        tensors += [b for _, b in sorted(self.module.named_buffers())]
        self._broadcast(tensors, source)

    def _broadcast(self, tensors: list[Tensor], source: int = 0) -> None:
        """Broadcast from group rank ``source``; ``broadcast_function`` (which has no source
        argument) serves the broadcasts from the group's first rank."""
        if not tensors or self._world_size == 1:
            return
        with collective_call("DistributedDataParallel broadcast", self.process_group):
            self._broadcast_from(tensors, source)

    def _broadcast_from(self, tensors: list[Tensor], source: int) -> None:
        if self._broadcast_function is not None and source == 0:
            self._broadcast_function(tensors, self.process_group)
            return
        global_source = source if self.process_group is None else dist.get_global_rank(self.process_group, source)
        # One message per dtype: many small broadcasts cost a round trip each.
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            run_collective(dist.broadcast, flat, src=global_source, group=self.process_group)
            if self._rank != source:
                offset = 0
                for tensor in group:
                    tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()

    def _set_launch_order(self, names: list[str]) -> None:
        """(Re)build the buckets for parameters in this launch order, and hook every parameter."""
        for handle in self._hook_handles:
            handle.remove()
        old_views = {id(p): view for bucket in self._buckets for p, view in zip(bucket.parameters, bucket.views)}
        self._launch_order = names
        ordered = [self._trainable[name] for name in names]
        first_cap = min(self._bucket_cap, DEFAULT_FIRST_CAP_BYTES)
        groups = assign_buckets(ordered, cap_bytes=self._bucket_cap, first_cap_bytes=first_cap)
        self._buckets = [Bucket.build(i, [ordered[j] for j in g], [names[j] for j in g], _BATCH_BELOW_NUMEL)
                         for i, g in enumerate(groups)]
        # A parameter frozen after wrapping cannot take a hook (torch refuses). It keeps its slot:
        # the end of backward copies whatever gradient it has (none: zeros, or None when no rank
        # has one), so unfreezing it later is right too, only without overlap for it.
        self._hook_handles = [bucket.parameters[slot].register_post_accumulate_grad_hook(self._make_hook(bucket, slot))
                              for bucket in self._buckets for slot in range(len(bucket.parameters))
                              if bucket.parameters[slot].requires_grad]
        if self.gradient_as_bucket_view:
            # Gradients that were views into the old buffers move into the new ones (and the old
            # buffers are freed), so .grad stays a bucket view.
            for bucket in self._buckets:
                for parameter, view in zip(bucket.parameters, bucket.views):
                    if parameter.grad is not None and parameter.grad is old_views.get(id(parameter)):
                        view.copy_(parameter.grad)
                        parameter.grad = view

    def _rebuild_buckets_in_observed_order(self) -> None:
        """After the first synchronised backward: rebuild the buckets in the order in which the
        group's first rank saw gradients arrive (torch's Reducer does the same), so each bucket
        fills as early as backward allows even when registration order is not the order of use.
        The order comes from one rank, so every rank builds identical buckets."""
        observed, self._step.observed = self._step.observed, None
        if self._world_size > 1:
            observed = broadcast_object(observed, src=0, group=self.process_group)
        seen = set(observed or ())
        order = list(observed or ()) + [name for name in self._launch_order if name not in seen]
        if order != self._launch_order:
            self._set_launch_order(order)

    # -----------------------------------------------------------------------------------------
    # Forward

    # Under torch.compile(ddp_model), only the wrapped module is compiled: this frame runs as
    # written, so guard() still sees an error raised inside the compiled module and publishes it
    # (traced into the graph, its except clause would never run and peers would wait for the timeout).
    @torch.compiler.disable(recursive=False)  # type: ignore[untyped-decorator]  # torch's decorator is unannotated
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Everything stays in this one frame: with recursive=False, Dynamo compiles the frames it calls.
        with guard():  # an error here is published to the other ranks (see ddpkit.diagnostics.failures)
            if self.broadcast_buffers and self._step.buffers_stale:
                self._sync_buffers()  # forwards without backward (evaluation) since the last sync
            self._step.buffers_stale = True
            if self.device.type != "cpu":
                args, kwargs = _to_device((args, kwargs), self.device)
            return self.module(*args, **kwargs)

    def _sync_buffers(self) -> None:
        if self._buffer_slots:
            self._broadcast([getattr(owner, name) for owner, name in self._buffer_slots])
        self._step.buffers_stale = False

    # -----------------------------------------------------------------------------------------
    # Backward

    def _make_hook(self, bucket: Bucket, slot: int) -> Callable[[Tensor], None]:
        """The post-accumulate-grad hook of one parameter, with its bucket and slot bound (hot path)."""
        view = bucket.views[slot]
        name = bucket.names[slot]
        batched = slot in bucket.batched_slots

        def on_gradient_ready(parameter: Tensor) -> None:
            if not self.require_backward_grad_sync:
                return
            if not self._step.in_backward:
                self._begin_backward()
            if bucket.ready[slot]:
                return  # a second call in the same backward (retain_graph reuse): already counted
            if self._step.observed is not None:
                self._step.observed.append(name)
            if self._step.defer_copies:
                pass  # a pre-sync hook may still change .grad: everything is copied after it ran
            elif batched:
                bucket.batched.append((parameter, view))
            else:
                self._copy_into_bucket(parameter, view)
            bucket.ready[slot] = True
            bucket.pending -= 1
            if bucket.pending == 0 and self._step.overlap:
                self._launch_complete_buckets()

        return on_gradient_ready

    def _on_sparse_gradient(self, parameter: Tensor) -> None:
        if self.require_backward_grad_sync and not self._step.in_backward:
            self._begin_backward()

    def _begin_backward(self) -> None:
        self._step.in_backward = True
        # Debug mode checks fingerprints before reducing, so nothing may launch during backward.
        self._step.debug = debug_enabled()
        self._step.defer_copies = bool(self._pre_sync_hooks)
        self._step.overlap = self._reduce_function is None and not self._step.defer_copies and not self._step.debug
        self._step.elementwise = self._averages_elementwise
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _copy_into_bucket(self, parameter: Tensor, view: Tensor) -> None:
        grad = parameter.grad
        if grad is None:
            view.zero_()
        elif grad is view:
            if self._step.elementwise:
                view.mul_(self._scale)
        elif grad.layout != torch.strided:  # sparse, from a module ddpkit did not recognise: densified
            view.copy_(grad.to_dense())
            if self._step.elementwise:
                view.mul_(self._scale)
        elif self._step.elementwise:
            torch.mul(grad, self._scale, out=view)  # copy and divide in one pass, as torch's Reducer
        else:
            view.copy_(grad)
        if self.gradient_as_bucket_view and grad is not None and grad is not view:
            parameter.grad = view

    def _launch_complete_buckets(self) -> None:
        while self._step.next_bucket < len(self._buckets) and self._buckets[self._step.next_bucket].pending == 0:
            self._launch(self._buckets[self._step.next_bucket])
            self._step.next_bucket += 1

    def _copy_batched(self, bucket: Bucket) -> None:
        """Copy the small gradients that the hooks only recorded, in two calls for the bucket."""
        if not bucket.batched:
            return
        arrived, bucket.batched = bucket.batched, []
        every_one = len(arrived) == len(bucket.batched_slots)  # the usual case
        parameters = bucket.batched_parameters if every_one else [parameter for parameter, _ in arrived]
        views = bucket.batched_views if every_one else [view for _, view in arrived]
        grads = [parameter.grad for parameter in parameters]  # each hook fired, so none is None
        try:
            torch._foreach_copy_(views, grads)  # type: ignore[arg-type]
        except RuntimeError:
            if all(grad.layout == torch.strided for grad in grads):  # type: ignore[union-attr]
                raise
            # Sparse gradients from a module ddpkit did not recognise: densified one by one.
            for view, grad in zip(views, grads):
                view.copy_(grad.to_dense())  # type: ignore[union-attr]
        if self._step.elementwise:  # g * (1/world): the same arithmetic as mul(out=)
            if every_one:
                bucket.batched_region.mul_(self._scale)  # they lie contiguous: one pass, not one call each
            else:
                torch._foreach_mul_(views, self._scale)
        if self.gradient_as_bucket_view:
            for parameter, view in zip(parameters, views):
                parameter.grad = view

    def _launch(self, bucket: Bucket) -> None:
        self._copy_batched(bucket)
        if self._step.elementwise:
            # The flags after the gradients say which parameters have a gradient on this rank.
            if all(p.grad is not None for p in bucket.parameters):
                bucket.flags.fill_(1)
            else:
                bucket.flags.copy_(torch.tensor([p.grad is not None for p in bucket.parameters]))
                self._step.buckets_missing_grads.add(bucket.index)
        self._step.in_flight.append((bucket, self._start_reduction(bucket, self._step.elementwise)))

    def _start_reduction(self, bucket: Bucket, elementwise: bool) -> Any:
        """Start reducing one bucket: its all-reduce, or the comm hook's future."""
        if self._comm_hook is None:
            # The default group is looked up, not kept: a reference would keep its connections
            # open after destroy_process_group, and peers waiting on them would not be freed.
            group = self.process_group if self.process_group is not None else dist.group.WORLD
            if group is None:  # destroyed: torch's own "not initialized" error
                return dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
            return group.allreduce([bucket.buffer], self._allreduce_options)
        is_last = bucket.index == len(self._buckets) - 1
        result = self._comm_hook(self._comm_state, GradBucket(bucket, is_last, prescaled=elementwise, with_flags=elementwise))
        check_hook_result(self._comm_hook, result)
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

    def _finish_backward(self) -> None:
        """End of backward: complete, launch and await every bucket; copy results back."""
        self._step.synced_backwards += 1
        fingerprint = self._step.debug and self._world_size > 1
        try:
            # guard(): an error of this rank's is published to the other ranks (ddpkit.diagnostics.failures)
            with collective_call(_SYNCHRONISATION, self.process_group, fingerprint=fingerprint), guard():
                self._synchronise()
        finally:
            self._step.end_backward()
            for bucket in self._buckets:
                bucket.reset()

    def _synchronise(self) -> None:
        """Complete, launch and await every bucket; copy results back; then buffers."""
        if self._step.defer_copies:
            # The hooks see the complete local gradients in .grad, and what they leave there is
            # what gets reduced: nothing was copied into the buckets yet.
            for hook in list(self._pre_sync_hooks.values()):
                hook(self)
        for bucket in self._buckets[self._step.next_bucket :]:
            for slot, ready in enumerate(bucket.ready):
                if not ready or self._step.defer_copies:  # not ready: an accumulated gradient (no_sync), or zeros
                    self._copy_into_bucket(bucket.parameters[slot], bucket.views[slot])
            bucket.pending = 0
        if self._reduce_function is not None:
            for bucket in self._buckets:
                self._copy_batched(bucket)
            self._reduce_with_custom_function(self._reduce_function)
        else:
            self._launch_complete_buckets()
        self._await_and_copy_back(self._negotiation_needed())
        if self._sparse and self._world_size > 1:
            average_sparse_gradients(self._sparse, self.process_group, self._scale)
        if self.broadcast_buffers:
            self._sync_buffers()
        if self._step.observed is not None:
            self._rebuild_buckets_in_observed_order()

    def _reduce_with_custom_function(self, reduce_function: TensorsFunction) -> None:
        """The user's function reduces every gradient in place (views into the buckets)."""
        reduce_function([view for bucket in self._buckets for view in bucket.views], self.process_group)
        self._step.next_bucket = len(self._buckets)

    def _wait(self, bucket: Bucket, pending: Any) -> Any:
        """Wait for one bucket's reduction; when it fails or times out, say what that usually means
        (``collective_call`` names the rank instead when a peer published its failure)."""
        try:
            return wait_for(pending, self.process_group)
        except RuntimeError as error:
            raise CollectiveFailedError(
                f"ddpkit DistributedDataParallel: the gradient reduction of bucket {bucket.index} of "
                f"{len(self._buckets)} (parameters {bucket.names[:3]}{'...' if len(bucket.names) > 3 else ''}) "
                f"did not complete on group rank {self._rank} of {self._world_size}: {error}\n"
                "Another rank of the group did not run this backward: it failed or was killed, skipped "
                "backward, or ran a different number of steps (e.g. uneven batches). Check the other ranks' output."
            ) from error

    def _negotiation_needed(self) -> bool:
        return self.negotiate_grads and not self.static_graph

    def _launch_separate_negotiation(self) -> tuple[Tensor, Any]:
        """Count, over ranks, who has a gradient for each parameter: one small asynchronous all-reduce,
        needed when a comm hook or reduce_function reduces the gradients (they carry no bucket flags)."""
        used = torch.tensor(
            [p.grad is not None for bucket in self._buckets for p in bucket.parameters],
            dtype=torch.int32, device=self._buckets[0].buffer.device,
        )
        return used, dist.all_reduce(used, group=self.process_group, async_op=True)

    def _await_and_copy_back(self, negotiate: bool) -> None:
        """Wait for each bucket in turn and copy its results back at once, so copying bucket i
        overlaps with the reduction of the buckets after it (as torch's Reducer does)."""
        separate = None
        if negotiate and not self._step.elementwise and self._buckets:
            # Its answer only matters for parameters no rank touched (rare): copy everything back
            # first and undo those afterwards, rather than wait for it before the first copy.
            separate = self._launch_separate_negotiation()
        pending_by_bucket = {bucket.index: pending for bucket, pending in self._step.in_flight}
        for bucket in self._buckets:
            pending = pending_by_bucket.get(bucket.index)
            if pending is not None:
                self._wait_into_bucket(bucket, pending)
            used = None  # None: every parameter of the bucket has a gradient somewhere
            # With a gradient for every parameter here, every summed flag is positive: no need to
            # read them (on a GPU the read would stall the CPU until the reduction has finished).
            if negotiate and separate is None and bucket.index in self._step.buckets_missing_grads:
                flags = bucket.flags.real.tolist()  # .real: complex buckets carry their flags as 1+0j
                if min(flags) <= 0:
                    used = [flag > 0 for flag in flags]
            self._copy_back(bucket, used)
        if separate is not None:
            counts, work = separate
            wait_for(work, self.process_group)
            parameters = [p for bucket in self._buckets for p in bucket.parameters]
            for parameter, count in zip(parameters, counts.tolist()):
                if count == 0:
                    parameter.grad = None  # no rank has a gradient: None, as without DDP

    def _copy_back(self, bucket: Bucket, used: list[bool] | None) -> None:
        targets, sources = [], []
        for slot, (parameter, view) in enumerate(zip(bucket.parameters, bucket.views)):
            if used is not None and not used[slot]:
                continue  # no rank has a gradient: keep None, as without DDP
            if parameter.grad is view:
                continue
            if parameter.grad is None or self.gradient_as_bucket_view:
                parameter.grad = view if self.gradient_as_bucket_view else view.clone()
            else:
                targets.append(parameter.grad)
                sources.append(view)
        if not targets:
            return
        try:
            torch._foreach_copy_(targets, sources)  # one call instead of one copy_ per parameter
        except RuntimeError:
            if all(target.layout == torch.strided for target in targets):
                raise
            self._copy_back_densifying(bucket, used)

    def _copy_back_densifying(self, bucket: Bucket, used: list[bool] | None) -> None:
        """The slow copy back, for a sparse gradient that went through a dense bucket: it comes back dense."""
        for slot, (parameter, view) in enumerate(zip(bucket.parameters, bucket.views)):
            if (used is None or used[slot]) and parameter.grad is not None and parameter.grad is not view:
                if parameter.grad.layout == torch.strided:
                    parameter.grad.copy_(view)
                else:
                    parameter.grad = view.clone()

    # -----------------------------------------------------------------------------------------
    # Public API

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block averages them all.

        Only the backward must happen inside (torch DDP also needs the forward inside).
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    @contextlib.contextmanager
    def join(self, shadow_step: Callable[[], object] | None = None) -> Iterator[None]:
        """Let ranks with different numbers of batches finish cleanly (torch's ``Join`` for DDP).

        Put the training loop inside ``with model.join():`` on every rank. A rank that leaves
        the block (out of data) shadows the others' gradient reductions with zeros until every
        rank has left, so their steps average over all ranks as usual with the finished ranks
        contributing zero (torch's default, ``divide_by_initial_world_size=True``). It costs
        the ranks still training nothing: a finished rank learns that others still train from
        the negotiation flags that travel in every bucket. At the end every rank takes the
        parameters and buffers of the rank that trained longest.

        Other collectives the ranks make once per step, after backward (say ``sync_ddp(loss)``
        for logging), need a partner too: ``shadow_step`` makes the same calls with neutral
        values (zeros for a sum, ``torch.empty(0)`` for ``gather_all_tensors``), and a finished
        rank runs it once for every step the others take. Inside the block, ranks must not run
        forwards without backward while others have finished (their buffer broadcasts would have
        no partner); debug mode (``ddpkit.diagnostics.debug``) reports any such mismatch. Comm hooks not
        declared ``elementwise_average`` (ddpkit's allreduce, fp16 and bf16 are), ``reduce_function``
        and one-argument hooks are not supported here.
        """
        self._check_join_supported()
        yield  # an exception leaves without shadowing: the job is failing anyway (see ddpkit.diagnostics.failures)
        if self._world_size > 1:
            with guard():
                self._shadow_until_all_joined(shadow_step)

    def _check_join_supported(self) -> None:
        if self._sparse:
            raise ValueError(
                f"DistributedDataParallel.join() cannot shadow the reduction of sparse gradients ({len(self._sparse)} "
                "embedding weight(s) with sparse=True). Stop every rank at the shortest one with "
                "ddpkit.even_batches(loader), or use sparse=False."
            )
        if not self._averages_elementwise or self._pre_sync_hooks:
            used = ("reduce_function" if self._reduce_function is not None else
                    "a one-argument comm hook" if self._pre_sync_hooks else
                    f"the comm hook {describe_hook(self._comm_hook)}")
            raise ValueError(
                f"DistributedDataParallel.join() cannot shadow reductions made by {used}: it supports no hook, "
                "ddpkit.hooks' allreduce_hook, fp16_compress_hook and bf16_compress_hook, and hooks declared "
                "@ddpkit.hooks.elementwise_average. For uneven data with "
                "other reductions, stop every rank at the shortest one with ddpkit.even_batches(loader)."
            )

    def _shadow_until_all_joined(self, shadow_step: Callable[[], object] | None) -> None:
        while self._shadow_step():
            if shadow_step is not None:
                shadow_step()
        steps = all_gather_object(self._step.synced_backwards, self.process_group)
        self._broadcast_state(source=steps.index(max(steps)))

    def _shadow_step(self) -> bool:
        """Take part in one reduction with zero gradients and flags; True if some rank still trains."""
        with collective_call(_SYNCHRONISATION, self.process_group):  # the same as a real backward's
            return self._reduce_zeros()

    def _reduce_zeros(self) -> bool:
        pending = []
        for bucket in self._buckets:  # the same collectives, in the same order, as a real backward
            bucket.buffer.zero_()
            pending.append((bucket, self._start_reduction(bucket, elementwise=True)))  # join checked it is
        anyone_trained = False
        for bucket, work in pending:
            self._wait_into_bucket(bucket, work)
            anyone_trained = anyone_trained or bool(bucket.flags.real.sum() > 0)
        if anyone_trained:  # mirror the rest of their step
            if self.broadcast_buffers:
                self._sync_buffers()
            if self._step.observed is not None:
                self._rebuild_buckets_in_observed_order()
        return anyone_trained

    def register_comm_hook(self, *args: Any, **kwargs: Any) -> RemovableHandle | None:
        """``register_comm_hook(hook)``: ``hook(ddp_module)`` runs before each synchronisation and
        sees the complete local gradients (so registering one turns overlap off); returns a handle.

        ``register_comm_hook(state, hook)``: torch's ``hook(state, bucket) -> Future[Tensor]``
        replaces each bucket's all-reduce; it receives a ``ddpkit.parallel.buckets.GradBucket``.
        """
        if len(args) == 1 and not kwargs:
            return self._add_pre_sync_hook(args[0])
        names = ("state", "hook")
        values = dict(zip(names, args))
        values.update(kwargs)
        if set(values) != set(names) or len(args) + len(kwargs) != 2:
            raise TypeError("register_comm_hook takes (hook) or (state, hook); got "
                            f"{len(args)} positional and keyword {sorted(kwargs)} arguments.")
        check_comm_hook(values["hook"])
        if self._comm_hook is not None:
            raise RuntimeError("A communication hook is already registered; torch allows one per module, and so does ddpkit.")
        if self._reduce_function is not None:
            raise RuntimeError("A communication hook cannot be combined with reduce_function, which replaces the whole "
                               "reduction.")
        self._comm_state, self._comm_hook = values["state"], values["hook"]
        self._averages_elementwise = is_elementwise_average(self._comm_hook)
        return None

    def _add_pre_sync_hook(self, hook: Callable[[DistributedDataParallel], None]) -> RemovableHandle:
        check_pre_sync_hook(hook)
        handle = RemovableHandle(self._pre_sync_hooks)
        self._pre_sync_hooks[handle.id] = hook
        return handle

    def _follow_membership(self, membership: Membership) -> None:
        """A new generation of the default group (``ddpkit.group``): this rank's place in it."""
        self._rank, self._world_size = membership.rank, membership.world_size
        self._scale = 1.0 / membership.world_size

    def bucket_order(self) -> tuple[list[str], bool]:
        """The launch order of the buckets, and whether it may still change after the next
        synchronised backward (it is rebuilt once, in the order gradients arrived)."""
        return list(self._launch_order), self._step.observed is not None

    def adopt_bucket_order(self, order: list[str], may_change: bool) -> None:
        """Take another rank's ``bucket_order()``: a rank that joined a running group (in-place
        recovery) must build the buckets the others built, without the first backward's rebuild."""
        self._set_launch_order(order)
        self._step = _StepState(observed=[] if may_change else None)

    def resynchronise(self, order: list[str], may_change: bool) -> None:
        """Run the collectives of construction again and build the buckets in ``order`` (see
        ``adopt_bucket_order``), with fresh buffers: the group is a new generation, where a rank that
        replaces a lost one constructs its module.

        A collective of the abandoned group may still be pending on the old buffers (its Gloo
        thread waits for a peer that will not send), so they are not reused.
        """
        self._check_same_module_everywhere(self.module)
        self._broadcast_state()
        self.adopt_bucket_order(order, may_change)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's state dict: keys have no ``module.`` prefix."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


@dataclass
class _StepState:
    """Bookkeeping of the backward in progress (and of buffers since the last sync)."""

    in_backward: bool = False
    overlap: bool = True  # launch buckets during backward
    defer_copies: bool = False  # copy gradients into buckets only at the end (pre-sync hooks change them)
    debug: bool = False  # debug mode (ddpkit.diagnostics.debug) for this backward: fingerprints before reducing
    elementwise: bool = True  # DDP divides while copying in, and the flags travel in the buffer
    next_bucket: int = 0  # buckets launch strictly in index order
    in_flight: list[tuple[Bucket, Any]] = field(default_factory=list)
    buckets_missing_grads: set[int] = field(default_factory=set)  # buckets with a parameter lacking .grad here
    buffers_stale: bool = False  # forwards ran since the last buffer broadcast
    synced_backwards: int = 0  # since construction; the rank with most joined last (see join)
    #: Names in the order their gradients arrived, during the first synchronised backward only.
    observed: list[str] | None = field(default_factory=list)

    def end_backward(self) -> None:
        self.in_backward = False
        self.next_bucket = 0
        self.in_flight = []
        self.buckets_missing_grads = set()


def _first_difference(reference: list[tuple[Any, ...]], other: list[tuple[Any, ...]], other_rank: int) -> str | None:
    """Describe the first entry, by name, that differs between rank 0's list and ``other_rank``'s."""
    mine, theirs = {entry[0]: entry for entry in reference}, {entry[0]: entry for entry in other}
    for name in sorted(set(mine) | set(theirs)):
        a, b = mine.get(name), theirs.get(name)
        if a == b:
            continue
        if a is None:
            return f"{name!r} exists on rank {other_rank} but not on rank 0"
        if b is None:
            return f"{name!r} exists on rank 0 but not on rank {other_rank}"
        message = f"{name!r} has shape {a[1]} and dtype {a[2]} on rank 0 but shape {b[1]} and dtype {b[2]} on rank {other_rank}"
        if len(a) > 3 and a[3] != b[3]:
            message += f" (requires_grad {a[3]} vs {b[3]})"
        return message
    return None


def _to_device(value: Any, device: torch.device) -> Any:
    """Move every tensor inside nested tuples, lists and dicts to ``device``."""
    if isinstance(value, Tensor):
        return value if value.device == device else value.to(device, non_blocking=True)
    if isinstance(value, tuple):
        return type(value)(*(_to_device(v, device) for v in value)) if hasattr(value, "_fields") else tuple(
            _to_device(v, device) for v in value)
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value
