"""The optimizer step overlapped with the next forward: ``DistributedDataParallel(module,
overlap_optimizer=optimizer)`` (issue 48, item 2).

Every synchronous DDP waits for all of its buckets at the end of backward, so a step is never
shorter than the forward plus the all-reduce. In this mode the end of backward launches the
buckets and returns at once (``Reducer.hold``). ``optimizer.step()`` and ``optimizer.zero_grad()``
only note that they were asked for, with the step's hyperparameters as they are then (an LR
scheduler stepped afterwards changes the next step, not this one). Each module's next forward
starts with a pre-hook that waits for the buckets of that module's own parameters, copies their
gradients back and updates those parameters alone with the noted step; what the forward did not
reach is finished when it returns. The wire therefore goes on sending the later layers'
gradients while the first layers compute, and the buckets are launched in the order the next
forward needs them once backward has ended (``Reducer.launch_sequence``).

The result is bit for bit that of the same run without the mode: the same buckets are summed the
same way, and the optimizers taken here (``PER_PARAMETER``) update each parameter from its own
gradient and state alone, so a step over one bucket's parameters at a time does what one step
over all of them does (their foreach and fused kernels work tensor by tensor on CPU as well).

What reads gradients between backward and ``optimizer.step()`` (``clip_grad_norm_``, a
``GradScaler``'s unscale and inf check, a gradient's norm for logging) would read them before
they are averaged, and what reads parameters between ``optimizer.step()`` and the next forward (an
EMA of the weights) would read them before the step. Such a read raises, naming the call
(``ddpkit.parallel.stand_ins``). ``DistributedDataParallel.settle()`` first waits for every bucket
and applies the step (that step is then not overlapped) and makes the read right.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.optim.optimizer as optimizer_module
from torch import Tensor, nn

from ddpkit.parallel.buckets import Bucket
from ddpkit.parallel.copy_back import settle_bucket
from ddpkit.parallel.stand_ins import GradientChange, NotYetReduced, hold_parameters, release_parameters, stand_in

__all__ = ["PER_PARAMETER", "HeldReductions", "OverlappedOptimizer", "launch_sequence"]

#: The optimizers whose step updates each parameter from its own gradient and state alone.
PER_PARAMETER: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adadelta,
)

class HeldReductions:
    """The reductions a backward left for the next forward (``Reducer``, in this mode), by bucket
    index, and the gradients their stand-ins replaced.

    The buckets launched during backward are in flight. The rest (``queued``: the first layers',
    complete at the end of backward) are launched one at a time, in the launch sequence's order:
    the next when the one before is settled. Gloo runs a group's reductions on several threads at
    once, so buckets launched together share the wire and land together, the first layer's no
    sooner than the last; one at a time, each lands in the order the forward needs them. Every
    launch happens at the same point of the program on every rank (a settle, in forward order),
    so the ranks' collectives match.
    """

    def __init__(self) -> None:
        self._pending: dict[int, tuple[Bucket, Any, bool]] = {}  # index: (bucket, its work or None: queued, read flags)
        self._gradients: dict[int, list[Tensor | None]] = {}  # index: each parameter's .grad before its stand-in
        self._stand_ins: dict[int, list[Tensor | None]] = {}  # index: each parameter's stand-in (None: no .grad)
        self._queued: list[Bucket] = []
        self._launched_from_queue: set[int] = set()  # launched from the queue and not settled yet
        self._start: Callable[[Bucket], Any] = lambda bucket: None

    def __bool__(self) -> bool:
        return bool(self._pending)

    def hold(self, in_flight: list[tuple[Bucket, Any]], queued: list[Bucket], read_flags: set[int],
             start: Callable[[Bucket], Any]) -> None:
        """Hold ``in_flight`` and ``queued`` (prepared, not launched); ``start`` launches one."""
        self._queued, self._start = list(queued), start
        for bucket, pending in [*in_flight, *((bucket, None) for bucket in queued)]:
            self._pending[bucket.index] = (bucket, pending, bucket.index in read_flags)
            self._gradients[bucket.index] = [p.grad for p in bucket.parameters]
            for parameter in bucket.parameters:
                if parameter.grad is not None:
                    parameter.grad = stand_in(parameter.grad)
            self._stand_ins[bucket.index] = [p.grad for p in bucket.parameters]
        self._launch_next()

    def _launch_next(self) -> None:
        if self._queued:
            bucket = self._queued.pop(0)
            _, _, read_flags = self._pending[bucket.index]
            self._pending[bucket.index] = (bucket, self._start(bucket), read_flags)
            self._launched_from_queue.add(bucket.index)

    def parameters(self) -> dict[int, list[nn.Parameter]]:
        """The parameters of each held bucket, by index."""
        return {index: bucket.parameters for index, (bucket, _, _) in self._pending.items()}

    def changes(self) -> dict[int, GradientChange]:
        """What the user's code did so far to the held parameters' stand-ins, by parameter id."""
        found: dict[int, GradientChange] = {}
        for index in self._pending:
            found.update(self._changes_of(index))
        return found

    def _changes_of(self, index: int) -> dict[int, GradientChange]:
        found = {}
        for parameter, standing in zip(self._pending[index][0].parameters, self._stand_ins[index]):
            current = parameter.grad
            if current is not standing:
                found[id(parameter)] = GradientChange(parameter, False, current)
            elif isinstance(standing, NotYetReduced) and standing.zeroed:
                found[id(parameter)] = GradientChange(parameter, True)
        return found

    def settle(self, index: int, as_view: bool, wait_into_bucket: Callable[[Bucket, Any], None]
               ) -> dict[int, GradientChange] | None:
        """Wait for bucket ``index``'s reduction and copy its gradients back; what the user's code
        did to their stand-ins meanwhile (to be done again after the step); None if none was held."""
        if index not in self._pending:
            return None
        while self._pending[index][1] is None:  # still queued: launched now, with those before it
            self._launch_next()
        bucket, pending, read_flags = self._pending[index]
        changes = self._changes_of(index)
        self._release(index)
        settle_bucket(bucket, pending, as_view, read_flags, wait_into_bucket)
        self._launched_from_queue.discard(index)
        if not self._launched_from_queue:
            self._launch_next()
        return changes

    def drop(self) -> None:
        """Forget what is held (the group was formed again: those reductions will never land)."""
        self._queued, self._launched_from_queue = [], set()
        for index in list(self._pending):
            self._release(index)

    def _release(self, index: int) -> None:
        """Stop holding bucket ``index``: its parameters get their gradients back, for their stand-ins."""
        bucket, _, _ = self._pending.pop(index)
        del self._stand_ins[index]
        for parameter, gradient in zip(bucket.parameters, self._gradients.pop(index)):
            parameter.grad = gradient


class OverlappedOptimizer:
    """The user's optimizer, its ``step`` and ``zero_grad`` deferred to the next forward.

    ``held`` is the reducer's; ``settle_held(index)`` waits for one held bucket's reduction and
    copies its gradients back (the reducer's, through ``held``); ``bucket_of`` maps a parameter's
    id to its bucket's index and is read afresh, since the buckets are laid out again after the
    first step.

    What the user's code does to ``.grad`` after the step is asked for (``Module.zero_grad()``, the
    module's and not the optimizer's, or ``p.grad = None``) is done again after the deferred step
    has used the gradient; what it did before, the step sees, as without the mode.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module, parameters: Iterable[Tensor],
                 held: HeldReductions, settle_held: Callable[[int], dict[int, GradientChange] | None],
                 bucket_of: Callable[[], dict[int, int]]) -> None:
        check_optimizer(optimizer, parameters)
        self.optimizer = optimizer
        self._held = held
        self._settle_held = settle_held
        self._bucket_of = bucket_of
        self._step = optimizer.step  # as it is now: a scheduler's wrapper made before stays inside
        self._zero_grad = optimizer.zero_grad
        #: The step asked for since the last backward: each group's hyperparameters then; None: not asked.
        self.requested: list[dict[str, Any]] | None = None
        self.zero_requested: bool | None = None  # zero_grad asked for after the step: its set_to_none
        self._changed_before_step: dict[int, GradientChange] = {}  # by the user's code, when the step was asked for
        self._guarded: dict[int, list[Tensor]] = {}  # by bucket: HeldParameters until their step is applied
        self.held = False  # a backward's reductions are in flight, their gradients stand-ins
        self.backwards = 0  # backwards held so far: which backward's step ``held`` is about
        self._done: set[int] = set()  # buckets settled (and stepped) since the last backward
        #: Keep what each bucket's step overwrites until the whole step is applied (in-place recovery:
        #: ``roll_back`` then returns to the state before a step a lost rank left half applied).
        self.keep_undo = False
        self._undo: list[tuple[Tensor, Tensor, dict[str, Any] | None]] = []  # (parameter, values, optimizer state)
        self._when_applied: list[Callable[[], None]] = []
        # Methods of the optimizer itself: an LR scheduler rebinds optimizer.step's function to the optimizer.
        def step(_: torch.optim.Optimizer, closure: Callable[[], float] | None = None) -> float | None:
            return self.step(closure)
        if getattr(self._step, "_wrapped_by_lr_sched", False):
            # A schedule made before the wrapper looks for its mark on optimizer.step at its first step
            # (else it warns that the step was overridden); its own wrapper is inside self._step.
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
        optimizer.zero_grad = types.MethodType(  # type: ignore[method-assign]
            lambda _, set_to_none=True: self.zero_grad(set_to_none), optimizer)
        optimizer.register_state_dict_pre_hook(lambda _: self.settle_all())
        optimizer.register_load_state_dict_pre_hook(lambda *_: self.settle_all())
        # Each module that owns parameters: its forward applies their step first; a checkpoint of it
        # (the wrapper's, or a framework's of the module inside it) holds the step, and one loaded
        # into it is not overwritten by the step.
        owners = [owner for owner in module.modules() if any(True for _ in owner.parameters(recurse=False))]
        self._hooks = [owner.register_forward_pre_hook(self._pre_forward(owner)) for owner in owners]
        for owner in owners:
            owner.register_state_dict_pre_hook(lambda *_: self.settle_all())
            owner.register_load_state_dict_pre_hook(lambda *_: self.settle_all())

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if closure is not None:
            # Every optimizer the mode takes calls its closure once, first, with gradients enabled,
            # and then steps on the gradients it left (LBFGS, which calls it again, is refused):
            # so the closure (Lightning's: forward, zero_grad, backward) runs now, and the step on
            # its gradients is deferred as a step without one would be.
            with torch.enable_grad():
                loss = closure()
            self.step()
            return loss
        if not self.held:
            self.settle_all()
            return self._step()
        if self.requested is not None:  # a second step on the same gradients: the first goes first
            self.settle_all()
            return self._step()
        # The step's hooks run once, here, as the step is asked for: a pre-hook that sets the lr sets
        # this step's, and what a hook reads (gradients, parameters) raises until it has landed.
        for pre_hook in [*optimizer_module._global_optimizer_pre_hooks.values(),
                         *self.optimizer._optimizer_step_pre_hooks.values()]:
            if pre_hook(self.optimizer, (self.optimizer,), {}) is not None:
                raise ValueError(f"overlap_optimizer: the optimizer step pre-hook {_named(pre_hook)} returned new "
                                 "arguments for step(), which the deferred step cannot take. Leave overlap_optimizer "
                                 "off, or make the hook return None.")
        self._request()
        for post_hook in [*self.optimizer._optimizer_step_post_hooks.values(),
                          *optimizer_module._global_optimizer_post_hooks.values()]:
            post_hook(self.optimizer, (self.optimizer,), {})
        return None

    def _request(self) -> None:
        """Note the step, with its hyperparameters as they are now, and guard the held parameters."""
        self._changed_before_step = self._held.changes()
        self.requested = [{key: value.clone() if isinstance(value, Tensor) else value
                           for key, value in group.items() if key != "params"}
                          for group in self.optimizer.param_groups]
        # A parameter in no bucket with a gradient (one frozen at wrapping and unfrozen since: its
        # gradient is this rank's own, as without the mode) is stepped now; it waits for nothing.
        bucket_of = self._bucket_of()
        if any(id(p) not in bucket_of and p.grad is not None for group in self.optimizer.param_groups
               for p in group["params"]):
            with self._only(lambda p: id(p) not in bucket_of, self.requested), _without_step_hooks(self.optimizer):
                self._step()
        # Until the forward applies the step, reading them would read them as they were before it.
        self._guarded = {index: hold_parameters(parameters) for index, parameters in self._held.parameters().items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.held and self.requested is not None:
            self.zero_requested = set_to_none
            bucket_of = self._bucket_of()  # the parameters in no bucket were stepped already (step)
            with self._only(lambda p: id(p) not in bucket_of, self.requested):
                self._zero_grad(set_to_none)
            return
        self.settle_all()
        self._zero_grad(set_to_none)

    def backward_held(self) -> None:
        """The reducer's end of a backward: its buckets are in flight, their gradients stand-ins."""
        self.held, self._done = True, set()
        self.backwards += 1

    def _pre_forward(self, owner: nn.Module) -> Callable[..., None]:
        def settle_own_parameters(_module: nn.Module, _args: Any) -> None:
            if self.held:
                bucket_of = self._bucket_of()
                for parameter in owner.parameters(recurse=False):
                    index = bucket_of.get(id(parameter))
                    if index is not None and index not in self._done:
                        self._finish(index)
        return settle_own_parameters

    def settle_all(self) -> None:
        """Every bucket waited for, and the step and zero_grad asked for applied (the forward's end,
        ``DistributedDataParallel.settle``, a state_dict)."""
        if not self.held:
            return
        for index in sorted(set(self._bucket_of().values())):
            if index not in self._done:
                self._finish(index)
        applied = self.requested is not None
        self._forget_step()
        if applied:
            for callback in self._when_applied:
                callback()

    def when_applied(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` each time a deferred step has been applied to every bucket."""
        self._when_applied.append(callback)

    def roll_back(self) -> None:
        """Forget the step asked for and what was held, and put back what the buckets' steps applied
        so far overwrote (``keep_undo``): the parameters, the optimizer's state and its
        hyperparameters are those from before the step, as when it was asked for. For a recovery,
        whose group was formed again: the held reductions will never land."""
        if self.requested is not None:  # a schedule stepped after optimizer.step() set the next step's
            for group, hyperparameters in zip(self.optimizer.param_groups, self.requested):
                group.update(hyperparameters)
        with torch.no_grad():  # the buckets stepped already: their guards were released by _finish
            for parameter, values, state in reversed(self._undo):
                parameter.copy_(values)
                if state is None:
                    self.optimizer.state.pop(parameter, None)
                else:
                    self.optimizer.state[parameter] = state
        self._held.drop()
        self._forget_step()
        self._done = set()

    def _forget_step(self) -> None:
        """No step is pending any more: the guards left (buckets never stepped) released, the undo
        copies dropped."""
        for parameters in self._guarded.values():
            release_parameters(parameters)
        self._guarded, self._undo = {}, []
        self.held, self.requested, self.zero_requested = False, None, None

    def _finish(self, index: int) -> None:
        self._done.add(index)
        release_parameters(self._guarded.pop(index, ()))
        changes = self._settle_held(index)
        if changes is None:
            return  # nothing was held for it
        if self.requested is None:  # no step asked for: .grad is what the user's code left in it
            for change in changes.values():
                change.apply()
            return
        bucket_of = self._bucket_of()
        for parameter_id, change in self._changed_before_step.items():
            if bucket_of.get(parameter_id) == index:
                change.apply()  # the step uses what the user's code left in .grad before asking for it
        with self._only(lambda p: bucket_of.get(id(p)) == index, self.requested):
            if self.keep_undo:
                self._keep_undo()
            with _without_step_hooks(self.optimizer):
                self._step()
            for change in changes.values():
                change.apply()  # what it did after asking, once the step has used the gradient
            if self.zero_requested is not None:
                self._zero_grad(self.zero_requested)

    def _keep_undo(self) -> None:
        """Copy what the step over the optimizer's (narrowed) groups will overwrite: their
        parameters and their optimizer state."""
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            for parameter in group["params"]:
                kept = state.get(parameter)
                self._undo.append((parameter, parameter.detach().clone(), None if kept is None else {
                    key: value.clone() if isinstance(value, Tensor) else value for key, value in kept.items()}))

    @contextlib.contextmanager
    def _only(self, chosen: Callable[[Tensor], bool], hyperparameters: list[dict[str, Any]]) -> Iterator[None]:
        """The optimizer's groups narrowed to the ``chosen`` parameters, with ``hyperparameters``
        (one dict a group), while the block runs: its own step and zero_grad then touch those alone."""
        groups = [{**hyper, "params": [p for p in group["params"] if chosen(p)]}
                  for hyper, group in zip(hyperparameters, self.optimizer.param_groups)]
        original = self.optimizer.param_groups
        self.optimizer.param_groups = [group for group in groups if group["params"]]
        try:
            yield
        finally:
            self.optimizer.param_groups = original


def launch_sequence(count: int, sent_during_backward: float | None) -> tuple[list[int], int]:
    """The order in which ``count`` buckets are launched (bucket 0 holds the gradients backward
    produces first, the last layers'), the same on every rank (collectives must match), and where
    in it the buckets launched after backward begin (``HeldReductions``: one at a time).

    Without ``sent_during_backward``, by index, all during backward. With it (the share of the
    wire's work that backward's own time covers, ``StepState.wire_measure``): bucket 0 and as
    many more as the wire sends while backward runs; then the rest from the last, which holds the
    first layers the next forward needs first. Bucket 1 goes last of all: the step's wire is then
    done when the forward reaches the next-to-last layer, and the next backward launches bucket 0
    soon after; a first layer's bucket landing last would leave the wire idle through most of
    the forward.
    """
    if sent_during_backward is None or count < 3:
        return list(range(count)), count
    during = min(count - 1, max(1, math.ceil(sent_during_backward * count)))
    return [0, *range(2, during + 1), *range(count - 1, during, -1), 1], during


@contextlib.contextmanager
def _without_step_hooks(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """The optimizer's step hooks, and torch's global ones, left out while the block runs: a
    deferred step over one bucket is part of a step whose hooks ran when it was asked for."""
    own = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
    global_hooks = optimizer_module._global_optimizer_pre_hooks, optimizer_module._global_optimizer_post_hooks
    optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
    optimizer_module._global_optimizer_pre_hooks, optimizer_module._global_optimizer_post_hooks = (
        OrderedDict(), OrderedDict())
    try:
        yield
    finally:
        optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = own
        optimizer_module._global_optimizer_pre_hooks, optimizer_module._global_optimizer_post_hooks = global_hooks


def _named(hook: Callable[..., Any]) -> str:
    return getattr(hook, "__qualname__", repr(hook))


def check_optimizer(optimizer: object, parameters: Iterable[Tensor]) -> None:
    """Refuse, naming why, an optimizer this mode cannot split by buckets."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"overlap_optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    if type(optimizer) not in PER_PARAMETER:
        raise ValueError(
            f"overlap_optimizer: {type(optimizer).__name__} is not one of the optimizers known to update each "
            f"parameter from its own gradient alone ({', '.join(kind.__name__ for kind in PER_PARAMETER)}), so "
            "updating a bucket's parameters as its gradients land may differ from one step over all of them "
            "(LBFGS needs every gradient and a closure). Leave overlap_optimizer off for it."
        )
    own = {id(p) for p in parameters}
    # A frozen parameter has no gradient, so no step: only trainable ones must be the wrapper's.
    foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in own and p.requires_grad)
    if foreign:
        raise ValueError(f"overlap_optimizer: {foreign} of the optimizer's parameters are not parameters of the wrapped "
                         "module that DistributedDataParallel reduces in buckets (frozen, sparse, or another "
                         "model's). Give it an optimizer over this module's trainable parameters only.")
