"""CUDA/NCCL paths: DDP on GPUs (device_ids, inputs moved to the device), the fp16/bf16 hooks and
PowerSGD on CUDA tensors, SyncBatchNorm on CUDA, a failure named on the other rank, the overlapped
optimizer step bit for bit as the synchronous one, in-place
recovery with CUDA tensors (tests/real_loop.py, a rank SIGKILLed: every rank ends as without the
fault) over the pool's backend, and over NCCL behind ``DDPKIT_NCCL_IN_PLACE=1``. Marked ``gpu``; they skip, saying
why, on a machine without CUDA or with fewer GPUs than ranks (NCCL wants one GPU per rank).

    python -m pytest -q -m gpu tests/test_gpu.py       # on a machine with 2 GPUs

The functions take the device type, so ``GPU_TEST_DEVICE=cpu`` runs the same checks on Gloo/CPU
(to check the checks themselves where no GPU is lent). On a machine with one GPU,
``GPU_TEST_BACKEND=gloo`` lets both ranks share it (Gloo all-reduces CUDA tensors): the CUDA
paths of ddpkit are checked, NCCL's are not. ``benchmarks/gpu_check.py`` runs this file with the
right variables for the machine it finds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import Flaky, global_batch, make_mlp, shard, strategy
from torch import nn

from ddpkit.diagnostics.failures import PeerFailedError
from ddpkit.hooks import PowerSGDState, bf16_compress_hook, fp16_compress_hook, powerSGD_hook
from ddpkit.parallel.batchnorm import SyncBatchNorm
from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.testing import WorkerPool
from ddpkit.variables import DDPKIT_NCCL_IN_PLACE

RANKS = 2
DEVICE_TYPE = os.environ.get("GPU_TEST_DEVICE", "cuda")
BACKEND = os.environ.get("GPU_TEST_BACKEND", "nccl" if DEVICE_TYPE == "cuda" else "gloo")


def _missing_gpus() -> str | None:
    if DEVICE_TYPE != "cuda":
        return None
    if not torch.cuda.is_available():
        return "no CUDA device on this machine (torch.cuda.is_available() is False); run on a GPU machine"
    if BACKEND == "nccl" and torch.cuda.device_count() < RANKS:
        return (f"NCCL needs one GPU per rank: {RANKS} ranks, {torch.cuda.device_count()} GPU(s) here "
                "(GPU_TEST_BACKEND=gloo shares one GPU between the ranks)")
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_missing_gpus() is not None, reason=str(_missing_gpus()))]


@pytest.fixture(scope="module")
def gpu_pool():  # type: ignore[no-untyped-def]
    with WorkerPool(RANKS, timeout=120, pg_timeout=30, backend=BACKEND) as pool:
        yield pool


def this_device() -> torch.device:
    if DEVICE_TYPE == "cuda":
        return torch.device("cuda", torch.cuda.current_device())  # the pool set one GPU per rank
    return torch.device("cpu")


def sgd_steps(model: nn.Module, module: nn.Module, rank: int | None, world: int, steps: int,
              device: torch.device | None) -> list[torch.Tensor]:
    """SGD on this rank's shard (rank None: the whole batch); inputs stay on the CPU when
    ``device`` is None, so the DDP wrapper has to move them."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(steps):
        x, y = global_batch(world, step)
        if rank is not None:
            x, y = shard(x, rank), shard(y, rank)
        target_device = device or next(module.parameters()).device
        optimizer.zero_grad()
        out = model(x if device is None else x.to(device))
        nn.functional.mse_loss(out, y.to(target_device)).backward()
        optimizer.step()
    return [p.detach().cpu() for p in module.parameters()]


def reference_parameters(steps: int) -> list[torch.Tensor]:
    module = make_mlp()
    return sgd_steps(module, module, None, RANKS, steps, torch.device("cpu"))


def train_on_device(hook: str) -> list[torch.Tensor]:
    device = this_device()
    module = make_mlp().to(device)
    model = DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None)
    if hook != "none":
        model.register_comm_hook(None, {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook}[hook])
    return sgd_steps(model, module, dist.get_rank(), dist.get_world_size(), 3, device=None)


