"""ddpkit.parallel.batchnorm.SyncBatchNorm on Gloo/CPU (where torch's raises "expected input tensor to be
on GPU") against one process's nn.BatchNorm on the concatenated batch, uneven batches included."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import strategy
from torch import nn

from ddpkit.parallel.batchnorm import SyncBatchNorm
from ddpkit.testing import WorkerPool

CHANNELS = 4
# Rows per rank: uneven, and one rank with none at all in the last case.
BATCH_SIZES = {2: [(3, 5), (0, 4)], 3: [(3, 5, 2), (1, 0, 6)]}


def global_input(total: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10 + step)
    return (torch.randn(total, CHANNELS, 3, 3, generator=generator) * 3 + 1).to(dtype)


def output_weights(total: int, dtype: torch.dtype) -> torch.Tensor:
    """Fixed weights of a sum loss, so the loss of all rows is the sum of every rank's loss."""
    return torch.randn(total, CHANNELS, 3, 3, generator=torch.Generator().manual_seed(99)).to(dtype)


def make_batchnorm(dtype: torch.dtype, momentum: float | None) -> nn.BatchNorm2d:
    torch.manual_seed(0)
    layer = nn.BatchNorm2d(CHANNELS, momentum=momentum).to(dtype)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
    return layer


def rows(sizes: tuple[int, ...], rank: int) -> slice:
    return slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))


def batchnorm_run(layer: nn.Module, sizes: tuple[int, ...], rank: int | None, dtype: torch.dtype,
                  steps: int = 2) -> dict[str, torch.Tensor]:
    """Two training forwards/backwards, then one evaluation forward; rank None: all rows."""
    total = sum(sizes)
    part = slice(None) if rank is None else rows(sizes, rank)
    result: dict[str, torch.Tensor] = {}
    for step in range(steps):
        x = global_input(total, step, dtype)[part].clone().requires_grad_(True)
        out = layer(x)
        (out * output_weights(total, dtype)[part]).sum().backward()
        result[f"output{step}"], result[f"input_grad{step}"] = out.detach(), x.grad
    result["weight_grad"], result["bias_grad"] = layer.weight.grad.clone(), layer.bias.grad.clone()
    if rank is not None:  # each rank holds its rows' share: summed, the one-process gradient
        dist.all_reduce(result["weight_grad"])
        dist.all_reduce(result["bias_grad"])
    result["running_mean"], result["running_var"] = layer.running_mean.clone(), layer.running_var.clone()
    layer.eval()
    result["evaluation"] = layer(global_input(total, 5, dtype)[part])
    return result


def synchronised_run(case: int, dtype: torch.dtype, momentum: float | None) -> dict[str, torch.Tensor]:
    sizes = BATCH_SIZES[dist.get_world_size()][case]
    layer = SyncBatchNorm.convert_sync_batchnorm(make_batchnorm(dtype, momentum))
    return batchnorm_run(layer, sizes, dist.get_rank(), dtype)


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", [0, 1], ids=["uneven", "a_rank_without_rows"])
def test_outputs_gradients_and_running_statistics_equal_one_process(pool: WorkerPool, case: int,
                                                                  dtype: torch.dtype, momentum: float | None) -> None:
    sizes = BATCH_SIZES[pool.world_size][case]
    expected = batchnorm_run(make_batchnorm(dtype, momentum), sizes, None, dtype)
    tolerance = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    for rank, actual in enumerate(pool.run(synchronised_run, case, dtype, momentum, timeout=60)):
        for name, wanted in expected.items():
            if name.startswith(("output", "input_grad", "evaluation")):
                wanted = wanted[rows(sizes, rank)]
            torch.testing.assert_close(actual[name], wanted, **tolerance, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")


def low_precision_run() -> torch.Tensor:
    sizes = BATCH_SIZES[dist.get_world_size()][0]
    layer = SyncBatchNorm.convert_sync_batchnorm(make_batchnorm(torch.float32, 0.1))
    x = global_input(sum(sizes), 0, torch.bfloat16)[rows(sizes, dist.get_rank())]
    return layer(x)


def test_bf16_input_is_normalised_in_float32(pool2: WorkerPool) -> None:
    """bf16 activations with fp32 parameters (autocast's layout): the output is bf16, within one
    bf16 rounding of one process on the fp32 values."""
    sizes = BATCH_SIZES[2][0]
    x = global_input(sum(sizes), 0, torch.bfloat16).float()
    expected = make_batchnorm(torch.float32, 0.1)(x).detach()
    for rank, out in enumerate(pool2.run(low_precision_run, timeout=60)):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected[rows(sizes, rank)], rtol=2**-8, atol=2**-8)


def one_value_per_channel() -> str:
    layer = SyncBatchNorm(CHANNELS)
    x = torch.randn(1 if dist.get_rank() == 0 else 0, CHANNELS)
    try:
        layer(x)
    except ValueError as error:
        return str(error)
    return "no error"


def test_one_value_per_channel_in_the_whole_group_is_refused_on_every_rank(pool2: WorkerPool) -> None:
    for message in pool2.run(one_value_per_channel, timeout=60):
        assert "more than 1 value per channel" in message and "1 value(s) per channel in all" in message
        assert "model.eval()" in message


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, CHANNELS, 3, padding=1)
        self.norm = nn.BatchNorm2d(CHANNELS)
        self.head = nn.Linear(CHANNELS, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.conv(x))).mean(dim=(2, 3)))


PER_RANK = 4


def conv_batch(world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(PER_RANK * world, 2, 5, 5, generator=generator), torch.randn(PER_RANK * world, 2, generator=generator)


def train_conv(model: nn.Module, module: nn.Module, rank: int | None, world: int, steps: int) -> dict[str, torch.Tensor]:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(steps):
        x, y = conv_batch(world, step)
        if rank is not None:
            x, y = x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def strategy_with_sync_batchnorm(use_torch_ddp: bool) -> tuple[dict[str, torch.Tensor], str]:
    s = strategy(sync_batchnorm=True, use_torch_ddp=use_torch_ddp)
    net = s.setup(ConvNet())
    module = s.get_model_from_plugin(net)
    return train_conv(net, module, dist.get_rank(), dist.get_world_size(), 3), type(module.norm).__module__


@pytest.mark.parametrize("use_torch_ddp", [False, True], ids=["ddpkit-ddp", "torch-ddp"])
def test_strategy_sync_batchnorm_trains_as_one_process_on_cpu(pool: WorkerPool, use_torch_ddp: bool) -> None:
    """DDPStrategy(sync_batchnorm=True) on CPU: parameters and running statistics of one process
    with nn.BatchNorm on the concatenated batch (torch's SyncBatchNorm would raise here)."""
    reference = ConvNet()
    expected = train_conv(reference, reference, None, pool.world_size, 3)
    for state, norm_module in pool.run(strategy_with_sync_batchnorm, use_torch_ddp, timeout=60):
        assert norm_module == "ddpkit.parallel.batchnorm"
        for name, wanted in expected.items():
            torch.testing.assert_close(state[name], wanted, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_without_a_process_group_it_is_plain_batchnorm() -> None:
    x = global_input(6, 0, torch.float32)
    expected = make_batchnorm(torch.float32, 0.1)(x)
    torch.testing.assert_close(SyncBatchNorm.convert_sync_batchnorm(make_batchnorm(torch.float32, 0.1))(x), expected)
