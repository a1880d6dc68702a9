"""ddpkit's DistributedDataParallel combined with what users combine it with, against one process
on the concatenated batch: frozen parameters, sparse gradients, ..."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from helpers import global_batch, grads_of, make_mlp, sgd_on_shards, shard
from torch import nn

from ddpkit.parallel.ddp import DistributedDataParallel
from ddpkit.testing import WorkerPool

# --- requires_grad changed after wrapping ---------------------------------------------------------

FREEZE_SCHEDULE = {0: "2.weight", 2: None}  # step -> parameter frozen from then on (None: unfreeze all)


def apply_freeze_schedule(module: nn.Module, step: int) -> None:
    if step in FREEZE_SCHEDULE:
        frozen = FREEZE_SCHEDULE[step]
        for name, parameter in module.named_parameters():
            parameter.requires_grad_(name != frozen)


def sgd_with_freezing(model: nn.Module, module: nn.Module, world: int, rank: int | None, steps: int) -> list[torch.Tensor]:
    return sgd_on_shards(model, module, world, rank, steps, before_step=lambda step: apply_freeze_schedule(module, step))


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


# --- autocast, bf16 and mixed-dtype parameters ------------------------------------------------------

# bf16 keeps 8 significant bits (eps 2**-8). Sharded and whole-batch training round different
# partial sums; a few such roundings, relative to each gradient's largest magnitude.
BF16_SCALE_TOL = 4 * 2**-8


class LowPrecisionMLP(nn.Module):
    """make_mlp's layers, run under CPU autocast, all in bf16, or with the middle layer in bf16."""

    def __init__(self, precision: str) -> None:
        super().__init__()
        self.layers = make_mlp()
        self.precision = precision
        if precision == "bf16":
            self.layers.to(torch.bfloat16)
        elif precision == "mixed":
            self.layers[2].to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, tanh, middle, _, last = self.layers
        if self.precision == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.layers(x).float()
        if self.precision == "bf16":
            return self.layers(x.bfloat16()).float()
        hidden = torch.tanh(middle(tanh(first(x)).bfloat16())).float()  # mixed: bf16 in the middle only
        return last(hidden)


def low_precision_grads(precision: str, bucket_cap_mb: float, use_torch_ddp: bool) -> dict[str, torch.Tensor | None]:
    rank, world = dist.get_rank(), dist.get_world_size()
    module = LowPrecisionMLP(precision)
    model = (nn.parallel.DistributedDataParallel(module) if use_torch_ddp
             else DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb))
    x, y = global_batch(world)
    nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
    return grads_of(module)


@pytest.mark.parametrize("precision", ["autocast", "bf16", "mixed"])
@pytest.mark.parametrize("bucket_cap_mb", [25, 0.001], ids=["one_bucket", "bucket_per_parameter"])
def test_autocast_bf16_and_mixed_dtype_parameters_match_one_process(pool: WorkerPool, precision: str,
                                                                   bucket_cap_mb: float) -> None:
    """Each gradient keeps its parameter's dtype (buckets hold one dtype each), equals one process on
    the concatenated batch within bf16's rounding, and torch's DDP within two bf16 roundings."""
    module = LowPrecisionMLP(precision)
    x, y = global_batch(pool.world_size)
    nn.functional.mse_loss(module(x), y).backward()
    expected = grads_of(module)
    ours = pool.run(low_precision_grads, precision, bucket_cap_mb, False, timeout=60)
    torchs = pool.run(low_precision_grads, precision, bucket_cap_mb, True, timeout=60)
    for grads, torch_grads in zip(ours, torchs):
        for name, wanted in expected.items():
            assert wanted is not None and grads[name] is not None and torch_grads[name] is not None
            assert grads[name].dtype == wanted.dtype, name
            scale = wanted.float().abs().max().item()
            torch.testing.assert_close(grads[name].float(), wanted.float(), rtol=0, atol=BF16_SCALE_TOL * scale)
            # Scaling by 1/3 and summing round in another order than torch's Reducer: two roundings.
            two_roundings = 2 * 2**-8 * scale if wanted.dtype == torch.bfloat16 else 1e-6 * scale
            torch.testing.assert_close(grads[name].float(), torch_grads[name].float(), rtol=0, atol=two_roundings)