@pytest.mark.parametrize("hook", ["none", "fp16", "bf16"])
def test_ddp_on_the_device_trains_as_one_process(gpu_pool: WorkerPool, hook: str) -> None:
    """Inputs given on the CPU are moved to the module's device; the hooks compress on NCCL."""
    tolerance = {"none": 1e-5, "fp16": 2e-3, "bf16": 2e-2}[hook]
    expected = reference_parameters(3)
    for params in gpu_pool.run(train_on_device, hook):
        for actual, wanted in zip(params, expected):
            torch.testing.assert_close(actual, wanted, rtol=tolerance, atol=tolerance)


def scaled_fp16_steps(model: nn.Module, module: nn.Module, rank: int | None, steps: int) -> list[torch.Tensor]:
    """autocast to fp16 with a GradScaler, as CUDA mixed-precision training does."""
    device = next(module.parameters()).device
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    for step in range(steps):
        x, y = global_batch(RANKS, step)
        if rank is not None:
            x, y = shard(x, rank), shard(y, rank)
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x.to(device)).float(), y.to(device))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return [p.detach().cpu() for p in module.parameters()]


def train_with_grad_scaler() -> list[torch.Tensor]:
    module = make_mlp().to(this_device())
    return scaled_fp16_steps(DistributedDataParallel(module), module, dist.get_rank(), 3)


def test_autocast_fp16_with_grad_scaler_trains_as_one_process(gpu_pool: WorkerPool) -> None:
    """The scaled gradients are averaged, then unscaled by the scaler: one process's steps
    within fp16 rounding (the reference runs on this machine's device of the same type)."""
    device = torch.device(DEVICE_TYPE)
    module = make_mlp().to(device)
    expected = scaled_fp16_steps(module, module, None, 3)
    for params in gpu_pool.run(train_with_grad_scaler):
        for actual, wanted in zip(params, expected):
            torch.testing.assert_close(actual, wanted, rtol=1e-2, atol=2e-3)


def sync_batchnorm_on_device() -> tuple[torch.Tensor, torch.Tensor]:
    device, rank = this_device(), dist.get_rank()
    torch.manual_seed(0)
    layer = SyncBatchNorm(3).to(device)
    x = torch.randn(4 * RANKS, 3, 5, generator=torch.Generator().manual_seed(1))[rank * 4 : (rank + 1) * 4]
    x = x.to(device).requires_grad_(True)
    layer(x).square().sum().backward()
    return layer.running_var.cpu(), x.grad.cpu()  # type: ignore[union-attr]


def test_ddpkit_sync_batchnorm_on_the_device(gpu_pool: WorkerPool) -> None:
    torch.manual_seed(0)
    reference = nn.BatchNorm1d(3)
    x = torch.randn(4 * RANKS, 3, 5, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    reference(x).square().sum().backward()
    for rank, (running_var, grad) in enumerate(gpu_pool.run(sync_batchnorm_on_device)):
        torch.testing.assert_close(running_var, reference.running_var, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, x.grad[rank * 4 : (rank + 1) * 4], rtol=1e-4, atol=1e-5)  # type: ignore[index]


def strategy_batchnorm_class() -> type:
    s = strategy(sync_batchnorm=True, parallel_devices=[this_device()] * RANKS, process_group_backend=BACKEND)
    net = s.setup(nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3)))
    return type(s.get_model_from_plugin(net)[1])


def test_strategy_uses_torchs_sync_batchnorm_on_cuda_and_ddpkits_elsewhere(gpu_pool: WorkerPool) -> None:
    expected = nn.SyncBatchNorm if DEVICE_TYPE == "cuda" else SyncBatchNorm
    for kind in gpu_pool.run(strategy_batchnorm_class):
        assert kind is expected


def failing_forward() -> tuple[str, int | None, float]:
    """Rank 1's forward raises at the third step (inside DDP's forward, which publishes it)."""
    device = this_device()
    model = DistributedDataParallel(Flaky(failing_rank=1, failing_step=3).to(device))
    start = time.monotonic()
    try:
        for _ in range(5):
            model(torch.randn(8, 4, device=device)).sum().backward()
    except PeerFailedError as error:
        return "peer", error.rank, time.monotonic() - start
    except ValueError:
        return "own", None, time.monotonic() - start
    return "none", None, time.monotonic() - start


