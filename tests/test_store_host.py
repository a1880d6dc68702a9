"""The store a launcher hosts (``launching.store_host``) and what the workers are told about it:
torchrun's variables, so that torch's ``env://`` connects to the launcher's store instead of
serving another on its port, and the workers' keys cleared before they start again, so that a
restarted plain torch script never reads a peer's address from the attempt before (issue 30)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch.distributed as dist

from ddpkit.environments import Recovery, find_free_port
from ddpkit.launching.config import LaunchConfig
from ddpkit.launching.rendezvous import Endpoint, RendezvousSettings
from ddpkit.launching.store_host import StoreHost, StoreHostError
from ddpkit.launching.worker_environment import rank_variables

# What torchrun 2.13's agent gives every worker (local_elastic_agent._start_workers), NCCL's setting aside.
TORCHRUN_VARIABLES = {"RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                      "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                      "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"}


@pytest.mark.parametrize(("config", "agent_store"), [
    (LaunchConfig(nproc_per_node=2), "False"),  # rank 0 serves the store, as without a launcher
    (LaunchConfig(nproc_per_node=2, nnodes=2, node_rank=1, master_port=29500), "False"),
    (LaunchConfig(nproc_per_node=2, nnodes=2, node_rank=1, master_port=29500, max_restarts=1), "True"),
    (LaunchConfig(nproc_per_node=2, recovery=Recovery.IN_PLACE, max_restarts=1), "True"),
    (LaunchConfig(nproc_per_node=2, nnodes=2, rendezvous=RendezvousSettings(Endpoint("127.0.0.1", 29400), "job7")),
     "True"),
], ids=["one-node", "static-nodes", "static-nodes-restarts", "in-place", "c10d"])
def test_workers_get_torchruns_variables_and_are_told_who_serves_the_store(config: LaunchConfig,
                                                                          agent_store: str) -> None:
    variables = rank_variables(config, 29500, local_rank=1, restart_count=1)
    assert TORCHRUN_VARIABLES <= set(variables)
    rank = str(config.node_rank * 2 + 1)
    assert (variables["RANK"], variables["ROLE_RANK"], variables["GROUP_RANK"]) == (rank, rank, str(config.node_rank))
    assert variables["GROUP_WORLD_SIZE"] == str(config.nnodes)
    assert variables["ROLE_WORLD_SIZE"] == variables["WORLD_SIZE"] == str(2 * config.nnodes)
    assert variables["TORCHELASTIC_USE_AGENT_STORE"] == agent_store
    assert variables["TORCHELASTIC_RUN_ID"] == (config.rendezvous.run_id if config.rendezvous else "none")


def test_the_store_host_clears_the_workers_keys_and_keeps_the_launchers() -> None:
    port = find_free_port()
    host = StoreHost("127.0.0.1", port, os.environ)
    try:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        dist.PrefixStore("default_pg/0//cpu", client).set("rank_1", "an address of the attempt before")
        client.set("ddpkit/attempt/0/generation/0/arrived", "2")
        client.set("ddpkit/launchers/attempt/0/failed", "1")
        client.set("ddpkit/rendezvous/id", "job7")
        assert host.clear_worker_keys() == 2
        assert sorted(client.list_keys()) == ["ddpkit/launchers/attempt/0/failed", "ddpkit/rendezvous/id"]
        assert host.failure() is None
    finally:
        host.stop()
    assert "was killed by signal SIGKILL" in str(host.failure())


def test_the_launcher_waits_for_its_store_host_to_serve_and_hears_when_it_cannot() -> None:
    """The launcher that hosts a rendezvous waits for its store host apart from join_timeout (a
    test of 2 s failed on a loaded machine while the host still imported torch)."""
    port = find_free_port()
    host = StoreHost("127.0.0.1", port, os.environ)
    try:
        host.wait_serving(60)
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1))
        client.set("answered", "at once")  # within a second: the store serves
    finally:
        host.stop()
    taken = StoreHost("127.0.0.1", port, os.environ)  # the port is free again: hold it
    try:
        taken.wait_serving(60)
        broken = StoreHost("127.0.0.1", port, os.environ)
        with pytest.raises(StoreHostError, match="exited with code 1: .*EADDRINUSE"):
            broken.wait_serving(60)
        broken.stop()
    finally:
        taken.stop()
