"""Collectives on 2 and 3 real Gloo ranks, checked against values computed by hand."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.distributed import (
    all_gather_ddp_if_available,
    barrier,
    broadcast_object,
    gather_all_tensors,
    get_rank,
    get_world_size,
    sync_ddp,
)
from ddpkit.testing import WorkerPool

# Shapes as functions of the rank: every rank builds its own tensor, every rank can rebuild the others'.
SHAPES = {
    "equal": lambda r: (4, 3),
    "uneven-dim0": lambda r: (2 + 3 * r, 5),
    "uneven-every-dim": lambda r: (r + 1, 3 - r, 2 + r % 2),
    "zero-size-on-rank0": lambda r: (0 if r == 0 else r, 4),
    "all-zero-size": lambda r: (0, 3),
    "scalar": lambda r: (),
    "1d": lambda r: (r * 7,),
}


def make(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    numel = 1
    for size in shape:
        numel *= size
    return (torch.arange(numel, dtype=torch.float64) + 100 * rank).reshape(shape).to(dtype)


def gather_uneven(shape_name: str, dtype_name: str) -> bool:
    dtype = getattr(torch, dtype_name)
    shape_of = SHAPES[shape_name]
    rank, size = dist.get_rank(), dist.get_world_size()
    gathered = gather_all_tensors(make(rank, shape_of(rank), dtype))
    assert len(gathered) == size
    for other, tensor in enumerate(gathered):
        expected = make(other, shape_of(other), dtype)
        assert tensor.shape == expected.shape, (other, tensor.shape, expected.shape)
        assert tensor.dtype == dtype
        assert torch.equal(tensor, expected), other
    return True


@pytest.mark.parametrize("shape_name", sorted(SHAPES))
@pytest.mark.parametrize("dtype_name", ["float32", "int64"])
def test_gather_all_tensors_uneven_shapes(pool: WorkerPool, shape_name: str, dtype_name: str) -> None:
    assert pool.run(gather_uneven, shape_name, dtype_name, timeout=30) == [True] * pool.world_size


def gather_mismatched_ndim() -> str:
    rank = dist.get_rank()
    try:
        gather_all_tensors(torch.zeros((2,) * (rank + 1)))
    except ValueError as error:
        return str(error)
    return "no error"


def gather_mismatched_dtype() -> str:
    rank = dist.get_rank()
    try:
        gather_all_tensors(torch.zeros(3, dtype=torch.float32 if rank == 0 else torch.float64))
    except ValueError as error:
        return str(error)
    return "no error"


def test_gather_mismatched_ndim_raises_on_every_rank(pool2: WorkerPool) -> None:
    for message in pool2.run(gather_mismatched_ndim, timeout=30):
        assert "same number of dimensions" in message and "[1, 2]" in message


def test_gather_mismatched_dtype_raises_on_every_rank(pool2: WorkerPool) -> None:
    for message in pool2.run(gather_mismatched_dtype, timeout=30):
        assert "same dtype" in message


def gather_uneven_with_grad() -> list[float]:
    """Rank r holds x_r of shape (r+1, 2) and computes loss_r = sum_i (r+1)(i+1) * sum(gathered_i).

    d(sum_r loss_r)/d x_j = (j+1) * sum_r (r+1) for every element: each rank's slice gets the
    sum over all ranks of the gradients that reached it.
    """
    rank = dist.get_rank()
    x = torch.zeros(rank + 1, 2, requires_grad=True)
    gathered = gather_all_tensors(x, sync_grads=True)
    loss = sum((rank + 1) * (index + 1) * tensor.sum() for index, tensor in enumerate(gathered))
    loss.backward()
    return x.grad.flatten().tolist()


def test_gradients_flow_through_uneven_gather(pool: WorkerPool) -> None:
    size = pool.world_size
    total = sum(range(1, size + 1))
    for rank, grad in enumerate(pool.run(gather_uneven_with_grad, timeout=30)):
        assert grad == [float((rank + 1) * total)] * ((rank + 1) * 2)


def all_gather_with_grad() -> tuple[list[int], list[float]]:
    """loss_r = sum_i w_r[i] * <gathered_i, 1>, w_r[i] = (r+1)*(i+1): grad of x_j = (j+1) * sum_r (r+1)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.full((3,), float(rank), requires_grad=True)
    gathered = all_gather_ddp_if_available(x, sync_grads=True)
    weights = torch.tensor([(rank + 1) * (i + 1) for i in range(size)], dtype=torch.float32)
    (gathered.sum(dim=1) * weights).sum().backward()
    assert torch.equal(gathered.detach(), torch.arange(size, dtype=torch.float32)[:, None].expand(size, 3))
    return list(gathered.shape), x.grad.tolist()


