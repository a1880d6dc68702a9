"""ddpkit's DistributedDataParallel combined with what users combine it with, against one process
on the concatenated batch: frozen parameters, sparse gradients, ..."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpkit.ddp import DistributedDataParallel
from ddpkit.testing import WorkerPool
from test_ddp import global_batch, make_mlp, shard


# --- requires_grad changed after wrapping ---------------------------------------------------------

FREEZE_SCHEDULE = {0: "2.weight", 2: None}  # step -> parameter frozen from then on (None: unfreeze all)


def apply_freeze_schedule(module: nn.Module, step: int) -> None:
    if step in FREEZE_SCHEDULE:
        frozen = FREEZE_SCHEDULE[step]
        for name, parameter in module.named_parameters():
            parameter.requires_grad_(name != frozen)


def sgd_with_freezing(model: nn.Module, module: nn.Module, world: int, rank: int | None, steps: int) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(steps):
        apply_freeze_schedule(module, step)
        x, y = global_batch(world, step)
        if rank is not None:
            x, y = shard(x, rank), shard(y, rank)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in module.parameters()]


def train_with_freezing(steps: int, use_torch_ddp: bool) -> list[torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    module = make_mlp()
    # torch's DDP needs find_unused_parameters for a parameter that stops getting gradients.
    model = (nn.parallel.DistributedDataParallel(module, find_unused_parameters=True) if use_torch_ddp
             else DistributedDataParallel(module))
    return sgd_with_freezing(model, module, world, rank, steps)


def test_a_parameter_frozen_after_wrapping_then_unfrozen_trains_as_one_process(pool: WorkerPool) -> None:
    """Frozen before the first synchronised backward (whose bucket rebuild re-hooked every
    parameter and raised), then unfrozen: the same parameters as one process, and as torch's DDP."""
    module = make_mlp()
    expected = sgd_with_freezing(module, module, pool.world_size, None, 4)
    for framework in (False, True):
        for params in pool.run(train_with_freezing, 4, framework, timeout=60):
            for actual, wanted in zip(params, expected):
                torch.testing.assert_close(actual, wanted, rtol=0, atol=1e-6)


# --- sparse gradients -------------------------------------------------------------------------------

VOCABULARY = 50


