"""``DistributedDataParallel``: pytorch-pfn-extras' module, with torch Reducer's overlap.

How a step goes:

The module (this file) owns the wrapped model, its checks and broadcasts at construction
(``parallel/construction.py``), forward and the public API; backward's side is its ``Reducer``
(``parallel/reducer.py``).

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
6. Under compiled autograd the hooks are traced into the backward graph, where no end-of-backward
   callback may run: each gradient is averaged there by a functional all-reduce, which inductor
   fuses into buckets (``compiled_backward.fuse_compiled_reductions``); buffers are then broadcast before
   the next forward (point 5's evaluation case). docs/ddp.md says what cannot run there.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ddpkit._allocator import keep_freed_memory
from ddpkit.comm.collective_call import collective_call
from ddpkit.diagnostics.failures import guard
from ddpkit.diagnostics.waits import run_collective
from ddpkit.hooks.contract import check_comm_hook, check_pre_sync_hook, is_elementwise_average
from ddpkit.membership.connection import distributed_available
from ddpkit.membership.group import Membership, current_group
from ddpkit.parallel.buckets import DEFAULT_CAP_BYTES
from ddpkit.parallel.compiled_backward import fuse_compiled_reductions
from ddpkit.parallel.construction import check_device, check_membership, check_same_module_everywhere, to_device
from ddpkit.parallel.join import check_join_supported, shadow_until_all_joined
from ddpkit.parallel.reducer import Reducer, TensorsFunction
from ddpkit.parallel.sparse import sparse_gradient_parameters
from ddpkit.parallel.step_overlap import OverlappedOptimizer
from ddpkit.parallel.step_state import StepState
from ddpkit.parallel.step_timings import StepTimings

__all__ = ["DistributedDataParallel"]

ProcessGroup = Any

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

    ``overlap_optimizer`` (an optimizer over this module's parameters, off by default): the
    gradients' averaging goes on into the next forward, and ``optimizer.step()`` updates each
    module's parameters just before that module's forward, as its bucket lands; the result is bit
    for bit that of the same run without it (``ddpkit.parallel.step_overlap`` says what it takes:
    per-parameter optimizers, no ``join``, ``settle()`` before reading gradients).

    Example::

        >>> import torch, ddpkit
        >>> from ddpkit.hooks.default import fp16_compress_hook
        >>> ddpkit.init_dist_connection(ddpkit.detect_environment())
        >>> model = ddpkit.DistributedDataParallel(torch.nn.Linear(4, 2))
        >>> model.register_comm_hook(None, fp16_compress_hook)  # optional: half the bytes on the wire
        >>> model(torch.ones(3, 4)).sum().backward()  # .grad holds the average over the ranks
        >>> model.module.weight.grad
        tensor([[3., 3., 3., 3.],
                [3., 3., 3., 3.]])
        >>> ddpkit.destroy_dist_connection()
    """

    def __init__(
        self,
        module: nn.Module,
        broadcast_buffers: bool = True,
        negotiate_grads: bool = True,
        process_group: ProcessGroup = None,
        reduce_function: TensorsFunction | None = None,
        broadcast_function: TensorsFunction | None = None,
        overlap_optimizer: torch.optim.Optimizer | None = None,
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
        self._optimizer_timed = False  # time_optimizer was called: timings() splits the optimizer step off
        self._reduce_function = reduce_function
        self._broadcast_function = broadcast_function
        self._rank, self._world_size = check_membership(process_group)
        self.device = check_device(module, kwargs.get("device_ids"))
        # Gradients and activations freed and reallocated every step stay in the process instead of
        # being page-faulted in again (ddpkit._allocator); ddpkit run's workers have it already.
        keep_freed_memory()

        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                f"{type(module).__name__} has no parameters that require grad, so there is nothing to synchronise. "
                "Wrap the module you train (or set requires_grad=True on its parameters)."
            )
        launch_order = check_same_module_everywhere(module, process_group)
        self._broadcast_state()
        self._reducer = self._make_reducer(dict(named), launch_order, kwargs.get("bucket_cap_mb"))
        group = current_group() if process_group is None else None
        if group is not None:  # the default group, which in-place recovery forms again
            group.on_reconfigure(self._follow_membership)
            if group.membership.weight is not None:  # a replacement in a world that shrank
                self._reducer.follow(self._rank, self._world_size, group.membership.weight)
        # (submodule, name) of every buffer: read afresh each sync, so reassigned buffers are seen,
        # without walking the module tree every step.
        self._buffer_slots = [(owner, name) for _, owner in module.named_modules()
                              for name, buffer in owner._buffers.items() if buffer is not None]
        if overlap_optimizer is not None:
            self.overlap_with(overlap_optimizer)

    def overlap_with(self, optimizer: torch.optim.Optimizer) -> None:
        """``overlap_optimizer=optimizer`` for an optimizer made after the model was wrapped (as
        Lightning's Trainer makes it): its step deferred to the next forward, bucket by bucket
        (``ddpkit.parallel.step_overlap``). One optimizer per model."""
        if self._reduce_function is not None:
            raise ValueError("overlap_optimizer cannot be combined with reduce_function, which reduces every gradient "
                             "after backward: leave one of them out.")
        if self._reducer.overlapped is not None:
            raise ValueError(f"overlap_optimizer: this model's steps are deferred for "
                             f"{type(self._reducer.overlapped.optimizer).__name__} already, and one optimizer per model "
                             f"can be; {type(optimizer).__name__} was given too. Give the mode one optimizer over "
                             "all of the model's parameters.")
        # Only parameters reduced in buckets (not sparse ones, averaged apart) may be the optimizer's.
        bucketed = [p for p in self.module.parameters() if id(p) in self._reducer.bucket_of]
        overlapped = OverlappedOptimizer(optimizer, self.module, bucketed, self._reducer.held,
                                         self._reducer.settle_held, lambda: self._reducer.bucket_of)
        # Under in-place recovery a rank lost while a step is half applied leaves the others to go
        # back to the state before it (``abandon_deferred_step``), as a synchronous step is never half done.
        group = current_group() if self.process_group is None else None
        overlapped.keep_undo = group is not None and group.survivors_go_on
        self._reducer.overlapped = overlapped

    def _make_reducer(self, trainable: dict[str, nn.Parameter], launch_order: list[str],
                      bucket_cap_mb: float | str | None) -> Reducer:
        # Embeddings with sparse=True get sparse gradients: averaged as sparse tensors after the
        # dense buckets (ddpkit.parallel.sparse), in the group's first rank's order, never put in a bucket.
        sparse_ids = sparse_gradient_parameters(self.module)
        return Reducer(
            self, self._sync_buffers, trainable={name: p for name, p in trainable.items() if id(p) not in sparse_ids},
            sparse=[trainable[name] for name in launch_order if name in trainable and id(trainable[name]) in sparse_ids],
            launch_order=launch_order,
            bucket_cap=DEFAULT_CAP_BYTES if bucket_cap_mb is None else int(float(bucket_cap_mb) * 1024 * 1024),
            process_group=self.process_group, rank=self._rank, world_size=self._world_size,
            gradient_as_bucket_view=self.gradient_as_bucket_view, reduce_function=self._reduce_function)

    # -----------------------------------------------------------------------------------------
    # Broadcasts

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


    # -----------------------------------------------------------------------------------------
    # Forward

    # Under torch.compile(ddp_model), only the wrapped module is compiled: this frame runs as
    # written, so guard() still sees an error raised inside the compiled module and publishes it
    # (traced into the graph, its except clause would never run and peers would wait for the timeout).
    @torch.compiler.disable(recursive=False)  # type: ignore[untyped-decorator]  # torch's decorator is unannotated
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Everything stays in this one frame: with recursive=False, Dynamo compiles the frames it calls.
        clock, started = self._reducer.clock, time.perf_counter()
        awaited_before = clock.awaited_seconds
        if clock.first_forward is None and torch.is_grad_enabled():  # an evaluation's forward is no step's
            clock.first_forward = started
        with guard():  # an error here is published to the other ranks (see ddpkit.diagnostics.failures)
            if self.broadcast_buffers and self._reducer.step.buffers_stale:
                self._sync_buffers()  # forwards without backward (evaluation) since the last sync
            self._reducer.step.buffers_stale = True
            if not self._reducer.compiled_reductions_fused:
                self._reducer.compiled_reductions_fused = fuse_compiled_reductions(self._reducer.bucket_cap)
            if self.device.type != "cpu":
                args, kwargs = to_device((args, kwargs), self.device)
            overlapped = self._reducer.overlapped
            pending = overlapped.backwards if overlapped is not None and overlapped.held else None
            output = self.module(*args, **kwargs)
            # What the forward did not reach of the step pending when it began (overlap_optimizer). A
            # step asked for inside it (a backward and step in the wrapped module's forward, as in
            # Lightning's manual optimization) is the next forward's to apply.
            if overlapped is not None and overlapped.backwards == pending:  # None: nothing was pending
                overlapped.settle_all()
        if clock.first_forward is not None:
            # Waits for the last step's reductions (overlap_optimizer) are communication, not forward.
            waited = clock.awaited_seconds - awaited_before
            clock.forward_seconds += time.perf_counter() - started - waited
            clock.forward_waits += waited
        return output

    def _sync_buffers(self) -> None:
        if self._buffer_slots:
            self._broadcast([getattr(owner, name) for owner, name in self._buffer_slots])
        self._reducer.step.buffers_stale = False

    # -----------------------------------------------------------------------------------------
    # Backward


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

    def settle(self) -> None:
        """With ``overlap_optimizer``: wait for every gradient of the last backward and apply the
        optimizer step (and ``zero_grad``) if it was asked for, now rather than during the next
        forward. Call it before reading gradients (``clip_grad_norm_``, a ``GradScaler``) or, after
        ``optimizer.step()``, parameters outside a forward. Without the mode it does nothing."""
        if self._reducer.overlapped is not None:
            with guard():
                self._reducer.overlapped.settle_all()

    @property
    def step_deferred(self) -> bool:
        """Whether ``optimizer.step()`` was called and its step is not applied yet (``overlap_optimizer``)."""
        overlapped = self._reducer.overlapped
        return overlapped is not None and overlapped.requested is not None

    def when_step_applied(self, callback: Callable[[], None]) -> None:
        """With ``overlap_optimizer``: call ``callback`` each time a deferred step has been applied to
        every parameter (without the mode a step is applied when it is called: never called)."""
        if self._reducer.overlapped is not None:
            self._reducer.overlapped.when_applied(callback)

    def abandon_deferred_step(self) -> None:
        """With ``overlap_optimizer``, for an in-place recovery: forget the reductions in flight and
        the step not yet applied, and put the parameters and the optimizer's state back as they were
        before it (``OverlappedOptimizer.roll_back``)."""
        if self._reducer.overlapped is not None:
            self._reducer.overlapped.roll_back()

    def timings(self, last: int | None = None) -> StepTimings:
        """Where this rank's last steps went, phase by phase (``ddpkit.parallel.step_timings``): medians
        over the last ``last`` steps (up to 100 are kept). Compare them across ranks to find a slow
        one: its own ``forward``/``backward`` are longer, and the others wait for it in
        ``communication``. ``optimizer``/``data`` once ``time_optimizer`` was called."""
        return self._reducer.clock.timings(last, optimizer_timed=self._optimizer_timed)

    def time_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Time ``optimizer``'s steps as a phase of their own (``DDPStrategy.setup`` does it)."""
        clock = self._reducer.clock
        optimizer.register_step_pre_hook(lambda *_: clock.optimizer_started())
        optimizer.register_step_post_hook(lambda *_: clock.optimizer_ended())
        self._optimizer_timed = True

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
        if self._reducer.overlapped is not None:
            raise ValueError("join() does not work with overlap_optimizer yet: a finished rank would shadow reductions "
                             "the others still hold. Leave overlap_optimizer off for uneven inputs.")
        check_join_supported(self._reducer, self._reduce_function is not None)
        self._reducer.joining = True
        try:
            yield  # an exception leaves without shadowing: the job is failing anyway (see ddpkit.diagnostics.failures)
        finally:
            self._reducer.joining = False
        if self._world_size > 1:
            with guard():
                shadow_until_all_joined(self._reducer, self.process_group, shadow_step,
                                        lambda source: self._broadcast_state(source=source))

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
        if self._reducer.comm_hook is not None:
            raise RuntimeError("A communication hook is already registered; torch allows one per module, and so does ddpkit.")
        if self._reduce_function is not None:
            raise RuntimeError("A communication hook cannot be combined with reduce_function, which replaces the whole "
                               "reduction.")
        self._reducer.use_comm_hook(values["state"], values["hook"], is_elementwise_average(values["hook"]))
        return None

    def _add_pre_sync_hook(self, hook: Callable[[DistributedDataParallel], None]) -> RemovableHandle:
        check_pre_sync_hook(hook)
        handle = RemovableHandle(self._reducer.pre_sync_hooks)
        self._reducer.pre_sync_hooks[handle.id] = hook
        return handle

    def _follow_membership(self, membership: Membership) -> None:
        """A new generation of the default group (``ddpkit.membership.group``): this rank's place in it."""
        self._rank, self._world_size = membership.rank, membership.world_size
        # A rank that trains lost ranks' shares too counts for them (``ddpkit.membership.group``).
        self._reducer.follow(membership.rank, membership.world_size, membership.weight)
        self._reducer.held.drop()  # the old group's reductions never land

    def bucket_order(self) -> tuple[list[str], bool]:
        """The launch order of the buckets, and whether it may still change after the next
        synchronised backward (it is rebuilt once, in the order gradients arrived)."""
        return list(self._reducer.launch_order), self._reducer.step.observed is not None

    def adopt_bucket_order(self, order: list[str], may_change: bool) -> None:
        """Take another rank's ``bucket_order()``: a rank that joined a running group (in-place
        recovery) must build the buckets the others built, without the first backward's rebuild."""
        # With overlap_optimizer the launch order depends on the wire's measure, which the rank that
        # joined has not taken: every rank measures again (its first synchronised backwards are synchronous).
        self._reducer.sent_during_backward = None
        self._reducer.set_launch_order(order)
        self._reducer.step = StepState(observed=[] if may_change else None)

    def resynchronise(self, order: list[str], may_change: bool) -> None:
        """Run the collectives of construction again and build the buckets in ``order`` (see
        ``adopt_bucket_order``), with fresh buffers: the group is a new generation, where a rank that
        replaces a lost one constructs its module.

        A collective of the abandoned group may still be pending on the old buffers (its Gloo
        thread waits for a peer that will not send), so they are not reused.
        """
        check_same_module_everywhere(self.module, self.process_group)
        self._broadcast_state()
        self.adopt_bucket_order(order, may_change)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's state dict: keys have no ``module.`` prefix."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