def test_all_gather_gradients_are_summed_over_ranks(pool: WorkerPool) -> None:
    size = pool.world_size
    total = sum(range(1, size + 1))
    for rank, (shape, grad) in enumerate(pool.run(all_gather_with_grad, timeout=30)):
        assert shape == [size, 3]
        assert grad == [float((rank + 1) * total)] * 3


def all_gather_plain() -> tuple[list[int], bool]:
    rank, size = dist.get_rank(), dist.get_world_size()
    gathered = all_gather_ddp_if_available(make(rank, (2, 2)))
    expected = torch.stack([make(r, (2, 2)) for r in range(size)])
    return list(gathered.shape), torch.equal(gathered, expected) and not gathered.requires_grad


def test_all_gather_without_grad(pool: WorkerPool) -> None:
    assert pool.run(all_gather_plain, timeout=30) == [([pool.world_size, 2, 2], True)] * pool.world_size


def reduce_all_ops() -> dict[str, object]:
    rank = dist.get_rank()
    local = torch.tensor([rank + 1.0, -(rank + 1.0)])
    untouched = local.clone()
    results = {
        "default": sync_ddp(local).tolist(),
        "sum": sync_ddp(local, reduce_op="sum").tolist(),
        "mean": sync_ddp(local, reduce_op="mean").tolist(),
        "avg": sync_ddp(local, reduce_op="AVG").tolist(),
        "max": sync_ddp(local, reduce_op="max").tolist(),
        "min": sync_ddp(local, reduce_op="min").tolist(),
        "ReduceOp.MAX": sync_ddp(local, reduce_op=dist.ReduceOp.MAX).tolist(),
        "ReduceOp.AVG": sync_ddp(local, reduce_op=dist.ReduceOp.AVG).tolist(),
        "ReduceOp.PRODUCT": sync_ddp(local, reduce_op=dist.ReduceOp.PRODUCT).tolist(),
        "int-number-sum": sync_ddp(rank + 1),
        "float-number-mean": sync_ddp(rank + 0.5, reduce_op="mean"),
        "int-tensor-mean": sync_ddp(torch.tensor([rank], dtype=torch.int64), reduce_op="mean"),
        "input-untouched": torch.equal(local, untouched),
    }
    for key in ("int-number-sum", "float-number-mean", "int-tensor-mean"):
        value = results[key]
        assert isinstance(value, torch.Tensor)
        results[key] = (value.tolist(), str(value.dtype))
    return results


def test_sync_ddp_every_op_and_numbers(pool: WorkerPool) -> None:
    n = pool.world_size
    total = n * (n + 1) / 2
    product = 1.0
    for r in range(1, n + 1):
        product *= r
    expected = {
        "default": [total, -total],
        "sum": [total, -total],
        "mean": [total / n, -total / n],
        "avg": [total / n, -total / n],
        "max": [float(n), -1.0],
        "min": [1.0, -float(n)],
        "ReduceOp.MAX": [float(n), -1.0],
        "ReduceOp.AVG": [total / n, -total / n],
        "ReduceOp.PRODUCT": [product, product * (-1) ** n],
        "int-number-sum": (int(total), "torch.int64"),
        "float-number-mean": (pytest.approx((total - n / 2) / n), "torch.float32"),
        # ranks 0..n-1 averaged: (n-1)/2, e.g. 0.5 on two ranks, which integer division would truncate to 0
        "int-tensor-mean": ([pytest.approx((n - 1) / 2)], "torch.float32"),
        "input-untouched": True,
    }
    for result in pool.run(reduce_all_ops, timeout=30):
        assert result == expected


def subgroup_without_rank_zero() -> dict[str, object]:
    """Global ranks 1 and 2 form a group; rank 0 is outside and must not be needed."""
    group = dist.new_group([1, 2])
    rank = dist.get_rank()
    if rank == 0:
        try:
            sync_ddp(torch.ones(1), group=group)
        except ValueError as error:
            return {"outsider": str(error)}
        return {"outsider": "no error"}
    group_rank = get_rank(group)
    summed = sync_ddp(torch.tensor([float(rank)]), group=group).item()
    gathered = [t.tolist() for t in gather_all_tensors(torch.full((rank,), float(rank)), group=group)]
    from_group_first = broadcast_object(f"from global rank {rank}", src=0, group=group)
    from_group_second = broadcast_object(f"from global rank {rank}", src=1, group=group)
    x = torch.ones(2, requires_grad=True)
    stacked = all_gather_ddp_if_available(x * rank, group=group, sync_grads=True)
    stacked.sum().backward()
    barrier(group=group)
    return {"group_rank": group_rank, "group_size": get_world_size(group), "sum": summed, "gathered": gathered,
            "first": from_group_first, "second": from_group_second, "grad": x.grad.tolist()}


