"""init_dist_connection over real TCP (env://) and against an existing group; comm hooks on torch DDP."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ddpkit.distributed import init_dist_connection, register_ddp_comm_hook
from ddpkit.environments import LocalEnvironment, find_free_port
from ddpkit.testing import WorkerPool

# numpy is blocked, as on a fresh machine: torch does not depend on it (broadcast_object_list does).
CONNECT = textwrap.dedent(
    """
    import sys
    sys.modules["numpy"] = None
    import torch
    from ddpkit.distributed import broadcast_object, destroy_dist_connection, init_dist_connection, sync_ddp
    from ddpkit.environments import detect_environment
    env = detect_environment()
    init_dist_connection(env)
    total = sync_ddp(torch.tensor([env.global_rank() + 1.0])).item()
    message = broadcast_object({"from": env.global_rank()}, src=1)
    print(f"rank {env.global_rank()} of {env.world_size()} total {total} message {message}", flush=True)
    destroy_dist_connection()
    """
)


def test_two_processes_connect_through_the_environment() -> None:
    port = find_free_port()
    processes = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
               "RANK": str(rank), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"}
        processes.append(subprocess.Popen([sys.executable, "-c", CONNECT], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=60)[0])
    finally:
        for process in processes:
            process.kill()
    assert [p.returncode for p in processes] == [0, 0], outputs
    assert "rank 0 of 2 total 3.0 message {'from': 1}" in outputs[0]
    assert "rank 1 of 2 total 3.0 message {'from': 1}" in outputs[1]


def connect_again(world_size: int) -> str:
    rank = dist.get_rank()
    env = LocalEnvironment({"WORLD_SIZE": str(world_size), "RANK": str(rank), "MASTER_PORT": "1"})
    try:
        init_dist_connection(env, "gloo")
    except RuntimeError as error:
        return str(error)
    return "kept"


def test_existing_group_is_kept_or_the_difference_is_named(pool2: WorkerPool) -> None:
    assert pool2.run(connect_again, 2, timeout=30) == ["kept", "kept"]
    for message in pool2.run(connect_again, 3, timeout=30):
        assert "world_size: existing 2, requested 3" in message


def counting_wrapper(hook):  # type: ignore[no-untyped-def]
    def wrapped(state, bucket):  # type: ignore[no-untyped-def]
        state["calls"] += 1
        return hook(None, bucket)

    return wrapped


def torch_ddp_with_hook(use_hook: bool) -> tuple[list[float], int]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    state = {"calls": 0}
    if use_hook:
        register_ddp_comm_hook(model, ddp_comm_state=state, ddp_comm_hook=default_hooks.allreduce_hook,
                               ddp_comm_wrapper=counting_wrapper)
    x = torch.arange(8.0).reshape(2, 4) * (rank + 1)
    model(x).pow(2).sum().backward()
    return model.module.weight.grad.flatten().tolist(), state["calls"]


def test_register_ddp_comm_hook_on_torch_ddp(pool2: WorkerPool) -> None:
    plain = pool2.run(torch_ddp_with_hook, False, timeout=30)
    hooked = pool2.run(torch_ddp_with_hook, True, timeout=30)
    assert [grad for grad, _ in hooked] == [grad for grad, _ in plain]
    assert all(calls >= 1 for _, calls in hooked)


def test_gloo_keeps_its_default_interface_on_one_host_and_when_the_master_does_not_resolve() -> None:
    from ddpkit._network import gloo_interface_towards

    # (The choice of a real interface is tested across network namespaces in test_example.py.)
    assert gloo_interface_towards("127.0.0.1", 29500) is None
    assert gloo_interface_towards("no-such-host.invalid", 29500) is None