# --- tied weights -------------------------------------------------------------------------------------


class TiedLanguageModel(nn.Module):
    """The output projection is the embedding table (weight tying, as in GPT-2)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCABULARY, 8)
        self.hidden = nn.Linear(8, 8)
        self.output = nn.Linear(8, VOCABULARY, bias=False)
        self.output.weight = self.embedding.weight

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        return self.output(torch.tanh(self.hidden(self.embedding(words))))


BATCH = 4


def tied_words(world: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCABULARY, (BATCH * world,), generator=torch.Generator().manual_seed(step))


def sgd_on_tied(model: nn.Module, module: TiedLanguageModel, rank: int | None, world: int, steps: int) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    for step in range(steps):
        words = tied_words(world, step)
        if rank is not None:
            words = words[rank * BATCH : (rank + 1) * BATCH]
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(words), words).backward()
        optimizer.step()
    return [p.detach().clone() for p in module.parameters()]


def train_tied(steps: int, use_torch_ddp: bool) -> tuple[list[torch.Tensor], bool]:
    rank, world = dist.get_rank(), dist.get_world_size()
    module = TiedLanguageModel()
    model = nn.parallel.DistributedDataParallel(module) if use_torch_ddp else DistributedDataParallel(module)
    params = sgd_on_tied(model, module, rank, world, steps)
    return params, module.output.weight is module.embedding.weight


def test_tied_weights_are_one_parameter_summing_both_uses(pool: WorkerPool) -> None:
    """A tied parameter is synchronised once, with the gradient of both its uses (as one process);
    it stays tied."""
    module = TiedLanguageModel()
    expected = sgd_on_tied(module, module, None, pool.world_size, 3)
    for use_torch_ddp in (False, True):
        for params, still_tied in pool.run(train_tied, 3, use_torch_ddp, timeout=60):
            assert still_tied
            assert len(params) == len(expected)  # the tied table counted once
            for actual, wanted in zip(params, expected):
                torch.testing.assert_close(actual, wanted, rtol=0, atol=1e-6)


# --- determinism ---------------------------------------------------------------------------------------


def seeded_training(hook_name: str, bucket_cap_mb: float) -> list[torch.Tensor]:
    """Five SGD steps from seed 0 on a model large enough that Gloo splits its all-reduce in chunks."""
    from ddpkit.hooks import allreduce_hook, fp16_compress_hook

    rank = dist.get_rank()
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 8))
    model = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
    hooks = {"allreduce": allreduce_hook, "fp16": fp16_compress_hook}
    if hook_name in hooks:
        model.register_comm_hook(None, hooks[hook_name])
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(5):
        generator = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(16, 64, generator=generator), torch.randn(16, 8, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("bucket_cap_mb", [25, 0.1], ids=["one_bucket", "several_buckets"])
def test_the_same_seed_gives_bitwise_identical_parameters(pool: WorkerPool, bucket_cap_mb: float) -> None:
    """Two runs agree bit for bit, on every rank, with and without a hook; ddpkit's allreduce_hook
    is bit-identical to no hook (the same buffer, flags included, so Gloo chunks it the same)."""
    runs = {hook: [pool.run(seeded_training, hook, bucket_cap_mb, timeout=60) for _ in range(2)]
            for hook in ("none", "allreduce", "fp16")}
    for hook, (first, second) in runs.items():
        for rank_params in (*first, *second):
            for actual, wanted in zip(rank_params, first[0]):
                assert torch.equal(actual, wanted), hook
    for actual, wanted in zip(runs["allreduce"][0][0], runs["none"][0][0]):
        assert torch.equal(actual, wanted)


# --- torch.compile ------------------------------------------------------------------------------------

# "aot_eager" runs what matters to DDP (Dynamo's graph capture and AOTAutograd's compiled backward,
# which delivers gradients differently from eager autograd) without inductor's C++ code generation,
# which takes minutes on a 2-core machine; benchmarks/compile_step.py measures inductor.
COMPILE_BACKEND = "aot_eager"


class OwnMLP(nn.Module):
    """A module of the user's own: torch.compile(ddp_model) compiles the wrapped module's forward,
    as for torch's DDP (whose forward Dynamo skips too); torch's own containers met first would be
    skipped, so users compile inside for those."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = make_mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def compiled_training(where: str, steps: int) -> tuple[list[torch.Tensor], int]:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    module = OwnMLP()
    counter = CompileCounterWithBackend(COMPILE_BACKEND)
    if where == "inside":
        model = DistributedDataParallel(torch.compile(module, backend=counter))
    else:
        model = torch.compile(DistributedDataParallel(module), backend=counter)
    return sgd_on_shards(model, module, world, rank, steps), counter.frame_count


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_torch_compile_inside_or_outside_trains_as_one_process(pool: WorkerPool, where: str) -> None:
    """DistributedDataParallel(torch.compile(module)) and torch.compile(DistributedDataParallel(module)):
    the parameters of one process after 3 steps, and the module compiled as one graph (no graph break)."""
    module = OwnMLP()
    expected = sgd_on_shards(module, module, pool.world_size, None, 3)
    for params, graphs in pool.run(compiled_training, where, 3, timeout=120):
        assert graphs == 1
        for actual, wanted in zip(params, expected):
            torch.testing.assert_close(actual, wanted, rtol=0, atol=1e-6)