def test_subgroup_without_global_rank_zero(pool3: WorkerPool) -> None:
    outsider, first, second = pool3.run(subgroup_without_rank_zero, timeout=30)
    assert "not a member" in outsider["outsider"] and "[1, 2]" in outsider["outsider"]
    for group_rank, result in enumerate((first, second)):
        global_rank = group_rank + 1
        assert result["group_rank"] == group_rank and result["group_size"] == 2
        assert result["sum"] == 3.0
        assert result["gathered"] == [[1.0], [2.0, 2.0]]
        assert result["first"] == "from global rank 1"  # src=0 is the group's first member, not global 0
        assert result["second"] == "from global rank 2"
        # d/dx of sum over both ranks of sum(gathered) where slice j is x_j * (j+1): 2 ranks * global_rank
        assert result["grad"] == [2.0 * global_rank] * 2


def broadcast_from(src: int) -> object:
    rank = dist.get_rank()
    return broadcast_object({"rank": rank, "payload": list(range(rank + 3))}, src=src)


def test_broadcast_object_from_any_rank(pool: WorkerPool) -> None:
    src = pool.world_size - 1
    assert pool.run(broadcast_from, src, timeout=30) == [{"rank": src, "payload": list(range(src + 3))}] * (
        pool.world_size)


def broadcast_large() -> int:
    payload = bytes(range(256)) * 4096 if dist.get_rank() == 0 else None  # 1 MiB
    received = broadcast_object(payload)
    assert received == bytes(range(256)) * 4096
    return len(received)


def test_broadcast_object_large_payload(pool2: WorkerPool) -> None:
    assert pool2.run(broadcast_large, timeout=30) == [1 << 20] * 2


def broadcast_bad_src() -> str:
    try:
        broadcast_object(1, src=dist.get_world_size())
    except ValueError as error:
        return str(error)
    return "no error"


def test_broadcast_object_rejects_a_src_outside_the_group(pool2: WorkerPool) -> None:
    assert pool2.run(broadcast_bad_src, timeout=30) == ["src=2 is not a rank of the group, whose ranks are 0..1."] * 2


def gather_objects() -> list[object]:
    from ddpkit.distributed import all_gather_object

    rank = dist.get_rank()
    return all_gather_object({"rank": rank, "names": ["w"] * rank})


def test_all_gather_object(pool: WorkerPool) -> None:
    expected = [{"rank": r, "names": ["w"] * r} for r in range(pool.world_size)]
    assert pool.run(gather_objects, timeout=30) == [expected] * pool.world_size


# --- broadcast of tensors: shapes checked first ---------------------------------------------------


def broadcast_sizes(sizes: list[int], dtypes: list[str]) -> tuple[str, object]:
    rank = dist.get_rank()
    tensor = torch.full((sizes[rank],), float(rank + 1), dtype=getattr(torch, dtypes[rank]))
    try:
        ddpkit.broadcast(tensor, src=0)
    except ValueError as error:
        return "error", str(error)
    return "ok", tensor.tolist()


def test_broadcast_copies_the_source_tensor_everywhere(pool: WorkerPool) -> None:
    world = pool.world_size
    for kind, value in pool.run(broadcast_sizes, [4] * world, ["float32"] * world):
        assert (kind, value) == ("ok", [1.0] * 4)


def test_broadcast_with_different_sizes_raises_on_every_rank_instead_of_leaving_garbage(pool2: WorkerPool) -> None:
    # torch's Gloo broadcast exits 0 here with garbage in rank 1's tensor.
    for kind, message in pool2.run(broadcast_sizes, [4, 3], ["float32", "float32"]):
        assert kind == "error"
        assert "source rank 0 has (4,), but rank 1 has (3,)" in str(message)


def test_broadcast_with_different_dtypes_raises_on_every_rank(pool2: WorkerPool) -> None:
    for kind, message in pool2.run(broadcast_sizes, [4, 4], ["float32", "float64"]):
        assert kind == "error" and "broadcast needs the same dtype" in str(message)


def broadcast_in_subgroup() -> list[float] | None:
    group = dist.new_group([1, 2])
    if dist.get_rank() == 0:
        return None
    tensor = torch.full((2,), float(dist.get_rank()))
    return ddpkit.broadcast(tensor, src=1, group=group).tolist()  # group rank 1 is global rank 2


def test_broadcast_src_counts_inside_the_group(pool3: WorkerPool) -> None:
    assert pool3.run(broadcast_in_subgroup) == [None, [2.0, 2.0], [2.0, 2.0]]
