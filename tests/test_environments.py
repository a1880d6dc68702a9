"""Cluster environments read from plain dicts: good values, bad values, every scheduler."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from ddpkit.environments import (
    ClusterEnvironment,
    KubeflowEnvironment,
    LocalEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
    detect_environment,
    environment_variables,
    expand_slurm_nodelist,
)
from ddpkit.variables import DDPKIT_LAUNCHED


def summary(env: ClusterEnvironment) -> tuple:
    return (env.main_address, env.main_port, env.world_size(), env.global_rank(), env.local_rank(),
            env.node_rank(), env.creates_processes_externally)


# --- Local ---------------------------------------------------------------------------------


def test_local_defaults_to_one_process_and_no_port() -> None:
    env = LocalEnvironment({})
    assert (env.main_address, env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (
        "127.0.0.1", 1, 0, 0, 0)
    assert env.main_port == 0  # not chosen: one process meets no one; a launcher gives processes theirs
    assert env.creates_processes_externally is False
    assert env.backend is None


def test_local_reads_the_launchers_backend() -> None:
    assert LocalEnvironment({"DDPKIT_BACKEND": "gloo", "MASTER_PORT": "29500"}).backend == "gloo"


def test_local_reads_torch_variables() -> None:
    env = LocalEnvironment({"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29501", "WORLD_SIZE": "4", "RANK": "3",
                            "LOCAL_RANK": "1", "NODE_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert summary(env) == ("10.0.0.5", 29501, 4, 3, 1, 1, True)


def test_local_derives_rank_from_node_and_local_rank() -> None:
    env = LocalEnvironment({"WORLD_SIZE": "4", "LOCAL_RANK": "1", "NODE_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                            "MASTER_PORT": "29500"})
    assert env.global_rank() == 3


def test_getters_do_not_write_the_environment() -> None:
    env_vars: dict[str, str] = {}
    env = LocalEnvironment(env_vars)
    _ = (env.main_address, env.main_port, env.world_size(), env.global_rank())
    assert env_vars == {}


def test_environment_variables_export() -> None:
    env = LocalEnvironment({"MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "1"})
    assert environment_variables(env) == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2",
                                          "RANK": "1", "LOCAL_RANK": "0", "NODE_RANK": "0"}


@pytest.mark.parametrize(
    ("variables", "names"),
    [
        ({"WORLD_SIZE": "2", "RANK": "2"}, ["RANK=2", "WORLD_SIZE=2", "0..1"]),
        ({"WORLD_SIZE": "2", "RANK": "-1"}, ["RANK=-1", ">= 0"]),
        ({"WORLD_SIZE": "two"}, ["WORLD_SIZE='two'", "not an integer"]),
        ({"WORLD_SIZE": "0"}, ["WORLD_SIZE=0", ">= 1"]),
        ({"MASTER_PORT": "http"}, ["MASTER_PORT='http'", "TCP port"]),
        ({"MASTER_PORT": "70000"}, ["MASTER_PORT=70000", "1..65535"]),
        ({"WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, ["LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"]),
        ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "3"}, ["LOCAL_WORLD_SIZE=3", "WORLD_SIZE=2"]),
    ],
)
def test_local_rejects_bad_values_naming_variable_and_value(variables: dict[str, str], names: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        LocalEnvironment({"MASTER_PORT": "29500", **variables})
    for name in names:
        assert name in str(info.value)


# --- torchrun --------------------------------------------------------------------------------

TORCHRUN = {"MASTER_ADDR": "node0", "MASTER_PORT": "29400", "WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1",
            "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "abc"}


def test_torchelastic_reads_torchrun_variables() -> None:
    assert TorchElasticEnvironment.detect(TORCHRUN)
    assert summary(TorchElasticEnvironment(TORCHRUN)) == ("node0", 29400, 8, 5, 1, 1, True)


def test_torchelastic_names_the_attempt_only_when_one_agent_store_serves_every_attempt_of_one_node() -> None:
    one_node = {**TORCHRUN, "WORLD_SIZE": "4", "RANK": "1", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert TorchElasticEnvironment(one_node).store_attempt == 2
    # across nodes each agent counts its own restarts; without the agent's store rank 0 hosts a new one
    assert TorchElasticEnvironment({**one_node, "GROUP_WORLD_SIZE": "2"}).store_attempt is None
    assert TorchElasticEnvironment({**one_node, "TORCHELASTIC_USE_AGENT_STORE": "False"}).store_attempt is None
    with pytest.raises(ValueError, match="TORCHELASTIC_RESTART_COUNT"):
        TorchElasticEnvironment({**one_node, "TORCHELASTIC_RESTART_COUNT": "two"})


def test_torchelastic_bad_values() -> None:
    with pytest.raises(ValueError, match="RANK=8 is not smaller than WORLD_SIZE=8"):
        TorchElasticEnvironment({**TORCHRUN, "RANK": "8"})
    with pytest.raises(ValueError, match="LOCAL_RANK=4 is not smaller than LOCAL_WORLD_SIZE=4"):
        TorchElasticEnvironment({**TORCHRUN, "LOCAL_RANK": "4"})
    with pytest.raises(ValueError, match="MASTER_PORT is not set.*torchrun"):
        TorchElasticEnvironment({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"})


# --- SLURM -------------------------------------------------------------------------------------

# A task of `srun --nodes=2 --ntasks-per-node=4` (SLURM_STEP_ID: it belongs to a job step).
SLURM = {"SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_PROCID": "6", "SLURM_LOCALID": "2",
         "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "1234567",
         "SLURM_JOB_NAME": "train", "SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": "4(x2)"}


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2],b3,c[08-10]", ["a1", "a2", "b3", "c08", "c09", "c10"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("host.example.com", ["host.example.com"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("alpha beta gamma", ["alpha", "beta", "gamma"]),  # as some sites set it
        (" a[1-2]  b3\tc, d ", ["a1", "a2", "b3", "c", "d"]),
    ],
)
def test_expand_slurm_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[1-", "node[a-b]", "node[4-2]"])
def test_expand_slurm_nodelist_rejects_garbage(nodelist: str) -> None:
    with pytest.raises(ValueError, match="SLURM_NODELIST"):
        expand_slurm_nodelist(nodelist)


def test_space_separated_nodelist_gives_the_first_host_as_main_address() -> None:
    assert SLURMEnvironment({**SLURM, "SLURM_NODELIST": "alpha beta gamma"}).main_address == "alpha"


def test_slurm_reads_srun_variables_and_derives_port_from_job_id() -> None:
    assert SLURMEnvironment.detect(SLURM)
    assert summary(SLURMEnvironment(SLURM)) == ("gpu07", 15000 + 4567, 8, 6, 2, 1, True)


def test_slurm_master_variables_override() -> None:
    env = SLURMEnvironment({**SLURM, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "30000"})
    assert (env.main_address, env.main_port) == ("10.1.1.1", 30000)


def test_slurm_detects_the_srun_step_not_the_job_name() -> None:
    """Issue 15, items 1-3: the step, not the job's name, says whether srun started this process."""
    assert SLURMEnvironment.detect({**SLURM, "SLURM_JOB_NAME": "bash"})  # srun bash -c "python ..."
    assert SLURMEnvironment.detect({**SLURM, "SLURM_JOB_NAME": "interactive"})  # srun inside salloc
    assert SLURMEnvironment.detect({**SLURM, "SLURM_STEP_ID": "", "SLURM_STEPID": "3"})  # the older name
    salloc_shell = {k: v for k, v in SLURM.items() if k not in ("SLURM_PROCID", "SLURM_STEP_ID", "SLURM_LOCALID")}
    assert not SLURMEnvironment.detect({**salloc_shell, "SLURM_JOB_NAME": "interactive"})
    batch_step = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"} | {"SLURM_PROCID": "0"}
    assert not SLURMEnvironment.detect(batch_step)  # sbatch's script itself: one process, not rank 0 of 8
    assert type(detect_environment(batch_step)) is LocalEnvironment
    assert not SLURMEnvironment.detect({})