def compiled_step_training(hook: str, compiled_autograd: bool = True) -> list[torch.Tensor] | str:
    """Steps whose forward, loss and backward are one compiled function, with compiled autograd on
    (the backward traced into a graph, ddpkit's hooks with it) or off (the backward runs eagerly
    from the compiled function): three plain steps, then one of two micro-batches, the first
    under no_sync. The parameters, or the error's text."""
    from ddpkit.diagnostics.debug import set_debug
    from ddpkit.hooks import fp16_compress_hook

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    module = OwnMLP()

    def all_reduce_average(tensors: list[torch.Tensor], group: object) -> None:
        for tensor in tensors:
            dist.all_reduce(tensor.div_(world), group=group)

    model = DistributedDataParallel(module, reduce_function=all_reduce_average if hook == "reduce_function" else None)
    if hook == "fp16":
        model.register_comm_hook(None, fp16_compress_hook)
    if hook == "one-argument":
        model.register_comm_hook(lambda ddp_module: None)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    torch._dynamo.config.compiled_autograd = compiled_autograd  # read when the function is compiled: set before
    try:
        stack = contextlib.ExitStack()
        if hook == "join":
            stack.enter_context(model.join())
        if hook == "debug":
            set_debug(True)
            stack.callback(set_debug, None)
        @torch.compile(backend=COMPILE_BACKEND)
        def forward_backward(x: torch.Tensor, y: torch.Tensor) -> None:
            nn.functional.mse_loss(model(x), y).backward()

        with stack:
            for step in range(4):
                optimizer.zero_grad()
                x, y = global_batch(world, step)
                if step == 3:
                    with model.no_sync():
                        forward_backward(shard(x, rank), shard(y, rank))
                    x, y = global_batch(world, step + 1)
                forward_backward(shard(x, rank), shard(y, rank))
                optimizer.step()
    except NotImplementedError as error:
        return str(error)
    finally:
        torch._dynamo.config.compiled_autograd = False
        torch._dynamo.reset()
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("compiled_autograd", [True, False], ids=["compiled-autograd", "eager-backward"])
def test_a_compiled_step_with_its_backward_trains_as_one_process(pool: WorkerPool, compiled_autograd: bool) -> None:
    """torch._dynamo.config.compiled_autograd traces the backward, and DDP's hooks, into a graph:
    the end-of-backward callback ddpkit's eager reducer uses is not allowed there (torch's internal
    AssertionError before), so each gradient is averaged by a functional all-reduce inside the graph.
    Without it, the backward runs eagerly from the compiled function, and Dynamo compiled the hooks'
    callees one by one (an InternalTorchDynamoError on the process group before): they run outside
    Dynamo. The same parameters as one process on the whole batches, no_sync's accumulation included."""
    module = OwnMLP()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(4):
        optimizer.zero_grad()
        for micro in ([step] if step < 3 else [3, 4]):
            x, y = global_batch(pool.world_size, micro)
            nn.functional.mse_loss(module(x), y).backward()
        optimizer.step()
    for params in pool.run(compiled_step_training, "none", compiled_autograd, timeout=180):
        assert not isinstance(params, str), params
        for actual, wanted in zip(params, module.parameters()):
            torch.testing.assert_close(actual, wanted.detach(), rtol=0, atol=1e-6)


