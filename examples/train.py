"""Train a small classifier on synthetic data with N processes, using ddpkit's collectives.

    python examples/train.py --nprocs 2

Each process trains on its own shard of every batch; after each backward the gradients are
averaged with one ``sync_ddp`` over a flat buffer, so every rank takes the same step. At the
end the script checks, with ``gather_all_tensors``, that all ranks hold identical parameters,
and (``--check-reference``, on by default) that they match one process trained on the
concatenated batches. The data are generated from a fixed seed: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from ddpkit.distributed import (
    broadcast_object,
    destroy_dist_connection,
    gather_all_tensors,
    init_dist_connection,
    sync_ddp,
)
from ddpkit.environments import LocalEnvironment, environment_variables

FEATURES, CLASSES = 32, 4


def synthetic_dataset(samples: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Points labelled by a fixed random 'teacher' network: learnable, deterministic."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    labels = (torch.tanh(inputs) @ teacher).argmax(dim=1)
    return inputs, labels


def make_model() -> nn.Module:
    torch.manual_seed(1234)  # the same initial parameters in every process
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES))


def average_gradients(model: nn.Module) -> None:
    """One all-reduce of all gradients, packed into a flat buffer (one message, not one per tensor)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    averaged = sync_ddp(torch.cat([g.flatten() for g in grads]), reduce_op="mean")
    for grad, chunk in zip(grads, averaged.split([g.numel() for g in grads])):
        grad.copy_(chunk.view_as(grad))


def train(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, args: argparse.Namespace,
          rank: int, world_size: int, verbose: bool) -> tuple[float, float]:
    """Train; rank ``rank`` of ``world_size`` takes its contiguous share of every global batch.

    Returns the elapsed seconds and the throughput of the whole job in samples per second.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    local = args.batch_size // world_size
    start = time.perf_counter()
    for epoch in range(args.epochs):
        loss_sum, correct, seen = torch.zeros(()), torch.zeros(()), 0
        for first in range(0, len(inputs), args.batch_size):
            x = inputs[first + rank * local : first + (rank + 1) * local]
            y = labels[first + rank * local : first + (rank + 1) * local]
            optimizer.zero_grad()
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            if world_size > 1:
                average_gradients(model)
            optimizer.step()
            loss_sum += loss.detach() * len(y)
            correct += (logits.argmax(dim=1) == y).sum()
            seen += len(y)
        totals = sync_ddp(torch.stack([loss_sum, correct.float(), torch.tensor(float(seen))])) if world_size > 1 \
            else torch.stack([loss_sum, correct.float(), torch.tensor(float(seen))])
        if verbose:
            print(f"epoch {epoch + 1}/{args.epochs}  loss {totals[0] / totals[2]:.4f}  "
                  f"accuracy {totals[1] / totals[2]:.3f}", flush=True)
    elapsed = time.perf_counter() - start
    return elapsed, args.epochs * len(inputs) / elapsed


def worker(local_rank: int, args: argparse.Namespace) -> None:
    """One process of the job: environment -> connection -> training -> checks -> teardown."""
    os.environ["LOCAL_RANK"] = os.environ["RANK"] = str(local_rank)
    torch.set_num_threads(1)
    environment = LocalEnvironment()
    init_dist_connection(environment, "gloo")
    rank, world_size = environment.global_rank(), environment.world_size()
    try:
        inputs, labels = synthetic_dataset(args.samples)
        model = make_model()
        _, throughput = train(model, inputs, labels, args, rank, world_size, verbose=rank == 0)

        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        identical = all(torch.equal(flat, other) for other in gather_all_tensors(flat))
        difference = None
        if rank == 0 and args.check_reference:
            reference = make_model()
            train(reference, inputs, labels, args, rank=0, world_size=1, verbose=False)
            ref_flat = torch.cat([p.detach().flatten() for p in reference.parameters()])
            difference = (flat - ref_flat).abs().max().item()
        difference = broadcast_object(difference)
        if rank == 0:
            reference_note = "" if difference is None else f", max |difference| to one process {difference:.2e}"
            print(f"done: {throughput:.0f} samples/s over {world_size} processes, "
                  f"parameters identical on all ranks: {identical}{reference_note}", flush=True)
        if not identical or (difference is not None and difference > 1e-4):
            raise SystemExit(f"rank {rank}: the ranks disagree or differ from the single-process reference")
    finally:
        destroy_dist_connection()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=2, help="number of processes (default 2)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch, split across processes")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--no-check-reference", dest="check_reference", action="store_false",
                        help="skip the comparison with single-process training")
    args = parser.parse_args()
    if args.nprocs < 1 or args.batch_size % args.nprocs:
        parser.error(f"--batch-size={args.batch_size} must split evenly over --nprocs={args.nprocs} (>= 1)")

    # Choose the address and a free port once, here; the workers inherit them.
    environment = LocalEnvironment({"WORLD_SIZE": str(args.nprocs)})
    os.environ.update({key: value for key, value in environment_variables(environment).items()
                       if key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")})
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=worker, args=(rank, args)) for rank in range(args.nprocs)]
    for process in processes:
        process.start()
    failed = _wait_for_all(processes)
    if failed:
        rank, code = failed
        how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        print(f"rank {rank} {how}; the other processes were stopped", file=sys.stderr)
        sys.exit(1)


def _wait_for_all(processes: list) -> tuple[int, int] | None:  # type: ignore[type-arg]
    """Wait for every process; at the first failure stop the rest and return (rank, exit code)."""
    from multiprocessing.connection import wait

    remaining = dict(enumerate(processes))
    while remaining:
        for sentinel in wait([p.sentinel for p in remaining.values()]):
            rank = next(r for r, p in remaining.items() if p.sentinel == sentinel)
            process = remaining.pop(rank)
            process.join()
            if process.exitcode != 0:
                for other in remaining.values():
                    other.kill()
                return rank, int(process.exitcode or 0)
    return None


if __name__ == "__main__":
    main()