def test_slurm_ntasks_placed_unevenly_is_refused_with_a_hint() -> None:
    variables = {k: v for k, v in SLURM.items() if k != "SLURM_NTASKS_PER_NODE"}
    with pytest.raises(ValueError, match=r"SLURM_TASKS_PER_NODE='4,3,1'.*--ntasks-per-node"):
        SLURMEnvironment({**variables, "SLURM_TASKS_PER_NODE": "4,3,1", "SLURM_NNODES": "3"})
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE is not set.*--ntasks-per-node"):
        SLURMEnvironment({k: v for k, v in variables.items() if k != "SLURM_TASKS_PER_NODE"})


def test_slurm_ntasks_placed_evenly_is_accepted() -> None:
    """Issue 15, item 6: `srun --ntasks=2` on one node places both tasks there, as srun says."""
    one_node = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
                "SLURM_NNODES": "1", "SLURM_NODELIST": "node1", "SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0",
                "SLURM_TASKS_PER_NODE": "2"}
    assert summary(SLURMEnvironment(one_node)) == ("node1", 15012, 2, 1, 1, 0, True)
    variables = {k: v for k, v in SLURM.items() if k != "SLURM_NTASKS_PER_NODE"}  # 4(x2)
    assert SLURMEnvironment(variables).world_size() == 8
    with pytest.raises(ValueError, match="SLURM_LOCALID=4 is not smaller than SLURM_TASKS_PER_NODE=4"):
        SLURMEnvironment({**variables, "SLURM_LOCALID": "4"})


