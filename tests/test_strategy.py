"""DDPStrategy on 2 Gloo ranks: training through setup/setup_dataloader/backward equals one process,
and the plugin API (reduce, broadcast, block_backward_sync, checkpoints) does what it says."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import strategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpkit.environments import LocalEnvironment, TorchElasticEnvironment
from ddpkit.testing import WorkerPool
from ddpkit.training.strategy import DDPStrategy

SAMPLES, BATCH = 32, 4


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(SAMPLES, 5, generator=generator), torch.randn(SAMPLES, 2, generator=generator))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def train_with_strategy(use_torch_ddp: bool, plugin_hooks: bool = False) -> list[torch.Tensor]:
    s = strategy(use_torch_ddp=use_torch_ddp)
    net = s.setup(model())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = s.setup_dataloader(DataLoader(dataset(), batch_size=BATCH, shuffle=False))
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        if plugin_hooks:  # what Lightning-plugin code calls around the backward (issue 30, item 3)
            s.pre_backward(loss)
        s.backward(loss)
        optimizer.step()
    assert s.get_model_from_plugin(net) is net.module
    return [p.detach().clone() for p in s.get_model_from_plugin(net).parameters()]


@pytest.mark.parametrize("plugin_hooks", [False, True], ids=["", "pre_backward"])
@pytest.mark.parametrize("use_torch_ddp", [False, True], ids=["ddpkit-ddp", "torch-ddp"])
def test_training_through_the_strategy_equals_one_process(pool2: WorkerPool, use_torch_ddp: bool,
                                                         plugin_hooks: bool) -> None:
    # DistributedSampler without shuffle gives rank r the samples r, r+2, ...; step k's global
    # batch is both ranks' k-th batches together.
    data, reference = dataset(), model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    shards = [list(range(rank, SAMPLES, 2)) for rank in range(2)]
    for step in range(SAMPLES // (2 * BATCH)):
        indices = [i for shard in shards for i in shard[step * BATCH : (step + 1) * BATCH]]
        x, y = data[indices]
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
    for params in pool2.run(train_with_strategy, use_torch_ddp, plugin_hooks, timeout=60):
        for actual, expected in zip(params, reference.parameters()):
            torch.testing.assert_close(actual, expected.detach(), rtol=1e-5, atol=1e-6)


def plugin_api() -> dict[str, object]:
    s = strategy()
    rank = s.global_rank
    net = s.setup(model())
    with s.block_backward_sync():
        net(torch.full((1, 5), float(rank + 1))).sum().backward()
    local = net.module[0].bias.grad.clone()
    return {
        "reduce_mean": s.reduce(torch.tensor([float(rank)])).tolist(),
        "reduce_sum": s.reduce(torch.tensor([float(rank)]), reduce_op="sum").tolist(),
        "not_a_tensor": s.reduce("text"),
        "broadcast": s.broadcast({"from": rank}, src=1),
        "sampler_kwargs": s.distributed_sampler_kwargs,
        "is_global_zero": s.is_global_zero,
        "root_device": str(s.root_device),
        "moved": [str(t.device) for t in s.on_before_forward(net, torch.ones(1), "x") if isinstance(t, torch.Tensor)],
        "unsynced_grad": local.tolist(),
    }


def test_the_plugin_api(pool2: WorkerPool) -> None:
    first, second = pool2.run(plugin_api, timeout=60)
    for rank, result in enumerate((first, second)):
        assert result["reduce_mean"] == [0.5] and result["reduce_sum"] == [1.0]
        assert result["not_a_tensor"] == "text" and result["broadcast"] == {"from": 1}
        assert result["sampler_kwargs"] == {"num_replicas": 2, "rank": rank}
        assert result["is_global_zero"] == (rank == 0) and result["root_device"] == "cpu"
        assert result["moved"] == ["cpu"]
    assert first["unsynced_grad"] != second["unsynced_grad"]  # block_backward_sync kept them local


def checkpoint_round_trip(folder: str) -> tuple[object, object, bool, str, object]:
    s = strategy()
    path = os.path.join(folder, "ckpt.pt")
    missing = s.load_checkpoint(os.path.join(folder, "none.pt"))
    s.save_checkpoint(path, {"step": 7, "rank_that_wrote": s.global_rank})
    loaded = s.load_checkpoint(path)
    leftovers = [name for name in os.listdir(folder) if name.startswith(".ddpkit-")]
    # As a job of four ranks would have written it (a --nnodes 1:2 job resumed on one node is the same).
    other_world = os.path.join(folder, "four.pt")
    if s.is_global_zero:
        torch.save({**torch.load(path, weights_only=False), "ddpkit_data_world_size": 4}, other_world)
    s.barrier()
    try:
        s.load_checkpoint(other_world)
        refused = ""
    except ValueError as error:
        refused = str(error)
    return missing, loaded, not leftovers, refused, s.load_checkpoint(other_world, world_may_differ=True)


def test_checkpoints_are_written_by_rank_zero_atomically_and_loaded_everywhere(pool2: WorkerPool,
                                                                               tmp_path: Path) -> None:
    """A checkpoint keeps its job's data world: one written by a job whose global batch had another
    number of shares is refused on every rank, naming both and the way out, unless asked for."""
    for missing, loaded, clean, refused, anyway in pool2.run(checkpoint_round_trip, str(tmp_path), timeout=60):
        assert missing is None
        assert loaded == {"step": 7, "rank_that_wrote": 0}
        assert clean  # the temporary file was renamed into place
        assert refused.startswith(f"the checkpoint {tmp_path}/four.pt was trained by a job of 4 ranks, whose global "
                                  "batch had 4 shares, and this job has 2: resuming it would train smaller global "
                                  "batches"), refused
        assert "world_may_differ=True" in refused
        assert anyway == {"step": 7, "rank_that_wrote": 0}


def epochs_see_new_orders() -> list[list[int]]:
    s = strategy()
    indices = TensorDataset(torch.arange(SAMPLES))
    loader = s.setup_dataloader(DataLoader(indices, batch_size=SAMPLES, shuffle=True))
    return [next(iter(loader))[0].tolist() for _ in range(2)]


def test_setup_dataloader_shards_and_reshuffles_each_epoch(pool2: WorkerPool) -> None:
    (rank0_epoch0, rank0_epoch1), (rank1_epoch0, rank1_epoch1) = pool2.run(epochs_see_new_orders, timeout=60)
    assert sorted(rank0_epoch0 + rank1_epoch0) == list(range(SAMPLES))  # together: every sample once
    assert rank0_epoch0 != rank0_epoch1  # set_epoch was called: a new shuffle
    assert sorted(rank0_epoch1 + rank1_epoch1) == list(range(SAMPLES))


def test_model_to_device_needs_a_model() -> None:
    with pytest.raises(ValueError, match="needs a model"):
        DDPStrategy(cluster_environment=LocalEnvironment({"MASTER_PORT": "1"})).model_to_device()


def strategy_backends() -> None:
    """The backend the strategy asks for reaches the connection (and not the DDP module): the
    pool's Gloo group is kept when asked for "gloo" and refused when asked for "nccl"."""
    strategy(process_group_backend="gloo")
    error, message = ((RuntimeError, "existing 'gloo', requested 'nccl'") if torch.cuda.is_available()
                      else (ValueError, "needs CUDA GPUs"))
    with pytest.raises(error, match=message):
        strategy(process_group_backend="nccl")