def test_a_failure_is_named_on_the_other_rank_before_the_timeout() -> None:
    with WorkerPool(RANKS, timeout=120, pg_timeout=20, backend=BACKEND) as pool:
        (kind0, named0, seconds0), (kind1, _, _) = pool.run(failing_forward)
    assert kind1 == "own"
    assert kind0 == "peer" and named0 == 1
    assert seconds0 < 20


def agree_without_synchronising() -> int:
    """Rank 1 raises its flag at call 10 of a loop of GPU steps; returns the call at which this
    rank was told to stop. On CUDA, torch's sync debug mode makes any operation that waits for the
    device raise (reading a CUDA tensor on the host, say); only the agreement's event is waited for."""
    from ddpkit.training.agreement import StepAgreement

    device = this_device()
    agreement, weights = StepAgreement(round_interval_seconds=0), torch.randn(256, 256, device=device)
    decided = -1
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        for call in range(40):
            weights = torch.tanh(weights @ weights)  # queued device work, never waited for here
            if agreement.decide(dist.get_rank() == 1 and call >= 10):
                decided = call
                break
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    return decided


def test_the_preemption_agreement_never_synchronises_the_device(gpu_pool: WorkerPool) -> None:
    """docs/never-lose-work.md: the host reads the agreement's result through an event."""
    stop0, stop1 = gpu_pool.run(agree_without_synchronising)
    assert stop0 == stop1 and 10 <= stop0 <= 12


def train_with_powersgd() -> tuple[dict[str, float], list[torch.Tensor]]:
    """Five steps of PowerSGD (rank 2, compressing from the second step) on this rank's device."""
    device = this_device()
    module = make_mlp().to(device)
    model = DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None)
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=1, min_compression_rate=1)
    model.register_comm_hook(state, powerSGD_hook)
    sgd_steps(model, module, dist.get_rank(), dist.get_world_size(), 5, device=None)
    return state.compression_stats(), [p.grad.cpu() for p in module.parameters()]  # type: ignore[union-attr]


def test_powersgd_compresses_on_the_device_and_every_rank_agrees(gpu_pool: WorkerPool) -> None:
    """PowerSGD's products, orthogonalisation and error feedback on CUDA tensors: the matrices were
    compressed, and every rank holds the same finite gradients."""
    (stats, reference), *others = gpu_pool.run(train_with_powersgd)
    assert stats["compressed_tensors"] > 0 and stats["compression_rate"] > 1, stats
    assert all(torch.isfinite(grad).all() for grad in reference)
    for _, grads in others:
        assert all(torch.equal(grad, wanted) for grad, wanted in zip(grads, reference))


def _real_loops() -> Any:
    import test_real_loops  # tests/ is on the path: the same loop and comparison as the CPU tests

    return test_real_loops


def _in_place_on_the_device(folder: Path, backend: str, **variables: str) -> None:
    """tests/real_loop.py (AdamW, schedules, GradScaler, EMA, SyncBatchNorm, the user's all-reduce)
    on this machine's device under ``ddpkit run --backend BACKEND --recovery in-place``, without a
    fault and with rank 1 SIGKILLed in its backward at step 5: every rank ends as without the fault."""
    loops = _real_loops()
    launcher = ("--backend", backend)
    clean = loops.run_loop(folder / "fault_free", launcher=launcher, EPOCHS="2", **variables)
    assert clean.returncode == 0, clean.stderr[-3000:]
    expected = torch.load(folder / "fault_free" / "final0.pt", weights_only=False, map_location="cpu")
    killed = loops.run_loop(folder / "killed", launcher=launcher, EPOCHS="2", KILL="backward:5", **variables)
    assert killed.returncode == 0, killed.stderr[-4000:]
    assert "recovered in place" in killed.stderr, killed.stderr[-4000:]
    loops.assert_as_without_the_fault(folder / "killed", expected, 2, killed.stderr[-3000:], tolerance=1e-6)