def test_slurm_bad_values() -> None:
    with pytest.raises(ValueError, match="SLURM_PROCID=8 is not smaller than SLURM_NTASKS=8"):
        SLURMEnvironment({**SLURM, "SLURM_PROCID": "8"})
    with pytest.raises(ValueError, match="SLURM_LOCALID=4 is not smaller than SLURM_NTASKS_PER_NODE=4"):
        SLURMEnvironment({**SLURM, "SLURM_LOCALID": "4"})
    with pytest.raises(ValueError, match="SLURM_NODEID=2 is not smaller than SLURM_NNODES=2"):
        SLURMEnvironment({**SLURM, "SLURM_NODEID": "2"})
    with pytest.raises(ValueError, match="SLURM_JOB_ID='abc'"):
        SLURMEnvironment({**SLURM, "SLURM_JOB_ID": "abc"})


# --- LSF ---------------------------------------------------------------------------------------


@pytest.fixture()
def rankfile(tmp_path) -> str:  # type: ignore[no-untyped-def]
    path = tmp_path / "rankfile"
    path.write_text("batch1\nh1\nh1\nh2\nh2\n")
    return str(path)


def lsf(rankfile: str, **overrides: str) -> dict[str, str]:
    return {"LSB_JOBID": "123456", "LSB_DJOB_RANKFILE": rankfile, "JSM_NAMESPACE_SIZE": "4",
            "JSM_NAMESPACE_RANK": "3", "JSM_NAMESPACE_LOCAL_RANK": "1", **overrides}


def test_lsf_reads_jsrun_variables_and_rankfile(rankfile: str) -> None:
    variables = lsf(rankfile)
    assert LSFEnvironment.detect(variables)
    env = LSFEnvironment(variables, hostname="h2")
    assert summary(env) == ("h1", 10000 + 456, 4, 3, 1, 1, True)


def test_lsf_uses_lsb_hosts_without_rankfile() -> None:
    variables = lsf("", LSB_HOSTS="batch1 h1 h1 h2 h2")
    del variables["LSB_DJOB_RANKFILE"]
    env = LSFEnvironment(variables, hostname="h1.cluster.org")
    assert (env.main_address, env.node_rank()) == ("h1", 0)


