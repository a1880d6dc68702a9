"""PowerSGD gradient compression (Vogels, Karimireddy, Jaggi, NeurIPS 2019) as a DDP comm hook.

    state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
    ddpkit.register_ddp_comm_hook(model, ddp_comm_state=state, ddp_comm_hook=powerSGD_hook)

For the first ``start_powerSGD_iter`` iterations the hook averages with a plain all-reduce.
Then each gradient reshaped to a matrix M (n x m) is replaced by a rank-r approximation:
P = M Q is summed over ranks and orthogonalised, Q = M^T P is summed, and every rank takes
P Q^T / world_size. With error feedback, what the approximation missed is added to the next
step's gradient; with warm start, Q carries over between steps. Tensors whose compression
would not pay, ``(n + m) * r * min_compression_rate >= n * m`` (vectors, small matrices),
are averaged uncompressed, in the same message as P.

Where ddpkit differs from torch's ``powerSGD_hook``:

- Any number of buckets works on Gloo. Each bucket's two collectives (the uncompressed rest
  with P, then Q) are issued in order inside the hook, which DDP calls in bucket order on every rank;
  torch chains them in future callbacks, whose order can differ between ranks (it aborts with
  "Received data size doesn't match expected size" on Gloo with more than one bucket). The
  messages are small, so waiting for them costs a few round trips per bucket.
- Error-feedback and warm-start state is kept per parameter, not per bucket index, so it
  survives a change of bucketing, and by *name* where names are known, so ``state_dict()``
  can save it. ddpkit's module gives the names; for torch's, ``register_ddp_comm_hook`` calls
  ``state.name_parameters(module)``. Registered with torch's own
  ``model.register_comm_hook(state, powerSGD_hook)`` (a drop-in for torch's hook) it keys the
  memory by parameter identity instead; only ``state_dict()`` then needs
  ``state.name_parameters(model.module)`` first, and says so.
- ``compression_stats()`` reports the bytes actually sent in the last iteration.
"""

import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

# torch.distributed.GradBucket itself (the stubs do not re-export it), so torch's DDP accepts the annotation.
from torch._C._distributed_c10d import GradBucket

from ddpkit.comm.collective_call import collective_call
from ddpkit.diagnostics.waits import run_collective
from ddpkit.hooks.contract import GradBucket as DdpkitGradBucket
from ddpkit.hooks.default import allreduce_hook

__all__ = ["PowerSGDState", "powerSGD_hook"]


