"""One process, no process group: every collective is an identity; bad arguments are refused."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import ddpkit.membership.connection as connection
from ddpkit.distributed import (
    all_gather_ddp_if_available,
    barrier,
    broadcast_object,
    destroy_dist_connection,
    gather_all_tensors,
    get_rank,
    get_world_size,
    init_dist_connection,
    register_ddp_comm_hook,
    sync_ddp,
    sync_ddp_if_available,
)
from ddpkit.environments import LocalEnvironment


@pytest.fixture()
def no_process_group() -> Iterator[None]:
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_collectives_are_identities_without_a_process_group(no_process_group: None) -> None:
    t = torch.arange(6.0).reshape(2, 3)
    assert all_gather_ddp_if_available(t) is t  # unchanged, as Lightning does
    assert all_gather_ddp_if_available(t, sync_grads=True) is t
    assert gather_all_tensors(t) == [t]
    assert torch.equal(sync_ddp(t), t)
    assert sync_ddp_if_available(t, reduce_op="mean") is t
    assert sync_ddp_if_available(3) == 3
    assert broadcast_object({"a": 1}) == {"a": 1}
    barrier()
    destroy_dist_connection()
    assert (get_rank(), get_world_size()) == (0, 1)


def test_sync_ddp_converts_numbers_and_averages_integers_to_float(no_process_group: None) -> None:
    assert sync_ddp(3).dtype == torch.int64 and sync_ddp(3).item() == 3
    assert sync_ddp(2.5, reduce_op="mean").item() == 2.5
    mean = sync_ddp(torch.tensor([1, 2]), reduce_op="avg")
    assert mean.dtype == torch.float32 and mean.tolist() == [1.0, 2.0]


@pytest.mark.parametrize("function", [sync_ddp, sync_ddp_if_available])
def test_unknown_reduce_op_lists_the_valid_ones(no_process_group: None, function) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="reduce_op='median'.*'sum', 'mean', 'avg', 'max', 'min'"):
        function(torch.ones(1), reduce_op="median")
    with pytest.raises(TypeError, match="reduce_op must be"):
        function(torch.ones(1), reduce_op=3)


def test_sync_ddp_refuses_non_numbers(no_process_group: None) -> None:
    with pytest.raises(TypeError, match="tensors and numbers.*'abc'"):
        sync_ddp("abc")  # type: ignore[arg-type]


def test_init_one_process_uses_no_network(no_process_group: None) -> None:
    # An address that cannot resolve: connecting to it would fail, so success proves no network was used.
    env = LocalEnvironment({"MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "1"})
    init_dist_connection(env, "gloo")
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert sync_ddp(torch.tensor([2.0]), reduce_op="mean").tolist() == [2.0]
    assert [t.tolist() for t in gather_all_tensors(torch.ones(2))] == [[1.0, 1.0]]
    init_dist_connection(env, "gloo")  # the same connection again: nothing to do
    with pytest.raises(RuntimeError, match=r"world_size: existing 1, requested 2.*destroy_process_group"):
        init_dist_connection(env, "gloo", global_rank=0, world_size=2)
    destroy_dist_connection()
    assert not dist.is_initialized()


def test_init_refuses_inconsistent_ranks_and_nccl_without_cuda(no_process_group: None) -> None:
    env = LocalEnvironment({"MASTER_PORT": "29500"})
    with pytest.raises(ValueError, match="global_rank=2 is not smaller than world_size=2"):
        init_dist_connection(env, "gloo", global_rank=2, world_size=2)
    with pytest.raises(ValueError, match="global_rank=-1 is negative"):
        init_dist_connection(env, "gloo", global_rank=-1, world_size=2)
    with pytest.raises(ValueError, match="world_size=0 must be at least 1"):
        init_dist_connection(env, "gloo", global_rank=0, world_size=0)
    with pytest.raises(ValueError, match="No port to meet on.*MASTER_PORT"):
        init_dist_connection(LocalEnvironment({"WORLD_SIZE": "2", "RANK": "0"}), "gloo")
    if not torch.cuda.is_available():  # the launcher's --backend reaches the connection through the environment
        with pytest.raises(ValueError, match=r"'nccl' \(DDPKIT_BACKEND, from `ddpkit run --backend`\) needs CUDA"):
            init_dist_connection(LocalEnvironment({"MASTER_PORT": "29500", "DDPKIT_BACKEND": "nccl"}))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'nccl' needs CUDA.*'gloo'"):
            init_dist_connection(env, "nccl")
    assert not dist.is_initialized()


def test_init_without_torch_distributed(no_process_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connection.dist, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="torch.distributed is not available"):
        init_dist_connection(LocalEnvironment({"MASTER_PORT": "29500"}), "gloo")


def test_register_ddp_comm_hook_argument_errors() -> None:
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        raise AssertionError("never called")

    register_ddp_comm_hook(torch.nn.Linear(1, 1))  # no hook: nothing to do
    with pytest.raises(ValueError, match="ddp_comm_wrapper=.*without ddp_comm_hook"):
        register_ddp_comm_hook(torch.nn.Linear(1, 1), ddp_comm_wrapper=lambda h: h)
    with pytest.raises(TypeError, match="needs a DistributedDataParallel module.*got Linear"):
        register_ddp_comm_hook(torch.nn.Linear(1, 1), ddp_comm_hook=hook)