def test_lsf_bad_values(rankfile: str) -> None:
    with pytest.raises(ValueError, match="cannot be read"):
        LSFEnvironment(lsf("/nonexistent/rankfile"), hostname="h1")
    with pytest.raises(ValueError, match=r"\('elsewhere'\) is not among the compute hosts"):
        LSFEnvironment(lsf(rankfile), hostname="elsewhere")
    with pytest.raises(ValueError, match="JSM_NAMESPACE_RANK=4 is not smaller than JSM_NAMESPACE_SIZE=4"):
        LSFEnvironment(lsf(rankfile, JSM_NAMESPACE_RANK="4"), hostname="h1")


# --- MPI ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variables",
    [
        {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
         "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1"},
        {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
        {"MV2_COMM_WORLD_RANK": "3", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "1",
         "MV2_COMM_WORLD_LOCAL_SIZE": "2"},
    ],
    ids=["openmpi", "mpich-intel", "mvapich"],
)
def test_mpi_flavours(variables: dict[str, str]) -> None:
    variables = {**variables, "MASTER_ADDR": "head", "MASTER_PORT": "29999"}
    assert MPIEnvironment.detect(variables)
    assert summary(MPIEnvironment(variables)) == ("head", 29999, 4, 3, 1, 1, True)


def test_mpi_single_node_needs_no_master_addr_and_derives_one_port_per_job() -> None:
    base = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "3141"}
    rank0 = MPIEnvironment(base)
    rank1 = MPIEnvironment({**base, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    assert rank0.main_address == "127.0.0.1"
    assert rank0.main_port == rank1.main_port
    assert 20000 <= rank0.main_port < 30000


@pytest.mark.parametrize("size", [2, 4])
def test_open_mpi_on_one_node_is_node_0_whatever_its_node_rank_variable(size: int) -> None:
    """Issue 15, item 4: OMPI_COMM_WORLD_NODE_RANK numbers the processes on a node (as Open MPI's
    mpirun sets it: 0..size-1 here), not the nodes."""
    for rank in range(size):
        variables = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
                     "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(size),
                     "OMPI_COMM_WORLD_NODE_RANK": str(rank)}
        assert MPIEnvironment(variables).node_rank() == 0


def test_mpich_on_one_node_derives_its_port_from_the_nodes_hydra_proxy(tmp_path: Path) -> None:
    """Issue 15, case 5: Hydra sets no job id, so the port comes from the pid of the ranks' common
    ancestor, hydra_pmi_proxy, one per job (tests/schedulers runs two real MPICH jobs at once)."""
    proxy = tmp_path / "hydra_pmi_proxy"
    proxy.symlink_to(shutil.which("sh") or "/bin/sh")
    probe = ("from ddpkit.environments import MPIEnvironment; "
             "print(MPIEnvironment({'PMI_RANK': '0', 'PMI_SIZE': '2', 'MPI_LOCALRANKID': '0', 'MPI_LOCALNRANKS': '2'})"
             ".main_port)")
    ports = []
    for _ in range(2):  # "; true" keeps the shell from replacing itself with python
        shown = subprocess.run([str(proxy), "-c", f'{sys.executable} -c "{probe}"; echo $$; true'],
                               capture_output=True, text=True, timeout=60)
        port, proxy_pid = shown.stdout.split()
        assert int(port) == 20000 + zlib.crc32(f"hydra_pmi_proxy {proxy_pid}".encode()) % 10000, shown.stderr
        ports.append(port)
    assert ports[0] != ports[1]


def test_mpich_across_nodes_needs_master_port() -> None:
    across = {"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "head"}
    with pytest.raises(ValueError, match="MASTER_PORT is not set.*-genv MASTER_PORT 29500"):
        MPIEnvironment(across)
    assert MPIEnvironment({**across, "MASTER_PORT": "29500"}).main_port == 29500
    assert MPIEnvironment({**across, "PMI_KVSNAME": "kvs_7"}).main_port == 20000 + zlib.crc32(b"kvs_7") % 10000


def test_mpi_bad_values() -> None:
    multi_node = {"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    with pytest.raises(ValueError, match="MASTER_ADDR is not set.*mpirun -x MASTER_ADDR"):
        MPIEnvironment(multi_node)
    with pytest.raises(ValueError, match="PMI_RANK=4 is not smaller than PMI_SIZE=4"):
        MPIEnvironment({**multi_node, "PMI_RANK": "4", "MASTER_ADDR": "head"})
    with pytest.raises(ValueError, match="MPI_LOCALRANKID is not set"):
        MPIEnvironment({"PMI_RANK": "0", "PMI_SIZE": "1"})


# --- Kubeflow ----------------------------------------------------------------------------------

KUBEFLOW = {"KUBERNETES_PORT": "tcp://10.0.0.1:443", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
            "WORLD_SIZE": "3", "RANK": "2"}


def test_kubeflow_one_process_per_pod() -> None:
    assert KubeflowEnvironment.detect(KUBEFLOW)
    assert summary(KubeflowEnvironment(KUBEFLOW)) == ("job-master-0", 23456, 3, 2, 0, 2, True)
    with pytest.raises(ValueError, match="RANK=3 is not smaller than WORLD_SIZE=3"):
        KubeflowEnvironment({**KUBEFLOW, "RANK": "3"})


# --- detection order ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({}, LocalEnvironment),
        (TORCHRUN, TorchElasticEnvironment),
        ({**SLURM, **TORCHRUN}, TorchElasticEnvironment),  # torchrun inside an allocation
        (SLURM, SLURMEnvironment),
        ({**SLURM, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
         MPIEnvironment),
        (KUBEFLOW, KubeflowEnvironment),
        ({**SLURM, DDPKIT_LAUNCHED: "1", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1",
          "MASTER_PORT": "29500"}, LocalEnvironment),
    ],
    ids=["nothing", "torchrun", "torchrun-in-slurm", "slurm", "mpi-in-slurm", "kubeflow", "ddpkit-in-slurm"],
)
def test_detect_environment_order(variables: dict[str, str], expected: type) -> None:
    assert type(detect_environment(variables)) is expected


def test_lsf_detected(rankfile: str) -> None:
    variables = lsf(rankfile)
    assert not SLURMEnvironment.detect(variables) and LSFEnvironment.detect(variables)


def test_no_environment_binds_connects_or_writes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Environments only read: constructing each of them opens no socket and writes no variable."""
    import socket

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("an environment opened a socket")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    rankfile = tmp_path / "ranks"
    rankfile.write_text("launch\nhostA\nhostA\n")
    samples = {
        LocalEnvironment: {},
        TorchElasticEnvironment: {"MASTER_ADDR": "h", "MASTER_PORT": "1234", "WORLD_SIZE": "2", "RANK": "1",
                                  "GROUP_RANK": "0", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
        KubeflowEnvironment: {"KUBERNETES_PORT": "x", "MASTER_ADDR": "h", "MASTER_PORT": "1234", "WORLD_SIZE": "2",
                              "RANK": "1"},
        SLURMEnvironment: {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
                           "SLURM_NODELIST": "node1", "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "train",
                           "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1"},
        LSFEnvironment: {"LSB_JOBID": "5", "JSM_NAMESPACE_SIZE": "2", "JSM_NAMESPACE_RANK": "1",
                         "JSM_NAMESPACE_LOCAL_RANK": "1", "LSB_DJOB_RANKFILE": str(rankfile)},
        MPIEnvironment: {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                         "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "h"},
    }
    process_environment = dict(os.environ)
    for kind, variables in samples.items():
        before = dict(variables)
        env = kind(variables, hostname="hostA") if kind is LSFEnvironment else kind(variables)  # type: ignore[call-arg]
        assert env.world_size() in (1, 2), kind
        assert variables == before, kind
    assert dict(os.environ) == process_environment


# --- the launcher's facts: one contract ---------------------------------------------------------


def test_the_launch_contract_says_what_each_launcher_told_and_nothing_for_the_others() -> None:
    """``ddpkit run`` tells the attempt, the generation, the recovery, the hosted store and the backend;
    torchrun its attempt under its static rendezvous; Slurm (like any other) nothing."""
    from ddpkit.environments import LaunchContract, Recovery, RecoveryPolicy, launch_contract
    from ddpkit.variables import DDPKIT_BACKEND, DDPKIT_GENERATION, DDPKIT_RECOVERY, DDPKIT_RESTART_COUNT

    launched = LocalEnvironment({"MASTER_ADDR": "a", "MASTER_PORT": "5", "WORLD_SIZE": "2", "RANK": "1",
                                 "LOCAL_RANK": "1", DDPKIT_LAUNCHED: "1", DDPKIT_RECOVERY: "in-place",
                                 DDPKIT_GENERATION: "3", DDPKIT_RESTART_COUNT: "2", DDPKIT_BACKEND: "gloo"})
    policy = RecoveryPolicy(Recovery.IN_PLACE, restart_count=2, generation=3)
    assert launch_contract(launched) == LaunchContract(recovery=policy, attempt=2, hosted_store=True, backend="gloo")
    assert launch_contract(launched).recovery.replaces_a_lost_rank
    one_node = {**TORCHRUN, "WORLD_SIZE": "4", "RANK": "1", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert launch_contract(TorchElasticEnvironment(one_node)) == LaunchContract(
        recovery=RecoveryPolicy(restart_count=2), attempt=2, torchrun_store_attempt=2)
    across_nodes = {**one_node, "GROUP_WORLD_SIZE": "2"}  # each agent counts its own restarts: records are not bound
    assert launch_contract(TorchElasticEnvironment(across_nodes)) == LaunchContract(recovery=RecoveryPolicy(restart_count=2))
    slurm = SLURMEnvironment({"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                              "SLURM_NODELIST": "n1", "SLURM_JOB_ID": "7", "SLURM_TASKS_PER_NODE": "2"})
    assert launch_contract(slurm) == LaunchContract()


def test_the_recovery_policy_the_launcher_writes_is_the_one_its_workers_read_back() -> None:
    """One type both sides of the launch read: ``ddpkit run``'s variables for a worker (a node of a
    world that may shrink, a replacement's generation) read back in the worker as the same policy."""
    from ddpkit.environments import Recovery, RecoveryPolicy, launch_contract
    from ddpkit.launching.config import LaunchConfig
    from ddpkit.launching.worker_environment import rank_variables

    config = LaunchConfig(nproc_per_node=2, nnodes=2, min_nodes=1, recovery=Recovery.IN_PLACE)
    variables = rank_variables(config, 29500, local_rank=1, restart_count=3, generation=4)
    told = launch_contract(LocalEnvironment(variables)).recovery
    assert told == config.recovery_policy(3, 4) == RecoveryPolicy(Recovery.IN_PLACE, 3, 4, min_nodes=1)
    assert told.replaces_a_lost_rank and told.may_shrink(nodes=2) and not told.may_shrink(nodes=1)
    assert variables["TORCHELASTIC_RESTART_COUNT"] == "3"  # torchrun's readers see the same count
    fixed = launch_contract(LocalEnvironment(rank_variables(LaunchConfig(nproc_per_node=2), 29500, 0))).recovery
    assert fixed == RecoveryPolicy() and not fixed.survivors_go_on and not fixed.may_shrink(nodes=2)
    with pytest.raises(ValueError, match="DDPKIT_MIN_NODES='none'.*unset it"):
        RecoveryPolicy.read({**variables, "DDPKIT_MIN_NODES": "none"})