class PowerSGDState:
    """Configuration and per-parameter memory of ``powerSGD_hook`` (torch's arguments)."""

    def __init__(
        self,
        process_group: Any,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
    ) -> None:
        if matrix_approximation_rank < 1:
            raise ValueError(f"matrix_approximation_rank={matrix_approximation_rank} must be at least 1.")
        if start_powerSGD_iter < 1 and use_error_feedback:
            raise ValueError(
                f"start_powerSGD_iter={start_powerSGD_iter} with error feedback: the first step must be a plain "
                "all-reduce (DDP checks parameters then). Use start_powerSGD_iter >= 1."
            )
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.random_seed = random_seed
        self.iter = 0
        # Keyed by parameter name, or by _identity_key(parameter) while names are unknown.
        self.error: dict[str, Tensor] = {}  # what the approximation missed
        self.q: dict[str, Tensor] = {}  # warm-start Q
        self._names: dict[int, str] = {}
        self._step = _Stats()
        self._last = _Stats()

    def name_parameters(self, module: nn.Module) -> None:
        """Record parameter names for buckets that do not carry them (torch's GradBucket); memory
        kept so far by parameter identity is renamed."""
        self._names = {id(parameter): name for name, parameter in module.named_parameters()}
        renames = {_identity_key(parameter): name for name, parameter in module.named_parameters()}
        for memory in (self.error, self.q):
            for key in [key for key in memory if key in renames]:
                memory[renames[key]] = memory.pop(key)

    def compression_stats(self) -> dict[str, float]:
        """Bytes of the last completed iteration: sent, and what plain all-reduce would send."""
        return self._last.as_dict()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: iteration, error feedback and warm-start matrices by name."""
        unnamed = sum(key.startswith(_UNNAMED) for key in (*self.error, *self.q))
        if unnamed:
            raise ValueError(
                f"PowerSGDState holds memory for {unnamed} parameter(s) known only by identity (the hook was "
                "registered on torch's DDP without names), which another process could not match. Call "
                "state.name_parameters(model.module) once, then state_dict()."
            )
        return {"iter": self.iter, "error": {k: v.clone() for k, v in self.error.items()},
                "q": {k: v.clone() for k, v in self.q.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iter = int(state["iter"])
        self.error = {k: v.clone() for k, v in state["error"].items()}
        self.q = {k: v.clone() for k, v in state["q"].items()}

    def _parameter_keys(self, bucket: Any) -> list[tuple[str, str]]:
        """(memory key, seed label) of each parameter of the bucket. The label seeds Q and must be
        the same on every rank: the name, or for an unnamed parameter its place in the bucket
        (buckets are identical on every rank)."""
        if isinstance(bucket, DdpkitGradBucket):
            return [(name, name) for name in bucket.parameter_names()]
        keys = []
        for slot, parameter in enumerate(bucket.parameters()):
            name = self._names.get(id(parameter))
            keys.append((name, name) if name is not None else
                        (_identity_key(parameter), f"bucket {bucket.index()} slot {slot}"))
        return keys


_UNNAMED = "<unnamed>"


def _identity_key(parameter: Tensor) -> str:
    return f"{_UNNAMED}{id(parameter)}"


class _Stats:
    def __init__(self) -> None:
        self.sent = 0
        self.full = 0
        self.compressed = 0
        self.uncompressed = 0

    def as_dict(self) -> dict[str, float]:
        rate = self.full / self.sent if self.sent else 0.0
        return {"bytes_sent": self.sent, "bytes_uncompressed": self.full, "compression_rate": rate,
                "compressed_tensors": self.compressed, "uncompressed_tensors": self.uncompressed}


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    """Average the bucket with PowerSGD (see the module docstring); torch's signature.

    Example::

        >>> import torch, ddpkit
        >>> ddpkit.init_dist_connection(ddpkit.detect_environment())
        >>> model = ddpkit.DistributedDataParallel(torch.nn.Linear(64, 64))
        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10)
        >>> model.register_comm_hook(state, powerSGD_hook)  # plain all-reduce for 10 steps, then rank 2
        >>> model(torch.ones(1, 64)).sum().backward()
        >>> ddpkit.destroy_dist_connection()
    """
    group = state.process_group
    world_size = dist.get_world_size(group)
    buffer = bucket.buffer()
    if bucket.index() == 0:
        state._step = _Stats()
    stats = state._step
    stats.full += buffer.numel() * buffer.element_size()

    if state.iter < state.start_powerSGD_iter:
        stats.sent += buffer.numel() * buffer.element_size()
        stats.uncompressed += len(bucket.parameters())
        # Asynchronous: every bucket of an iteration is in the same phase, so the order holds.
        future = allreduce_hook(group, bucket)
    else:
        _compress_and_reduce(state, bucket, buffer, world_size, stats)
        future = torch.futures.Future()
        future.set_result(buffer)

    if bucket.is_last():
        state.iter += 1
        state._last = stats
    return future


def _compress_and_reduce(state: PowerSGDState, bucket: Any, buffer: Tensor, world_size: int, stats: _Stats) -> None:
    keys = state._parameter_keys(bucket)
    matrices: list[tuple[tuple[str, str], Tensor]] = []  # ((memory key, seed label), view of the bucket as n x m)
    rest: list[Tensor] = []  # views averaged uncompressed
    offset = 0
    for key_and_label, parameter in zip(keys, bucket.parameters()):
        view = buffer[offset : offset + parameter.numel()]
        offset += parameter.numel()
        n = parameter.shape[0] if parameter.dim() >= 2 else 1
        m = parameter.numel() // max(n, 1)
        rank = _rank_for(state, n, m)
        if parameter.dim() >= 2 and (n + m) * rank * state.min_compression_rate < n * m:
            matrices.append((key_and_label, view.view(n, m)))
        else:
            rest.append(view)
    stats.compressed += len(matrices)
    stats.uncompressed += len(rest)

    if not matrices:
        if rest:  # averaged uncompressed, all in one message
            _all_reduce_together(rest, state.process_group, stats, scale=1.0 / world_size, scaled=len(rest))
        return

    # With error feedback each matrix is compressed as M + E, summed into E's own storage: no copy
    # of M is made (the memory-bound passes over every gradient byte are PowerSGD's main cost on a
    # CPU), and E becomes the next error in place once the approximation is known.
    compensated = []
    for (key, _), matrix in matrices:
        if state.use_error_feedback:
            error = state.error.get(key)
            if error is None or error.shape != matrix.shape:
                error = state.error[key] = torch.zeros_like(matrix)
            compensated.append(error.add_(matrix))
        else:
            compensated.append(matrix)

    # Q is kept column-major (a transposed view of an r x m tensor), so that M @ Q and
    # Q = (P^T M)^T read M in its own row order: several times faster than M^T P (benchmarks/README.md).
    qs = [_initial_q(state, key, label, matrix.shape[1], _rank_for(state, *matrix.shape), matrix)
          for (key, label), matrix in matrices]
    ps = [m @ q for m, q in zip(compensated, qs)]
    # The uncompressed tensors travel with P: one blocking round trip less per bucket, which is
    # what PowerSGD's step pays for (its bytes are few).
    _all_reduce_together(rest + ps, state.process_group, stats, scale=1.0 / world_size, scaled=len(rest))
    for p in ps:
        _orthogonalize(p, state.orthogonalization_epsilon)
    qs = [(p.t() @ m).t() for m, p in zip(compensated, ps)]
    _all_reduce_together(qs, state.process_group, stats)

    for ((key, _), matrix), p, q, m in zip(matrices, ps, qs, compensated):
        p.mul_(1.0 / world_size)  # scale the thin factor, not the full matrix
        torch.matmul(p, q.t(), out=matrix)
        if state.use_error_feedback:
            m.sub_(matrix)  # M + E less the averaged approximation: the next error
        if state.warm_start:
            state.q[key] = q


def _rank_for(state: PowerSGDState, n: int, m: int) -> int:
    """At most min(n, m): more columns than that cannot be orthogonal, and Gram-Schmidt would turn
    rounding noise into spurious directions."""
    return min(n, m, state.matrix_approximation_rank)


def _initial_q(state: PowerSGDState, key: str, label: str, columns: int, rank: int, like: Tensor) -> Tensor:
    q = state.q.get(key) if state.warm_start else None
    if q is not None and q.shape == (columns, rank):
        return q
    # The same on every rank: seeded by the configuration, the parameter's label (its name) and
    # (without warm start) the iteration.
    seed = state.random_seed + zlib.crc32(label.encode()) + (0 if state.warm_start else state.iter * 7919)
    generator = torch.Generator().manual_seed(seed % (2**63))
    return torch.randn(rank, columns, generator=generator).to(device=like.device, dtype=like.dtype).t()


def _all_reduce_together(tensors: list[Tensor], group: Any, stats: _Stats, scale: float = 1.0, scaled: int = 0) -> None:
    """Sum several tensors over ranks in one message, in place; ``scale`` multiplies the first
    ``scaled`` of them first (those averaged)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if scaled:
        flat[: sum(t.numel() for t in tensors[:scaled])].mul_(scale)
    # The hook runs while backward does, outside the reducer's seam: this blocking all-reduce opens its own.
    with collective_call("PowerSGD all-reduce", group, flat, fingerprint=False):
        run_collective(dist.all_reduce, flat, group=group)
    stats.sent += flat.numel() * flat.element_size()
    torch._foreach_copy_(tensors, [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)])


def _orthogonalize(matrix: Tensor, epsilon: float) -> None:
    """Gram-Schmidt on the columns, in place; a zero column stays zero instead of becoming NaN."""
    for i in range(matrix.shape[1]):
        column = matrix[:, i : i + 1]
        norm = column.norm()
        column.div_(norm + epsilon if epsilon > 0 else norm.clamp_min(torch.finfo(matrix.dtype).tiny))
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest.sub_(column @ (column.t() @ rest))