class Bag(nn.Module):
    """An EmbeddingBag with sparse gradients feeding a dense layer; ``table_rows`` adds a
    plain parameter looked up with F.embedding(sparse=True), which ddpkit cannot recognise."""

    def __init__(self, table_rows: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(VOCABULARY, 8, mode="sum", sparse=True)
        self.head = nn.Linear(8, 3)
        self.table = nn.Parameter(torch.randn(table_rows, 8)) if table_rows else None

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        features = self.bag(words)
        if self.table is not None:
            features = features + nn.functional.embedding(words, self.table, sparse=True).sum(1)
        return self.head(features)


def word_batch(world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(200 + step)
    n = 4 * world
    # Rank r's words come from its own part of the vocabulary, with repeats: the gathered rows
    # overlap only partly, and the sum must merge duplicates.
    words = torch.randint(0, VOCABULARY // 2, (n, 5), generator=generator)
    words += (torch.arange(n) // 4 % 2 * (VOCABULARY // 2)).unsqueeze(1)
    return words, torch.randn(n, 3, generator=generator)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def sparse_training(steps: int, table_rows: int, use_torch_ddp: bool,
                    dtype: torch.dtype = torch.float32) -> tuple[dict[str, str], list[torch.Tensor]]:
    with default_dtype(dtype):
        return sgd_on_bag(steps, table_rows, use_torch_ddp)


def sgd_on_bag(steps: int, table_rows: int, use_torch_ddp: bool) -> tuple[dict[str, str], list[torch.Tensor]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    module = Bag(table_rows)
    model = (nn.parallel.DistributedDataParallel(module) if use_torch_ddp else DistributedDataParallel(module))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    layouts = {}
    for step in range(steps):
        words, y = word_batch(world, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(shard(words, rank)), shard(y, rank)).backward()
        layouts = {name: str(p.grad.layout) for name, p in module.named_parameters()}
        optimizer.step()
    return layouts, [p.detach().clone() for p in module.parameters()]


def sparse_reference(world: int, steps: int, table_rows: int) -> list[torch.Tensor]:
    with default_dtype(torch.float64):
        module = Bag(table_rows)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
        for step in range(steps):
            words, y = word_batch(world, step)
            optimizer.zero_grad()
            nn.functional.mse_loss(module(words), y).backward()
            optimizer.step()
        return [p.detach().clone() for p in module.parameters()]


# 400 table elements are copied into the bucket in a batch, 24 000 one by one: both paths densify.
@pytest.mark.parametrize("table_rows", [0, VOCABULARY, 3000], ids=["EmbeddingBag", "plus-F.embedding", "plus-large-F.embedding"])
def test_sparse_gradients_train_as_one_process(pool: WorkerPool, table_rows: int) -> None:
    """Embedding weights with sparse=True keep sparse gradients (averaged as sparse); a sparse
    gradient from a module ddpkit cannot recognise is averaged densified (and comes back dense).
    In float64, so that the tolerance is tight: in float32 the sums' other order moves the
    parameters by up to 3e-5 over three steps."""
    expected = sparse_reference(pool.world_size, 3, table_rows)
    for layouts, params in pool.run(sparse_training, 3, table_rows, False, torch.float64, timeout=60):
        expected_layouts = {"bag.weight": "torch.sparse_coo", "head.weight": "torch.strided", "head.bias": "torch.strided"}
        if table_rows:
            expected_layouts["table"] = "torch.strided"
        assert layouts == expected_layouts
        for actual, wanted in zip(params, expected):
            torch.testing.assert_close(actual, wanted, rtol=0, atol=1e-12)


def test_sparse_gradients_agree_with_torch_ddp(pool2: WorkerPool) -> None:
    ours = pool2.run(sparse_training, 3, 0, False, timeout=60)
    theirs = pool2.run(sparse_training, 3, 0, True, timeout=60)
    for (our_layouts, our_params), (their_layouts, their_params) in zip(ours, theirs):
        assert our_layouts == their_layouts
        for a, b in zip(our_params, their_params):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


class SometimesEmbedding(nn.Module):
    """The embedding is looked up only when ``use``; ``gain`` always gets a gradient (a rank
    where no parameter gets one never reaches DDP's backward, with torch's DDP as with ddpkit's)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, 4, sparse=True)
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, words: torch.Tensor, use: bool) -> torch.Tensor:
        return (self.embedding(words).sum() if use else 0.0) + 0 * self.gain


def sparse_only_some_ranks(accumulate: bool) -> torch.Tensor | None:
    """Rank 0 looks nothing up in the synchronised step; with ``accumulate`` every rank first
    accumulates one step inside no_sync."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(SometimesEmbedding())
    words = torch.arange(world * 3).view(world, 3) % VOCABULARY
    if accumulate:
        with model.no_sync():
            model(words[rank], True).backward()
    model(words[rank] + 10, rank != 0).backward()
    grad = model.module.embedding.weight.grad
    return None if grad is None else grad.to_dense()


@pytest.mark.parametrize("accumulate", [False, True], ids=["one-step", "after-no_sync"])
def test_a_rank_without_a_sparse_gradient_contributes_zeros(pool: WorkerPool, accumulate: bool) -> None:
    world = pool.world_size
    expected = torch.zeros(VOCABULARY, 4)
    words = torch.arange(world * 3).view(world, 3) % VOCABULARY
    for rank in range(world):
        if accumulate:
            expected[words[rank]] += 1 / world
        if rank != 0:
            expected[words[rank] + 10] += 1 / world
    for grad in pool.run(sparse_only_some_ranks, accumulate, timeout=60):
        torch.testing.assert_close(grad, expected)


class OnlyEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, 4, sparse=True)

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        return self.embedding(words).sum()


def sparse_only_model() -> torch.Tensor:
    rank = dist.get_rank()
    model = DistributedDataParallel(OnlyEmbedding())
    model(torch.tensor([rank, rank, 7])).backward()
    return model.module.embedding.weight.grad.to_dense()


def test_a_model_whose_only_parameter_is_sparse_is_synchronised(pool2: WorkerPool) -> None:
    expected = torch.zeros(VOCABULARY, 4)
    expected[0] = expected[1] = 1.0  # rank r looks its row up twice; averaged over 2 ranks
    expected[7] = 1.0
    for grad in pool2.run(sparse_only_model, timeout=60):
        torch.testing.assert_close(grad, expected)


def sparse_unused_everywhere() -> bool:
    model = DistributedDataParallel(Bag())
    words, y = word_batch(dist.get_world_size(), 0)
    model.module.head(torch.randn(2, 8)).sum().backward()  # the embedding takes no part
    return model.module.bag.weight.grad is None


def test_a_sparse_parameter_no_rank_used_keeps_no_gradient(pool2: WorkerPool) -> None:
    assert pool2.run(sparse_unused_everywhere, timeout=60) == [True, True]


def join_with_sparse() -> str:
    model = DistributedDataParallel(Bag())
    with pytest.raises(ValueError) as error:
        with model.join():
            pass
    return str(error.value)


def test_join_refuses_sparse_gradients_by_name(pool2: WorkerPool) -> None:
    for message in pool2.run(join_with_sparse, timeout=60):
        assert "sparse gradients" in message and "even_batches" in message


# --- gradient accumulation with no_sync -------------------------------------------------------------


class TwoHeads(nn.Module):
    """``second`` is used in the first micro-batch only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 3)
        self.second = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, use_second: bool) -> torch.Tensor:
        return self.first(x) + self.second(x) if use_second else self.first(x)


MICRO_BATCHES = 3


def accumulate_then_sync(static_graph: bool) -> dict[str, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(TwoHeads(), static_graph=static_graph)
    for micro in range(MICRO_BATCHES):
        x, y = global_batch(world, micro)
        loss = nn.functional.mse_loss(model(shard(x, rank), micro == 0), shard(y, rank))
        if micro < MICRO_BATCHES - 1:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()
    return {name: p.grad.clone() for name, p in model.module.named_parameters()}


@pytest.mark.parametrize("static_graph", [False, True], ids=["negotiated", "static_graph"])
def test_a_parameter_unused_in_the_last_micro_batch_is_still_averaged(pool: WorkerPool, static_graph: bool) -> None:
    """torch issue 69031 (find_unused_parameters lost such a gradient; fixed in torch 2.13), and
    static_graph=True with no_sync (torch 2.13 fails an internal assert, torch PR 187732)."""
    module = TwoHeads()
    for micro in range(MICRO_BATCHES):
        x, y = global_batch(pool.world_size, micro)
        nn.functional.mse_loss(module(x, micro == 0), y).backward()
    expected = {name: p.grad for name, p in module.named_parameters()}
    for grads in pool.run(accumulate_then_sync, static_graph, timeout=60):
        for name in expected:
            torch.testing.assert_close(grads[name], expected[name], rtol=1e-5, atol=1e-7)