def compiled_autograd_step_with_sparse_gradients() -> str:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Embedding(10, 4, sparse=True))
    torch._dynamo.config.compiled_autograd = True
    try:
        @torch.compile(backend=COMPILE_BACKEND)
        def forward_backward(words: torch.Tensor) -> None:
            model(words).sum().backward()

        forward_backward(torch.tensor([1, 2, 3]))
    except NotImplementedError as error:
        return str(error)
    finally:
        torch._dynamo.config.compiled_autograd = False
        torch._dynamo.reset()
    return "not refused"


def test_a_compiled_autograd_backward_refuses_sparse_gradients(pool2: WorkerPool) -> None:
    for text in pool2.run(compiled_autograd_step_with_sparse_gradients, timeout=180):
        assert "compiled autograd" in text and "sparse gradients of 1 embedding weight(s)" in text, text


@pytest.mark.parametrize(("setting", "named"), [
    ("fp16", "the comm hook fp16_compress_hook"), ("reduce_function", "reduce_function"),
    ("one-argument", "a one-argument comm hook"), ("join", "DistributedDataParallel.join()"),
    ("debug", "debug mode (DDPKIT_DEBUG"),
])
def test_a_compiled_autograd_backward_refuses_what_cannot_run_in_its_graph_naming_it(
        pool2: WorkerPool, setting: str, named: str) -> None:
    for text in pool2.run(compiled_step_training, setting, timeout=180):
        assert isinstance(text, str) and "compiled autograd" in text and named in text, text


class OwnNormalised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear, self.norm = nn.Linear(6, 4), nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


def running_mean_after_compiled_autograd_steps() -> torch.Tensor:
    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(OwnNormalised())
    torch._dynamo.config.compiled_autograd = True
    try:
        @torch.compile(backend=COMPILE_BACKEND)
        def forward_backward(x: torch.Tensor) -> None:
            model(x).square().mean().backward()

        for step in range(2):
            forward_backward(shard(global_batch(world, step)[0], rank))  # each rank's own batch statistics
    finally:
        torch._dynamo.config.compiled_autograd = False
        torch._dynamo.reset()
    model.eval()
    model(torch.zeros(2, 6))  # an evaluation forward does not change the statistics
    return model.module.norm.running_mean.clone()


def test_after_a_compiled_autograd_backward_buffers_are_broadcast_before_the_next_forward(pool: WorkerPool) -> None:
    means = pool.run(running_mean_after_compiled_autograd_steps, timeout=180)
    assert all(torch.equal(mean, means[0]) for mean in means) and means[0].abs().sum() > 0


class IndexedTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(words))


def compiled_step_failing_on_rank_one() -> tuple[str, str, int | None]:
    """An error inside the compiled graph (an index out of range) on rank 1 at the third step."""
    from ddpkit.diagnostics.failures import PeerFailedError

    rank = dist.get_rank()
    model = torch.compile(DistributedDataParallel(IndexedTable()), backend=COMPILE_BACKEND)
    try:
        for step in range(5):
            words = torch.randint(0, 10, (8,))
            if rank == 1 and step == 2:
                words[0] = 50
            model(words).sum().backward()
    except PeerFailedError as error:
        return "peer", str(error), error.rank
    except IndexError as error:
        return "own", str(error), None
    return "none", "", None


def test_an_error_inside_a_compiled_ddp_module_is_named_on_the_other_ranks() -> None:
    """guard() runs outside the compiled graph: traced into it, its except clause never ran, and
    rank 0 waited for the timeout and reported only its own stuck reduction."""
    with WorkerPool(2, timeout=120, pg_timeout=5) as pool:
        (kind0, text0, named0), (kind1, text1, _) = pool.run(compiled_step_failing_on_rank_one)
    assert kind1 == "own" and "index out of range" in text1
    assert kind0 == "peer" and named0 == 1, (kind0, text0)
    assert text0.startswith("rank 1 failed: IndexError: index out of range")