@pytest.mark.timeout(300)
def test_in_place_recovery_with_the_models_tensors_on_the_device(tmp_path: Path) -> None:
    """Two ranks over Gloo with CUDA tensors (sharing the GPU when there is one): the state moves from a
    survivor's device to the replacement's. Over NCCL: the test below."""
    _in_place_on_the_device(tmp_path, "gloo")


@pytest.mark.timeout(300)
@pytest.mark.skipif(BACKEND != "nccl", reason="in-place recovery over NCCL needs NCCL: one GPU per rank, "
                    f"{RANKS} ranks (GPU_TEST_BACKEND={BACKEND} here)")
def test_in_place_recovery_over_nccl(tmp_path: Path) -> None:
    """The survivors' NCCL communicators aborted, the next generation's formed, the state broadcast
    on the device (``DDPKIT_NCCL_IN_PLACE=1`` until this has passed on a device)."""
    _in_place_on_the_device(tmp_path, "nccl", **{DDPKIT_NCCL_IN_PLACE: "1"})


def overlapped_on_the_device(optimizer_name: str, overlap: bool, loop: str) -> list[torch.Tensor]:
    """Eight steps of a four-layer MLP on this rank's device, one bucket a layer, with the optimizer
    step deferred to the next forward (``overlap``) or not; this rank's final parameters and
    optimizer state, on the CPU. The reductions, copies back and per-bucket steps are queued on
    the device's streams: the mode is exact there only if each waits for the one before."""
    device = this_device()
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 16)).to(device)
    optimizer: torch.optim.Optimizer = {
        "sgd-momentum": lambda: torch.optim.SGD(inner.parameters(), lr=0.05, momentum=0.9, nesterov=True),
        "adamw": lambda: torch.optim.AdamW(inner.parameters(), lr=1e-3, weight_decay=0.1),
        "adamw-fused": lambda: torch.optim.AdamW(inner.parameters(), lr=1e-3, weight_decay=0.1, fused=True),
    }[optimizer_name]()
    model = DistributedDataParallel(inner, device_ids=[device] if device.type == "cuda" else None, bucket_cap_mb=0.5,
                                    overlap_optimizer=optimizer if overlap else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.8 ** step) if loop == "scheduler" else None
    for step in range(8):
        generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        x, y = torch.randn(32, 64, generator=generator), torch.randn(32, 16, generator=generator)
        if loop == "no_sync":  # two micro-batches, the first accumulated locally
            with model.no_sync():
                nn.functional.mse_loss(model(x[:16].to(device)), y[:16].to(device)).backward()
            x, y = x[16:], y[16:]
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        if loop == "clip":
            model.settle()  # every gradient averaged before the clip reads them
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
    model.settle()
    state = [value for entry in optimizer.state.values() for value in entry.values() if isinstance(value, torch.Tensor)]
    return [tensor.detach().cpu() for tensor in [*inner.parameters(), *state]]


@pytest.mark.parametrize(("optimizer_name", "loop"), [("sgd-momentum", "step"), ("adamw", "step"),
                                                      ("adamw-fused", "step"), ("adamw", "no_sync"),
                                                      ("adamw", "clip"), ("adamw", "scheduler")])
def test_the_overlapped_step_on_the_device_is_that_of_the_synchronous_run_bit_for_bit(
        gpu_pool: WorkerPool, optimizer_name: str, loop: str) -> None:
    """docs/ddp.md's GPU plan: overlap_optimizer on CUDA tensors gives the synchronous run's
    parameters and optimizer state exactly."""
    if optimizer_name == "adamw-fused" and DEVICE_TYPE == "cpu" and not hasattr(torch, "_fused_adamw_"):
        pytest.skip("this torch has no fused AdamW on the CPU")
    synchronous = gpu_pool.run(overlapped_on_the_device, optimizer_name, False, loop)
    overlapped = gpu_pool.run(overlapped_on_the_device, optimizer_name, True, loop)
    for sync_rank, overlap_rank in zip(synchronous, overlapped):
        assert len(sync_rank) == len(overlap_rank)
        assert all(torch.equal(a, b) for a, b in zip(sync_rank, overlap_rank))
    assert all(torch.equal(a, b) for a, b in zip(overlapped[0], overlapped[1]))