def test_process_group_backend_chooses_the_backend(pool2: WorkerPool) -> None:
    """Lightning's ``process_group_backend``: e.g. "gloo" for processes that share one GPU."""
    pool2.run(strategy_backends)


def test_the_launchers_backend_comes_before_the_default_for_a_gpu() -> None:
    """``ddpkit run --backend gloo`` with ranks sharing a GPU: the strategy's CUDA root device must
    not turn that into NCCL (which refuses two ranks on one GPU); ``process_group_backend`` still wins."""
    gpu = [torch.device("cuda", 0)]
    environment = {"MASTER_PORT": "1", "DDPKIT_BACKEND": "gloo"}
    assert DDPStrategy(cluster_environment=LocalEnvironment(environment), parallel_devices=gpu)._backend() == "gloo"
    assert DDPStrategy(cluster_environment=LocalEnvironment({"MASTER_PORT": "1"}), parallel_devices=gpu)._backend() == "nccl"
    assert DDPStrategy(cluster_environment=LocalEnvironment(environment), parallel_devices=gpu,
                       process_group_backend="nccl")._backend() == "nccl"


def test_a_local_rank_without_a_gpu_of_its_own_is_refused_before_nccl_connects(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks on a node of one GPU: local rank 1 would share cuda:0, which NCCL refuses at its first
    collective as "invalid usage". It is refused before connecting, naming the counts and both fixes
    (over Gloo, ranks share a GPU on purpose: only NCCL is checked)."""
    from ddpkit.training.strategy import _refuse_a_shared_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    environment = {"MASTER_PORT": "1", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    with pytest.raises(ValueError, match=r"local rank 1 has no GPU of its own: this node has 1 GPU\(s\), so it would "
                                         r"share cuda:0 with local rank 0.*--nproc-per-node 1.*--backend gloo"):
        DDPStrategy(cluster_environment=LocalEnvironment(environment)).setup_environment()
    _refuse_a_shared_gpu(0, torch.device("cuda", 0))  # a rank with a GPU of its own goes on


def dispatch_waits() -> list[float]:
    s = strategy()
    waited = []
    for step in (s.pre_dispatch, s.post_dispatch):
        if s.global_rank == 1:
            time.sleep(0.5)
        start = time.monotonic()
        step()
        waited.append(time.monotonic() - start)
    return waited


def test_pre_and_post_dispatch_wait_for_every_rank(pool2: WorkerPool) -> None:
    """Lightning's hooks before and after training: barriers, so none starts or tears down alone."""
    rank0, rank1 = pool2.run(dispatch_waits, timeout=60)
    assert min(rank0) > 0.4, rank0  # rank 0 waited for rank 1, twice
    assert max(rank1) < 0.4, rank1


def train_in_subgroups() -> dict[str, object]:
    """Ranks 0 and 1 train together; rank 2 alone: two data-parallel groups in one world."""
    groups = [dist.new_group([0, 1]), dist.new_group([2])]  # every rank creates every group, in order
    rank = dist.get_rank()
    mine = groups[0] if rank < 2 else groups[1]
    s = strategy(process_group=mine)
    net = s.setup(model())
    net(torch.full((1, 5), float(rank + 1))).sum().backward()
    s.barrier("trained")
    return {
        "group_is_mine": s.data_parallel_group is mine,
        "broadcast": s.broadcast(rank),
        "sampler_kwargs": s.distributed_sampler_kwargs,
        "bias_grad": net.module[0].bias.grad.tolist(),
    }


def test_a_process_group_in_ddp_kwargs_is_the_data_parallel_group(pool3: WorkerPool) -> None:
    """Gradients, broadcasts, barriers and data shards all stay inside the group given to the DDP module."""
    results = pool3.run(train_in_subgroups, timeout=60)
    assert [r["group_is_mine"] for r in results] == [True] * 3
    assert [r["broadcast"] for r in results] == [0, 0, 2]  # src=0 counts inside each group
    assert [r["sampler_kwargs"] for r in results] == [
        {"num_replicas": 2, "rank": 0}, {"num_replicas": 2, "rank": 1}, {"num_replicas": 1, "rank": 0}]
    assert results[0]["bias_grad"] == results[1]["bias_grad"]  # averaged over ranks 0 and 1
    assert results[2]["bias_grad"] != results[0]["bias_grad"]  # rank 2's own


def test_restart_count_comes_from_the_launcher_through_the_environment() -> None:
    """The count the launcher wrote in the process's environment, read once, with the rest of its
    contract, by the strategy's cluster environment: ddpkit run's and torchrun's alike."""
    def restart_count(**told: str) -> int:
        return DDPStrategy(cluster_environment=LocalEnvironment({"MASTER_PORT": "1", **told})).restart_count

    assert restart_count() == 0
    assert restart_count(TORCHELASTIC_RESTART_COUNT="1") == 1  # torchrun's
    assert restart_count(TORCHELASTIC_RESTART_COUNT="2", DDPKIT_RESTART_COUNT="2") == 2  # ddpkit run sets both alike
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1", "TORCHELASTIC_RESTART_COUNT": "3"}
    assert DDPStrategy(cluster_environment=TorchElasticEnvironment(torchrun)).restart_count == 3
    with pytest.raises(ValueError, match="DDPKIT_RESTART_COUNT='two' is not a restart count"):
        restart_count(DDPKIT_RESTART_COUNT="two")  # refused as the environment is read, not at the first look


def test_the_optimizers_step_listeners_run_in_the_order_of_their_stages_behind_one_hook() -> None:
    """``ddpkit.training.commit``: the count before the commit before the replica check, whatever
    order they were added in, through one hook on the optimizer."""
    from ddpkit.training.commit import OptimizerCommits, Stage

    optimizer = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    hooks_before = len(optimizer._optimizer_step_post_hooks)
    commits, seen = OptimizerCommits(optimizer), []
    for stage in (Stage.CHECK, Stage.COMMIT, Stage.COUNT, Stage.COMMIT):
        commits.after_each_step(stage, lambda stage=stage: seen.append(stage.name))
    optimizer.step()
    assert seen == ["COUNT", "COMMIT", "COMMIT", "CHECK"]
    assert len(optimizer._optimizer_step_post_hooks) == hooks_before + 1
