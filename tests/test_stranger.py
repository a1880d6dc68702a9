"""A process outside the job that reaches its store (issue 33): from the same host and from
another network namespace, knowing the port and ddpkit's key names, it forges a failure, a lost
peer, a hang decision and a hang watch's answers. None has an effect: the job ends with the
single-process result. A member of a group that cannot prove the job's secret is refused before
anything is sent to it. Each test fails without the job secret (the forged failure ends the job)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from helpers import example_summary
from torch import nn

from ddpkit.environments import find_free_port
from ddpkit.store.job_secret import JobSecret, JobSecretError, RecordSigner, job_secret
from ddpkit.testing import WorkerPool

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.py"
STEPS = 12
STRIKE_AT_STEP = 3

# Two ranks train a linear model with ddpkit's DDP inside ddpkit.guard(); at STRIKE_AT_STEP they
# wait until the stranger has written, then go on, rank 1 late at every step, so that rank 0 waits
# in slices (reading the store) and the peer watch reads it too, for seconds.
JOB = f"""
import json, pathlib, sys, time
import torch
from torch import nn
import ddpkit
from ddpkit.environments import LocalEnvironment

folder = pathlib.Path(sys.argv[1])
ddpkit.init_dist_connection(LocalEnvironment())
rank = ddpkit.get_rank()
torch.manual_seed(0)
model = nn.Linear(6, 3)
ddp = ddpkit.DistributedDataParallel(model)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
with ddpkit.guard():
    for step in range({STEPS}):
        if step == {STRIKE_AT_STEP}:
            (folder / f"connected{{rank}}").write_text("1")
            while not (folder / "struck").exists():
                time.sleep(0.05)
        generator = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)
        if rank == 1:
            time.sleep(0.3)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
        optimizer.step()
if rank == 0:
    print("parameters", json.dumps([p.tolist() for p in model.parameters()]), flush=True)
ddpkit.destroy_dist_connection()
"""

# The stranger: a torch.distributed client of the job's store that knows ddpkit's key names (from
# its source) and lists the store's keys to find the job's prefix. argv: host, port, folder. Under
# several nodes the launchers' keys are in the same store: it stops the job as a preempted node's
# launcher would, fails the attempt, publishes a cause and says a node left.
STRANGER = """
import json, pathlib, re, sys, time
from datetime import timedelta
import torch.distributed as dist

host, port, folder = sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3])
while not all((folder / f"connected{rank}").exists() for rank in (0, 1)):
    time.sleep(0.05)
store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
forged = {"rank": 1, "type": "InjectedError", "message": "written by a stranger", "traceback": "nothing\\n",
          "timestamp": 0}
hang = dict(forged, type="HangError", message="rank 1 did not arrive (forged)")
store.set("ddpkit/failure", json.dumps(forged))  # the key name ddpkit used before job secrets
prefixes = {key.partition("hang/process/")[0] for key in store.list_keys() if "hang/process/" in key}
for prefix in prefixes:
    store.set(prefix + "failure", json.dumps(hang))
    # A value dressed as a signed one: its HMAC is made up.
    store.set(prefix + "peer_lost", "ddpkit-hmac-sha256:" + "0" * 64 + ":rank 1: forged")
    store.set(prefix + "hang/progress/1", "#1 forged")
    store.set(prefix + "hang/process/1", json.dumps({"host": "here", "pid": 1, "stack_file": "/etc/passwd"}))
    store.add(prefix + "hang/requests", 5)
for namespace in {re.match(r"ddpkit/(job-[0-9a-f]+/)?", key).group(0) for key in store.list_keys()
                  if key.startswith("ddpkit/")}:
    launchers = namespace + "launchers/"
    store.set(launchers + "attempt/0/stop", "node 1's launcher received SIGTERM (forged)")
    store.add(launchers + "attempt/0/failed", 1)  # the count ddpkit's launchers kept before job secrets
    store.set(launchers + "attempt/0/failed/1", "1")
    store.add(launchers + "attempt/0/failed/count", 1)
    store.set(launchers + "attempt/0/cause/1", json.dumps({"text": "rank 1 forged", "recorded_at": None}))
    store.add(launchers + "left", 1)
    store.set(launchers + "left/1", "1")
    store.add(launchers + "left/count", 1)
print("struck", sorted(prefixes), flush=True)
(folder / "struck").write_text("1")
"""


def single_process_reference() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def run_job_with_stranger(folder: Path, launcher_flags: list[str], master_addr: str, stranger_prefix: list[str],
                          nodes: int = 1, **variables: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """The job under ``ddpkit run`` (two ranks: one node, or ``nodes`` launchers of one rank each, on
    this host) while the stranger strikes; the outcome (node 0's, with every node's stderr) and what
    the stranger said."""
    (folder / "job.py").write_text(JOB)
    port = find_free_port(master_addr)
    env = {key: value for key, value in os.environ.items() if not key.startswith("DDPKIT_JOB_SECRET")}
    env.update(OMP_NUM_THREADS="1", **variables)
    stranger = subprocess.Popen([*stranger_prefix, sys.executable, "-c", STRANGER, master_addr, str(port), str(folder)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    per_node = ["--nproc-per-node", "2"] if nodes == 1 else ["--nproc-per-node", "1", "--nnodes", str(nodes)]
    launchers = [subprocess.Popen([sys.executable, "-m", "ddpkit", "run", *per_node,
                                   *([] if nodes == 1 else ["--node-rank", str(node)]), "--master-addr", master_addr,
                                   "--master-port", str(port), *launcher_flags, "job.py", str(folder)],
                                  cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for node in range(nodes)]
    try:
        ended = [launcher.communicate(timeout=120) for launcher in launchers]
        said = stranger.communicate(timeout=30)[0]
    finally:
        for process in (*launchers, stranger):
            process.kill()
    codes = [launcher.returncode for launcher in launchers]
    job = subprocess.CompletedProcess(launchers[0].args, max(codes, key=abs), "".join(out for out, _ in ended),
                                      "".join(err for _, err in ended))
    return job, said


def assert_fault_free(job: subprocess.CompletedProcess[str], said: str) -> None:
    assert "struck" in said, said
    assert job.returncode == 0, job.stdout + job.stderr
    line = next(line for line in job.stdout.splitlines() if "parameters " in line)
    parameters = json.loads(line.split("parameters ", 1)[1])
    for mine, reference in zip(parameters, single_process_reference(), strict=True):
        assert torch.allclose(torch.tensor(mine), reference, atol=1e-6)
    assert "does not carry this job's secret" in job.stderr  # the forged values were read, and ignored
    said_per_rank_and_key = Counter(re.findall(r"(\[rank \d+\]) ddpkit: ignored a value under the store key '([^']+)'",
                                               job.stderr))
    assert said_per_rank_and_key and set(said_per_rank_and_key.values()) == {1}, said_per_rank_and_key  # said once


@pytest.mark.parametrize("recovery", ["fail-fast", "in-place"])
def test_a_stranger_on_the_same_host_cannot_end_the_job_or_blame_a_rank(tmp_path: Path, recovery: str) -> None:
    """Fail-fast: the store is rank 0's (torch's). In place: the launcher's store host keeps it, and a
    forged lost peer would start a recovery that no replacement completes."""
    flags = ["--recovery", recovery] + (["--max-restarts", "1"] if recovery == "in-place" else [])
    job, said = run_job_with_stranger(tmp_path, flags, "127.0.0.1", [])
    assert_fault_free(job, said)


def test_a_stranger_cannot_stop_a_multi_node_job_or_fail_its_attempt(tmp_path: Path) -> None:
    """Two launchers (nodes) restarting together share node 0's store with their workers: a forged
    stop (a preempted node's), failure, cause or departure would end or restart every node."""
    job, said = run_job_with_stranger(tmp_path, ["--max-restarts", "1"], "127.0.0.1", [], nodes=2,
                                      DDPKIT_JOB_SECRET="a-secret-every-node-was-given")
    assert_fault_free(job, said)
    assert "restarting" not in job.stderr


# A stranger with torch: when the survivors of a lost rank start to form generation 1 of the group,
# it counts itself in (the meeting's count cannot be signed) and forms the group as the lost rank 1,
# before the replacement does; had it joined, it would receive what a replacement receives.
IMPOSTOR = """
import socket, sys, time
from datetime import timedelta
import torch.distributed as dist

print("imported", flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:  # torch's client backs off for long after a refused connection
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1).close()
        break
    except OSError:
        time.sleep(0.01)
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=60))
while time.monotonic() < deadline:
    meeting = [key for key in store.list_keys() if key.endswith("generation/1/arrived")]
    if meeting:
        break
    time.sleep(0.002)
else:
    sys.exit("no recovery seen")
prefix = meeting[0].removesuffix("arrived")
store.add(meeting[0], 1)
print("forming as rank 1 at", prefix, flush=True)
try:
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=1, world_size=2,
                            timeout=timedelta(seconds=15))
    print("joined the group", flush=True)
    told = [None, None]
    dist.all_gather_object(told, (True, 0))
    print("received", told, flush=True)
except Exception as error:  # noqa: BLE001 - what stopped it is the point
    print("kept out:", type(error).__name__, str(error).splitlines()[0][:200], flush=True)
"""


def test_a_stranger_cannot_take_a_lost_ranks_place_in_an_in_place_recovery(tmp_path: Path) -> None:
    """Rank 1 is killed; while the survivor forms the group again, a stranger writes itself in as
    rank 1. Torch's own values in the group's store are signed, so the survivor waits for the
    replacement's address and the job ends as without the fault; nothing reaches the stranger."""
    port = find_free_port("127.0.0.1")
    impostor = subprocess.Popen([sys.executable, "-c", IMPOSTOR, str(port)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        # The job only once the stranger has imported torch: imported later (a loaded machine), it
        # could look for the recovery's keys after the recovery removed them, and see none.
        assert impostor.stdout is not None and impostor.stdout.readline().strip() == "imported"
        job = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--recovery", "in-place", "--max-restarts", "1",
                              "--nproc-per-node", "2", "--master-port", str(port), str(EXAMPLE), "--epochs", "1",
                              "--samples", "1024", "--kill-at-step", "5"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=180,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        said = impostor.communicate(timeout=90)[0]  # past its own 60 s, which it reports
    finally:
        impostor.kill()
    assert "forming as rank 1" in said, said
    assert "received" not in said, said
    assert job.returncode == 0, job.stderr[-3000:]
    assert "recovered in place" in job.stderr
    summary = example_summary(job.stdout)
    assert summary["identical"] and summary["max_difference"] <= 1e-6, summary


@contextlib.contextmanager
def stranger_namespace() -> Iterator[tuple[str, str]]:
    """A network namespace joined to this one by a veth pair: (its name, this side's address)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a network namespace needs root and iproute2's `ip` (run as root, `apt-get install iproute2`)")
    name = f"ddpkit-stranger-{os.getpid()}"
    host_side, far_side = f"dks{os.getpid() % 100000}h", f"dks{os.getpid() % 100000}n"
    octet = os.getpid() % 200 + 20
    commands = [["ip", "netns", "add", name],
                ["ip", "link", "add", host_side, "type", "veth", "peer", "name", far_side],
                ["ip", "link", "set", far_side, "netns", name],
                ["ip", "addr", "add", f"10.233.{octet}.1/24", "dev", host_side],
                ["ip", "link", "set", host_side, "up"],
                ["ip", "netns", "exec", name, "ip", "addr", "add", f"10.233.{octet}.2/24", "dev", far_side],
                ["ip", "netns", "exec", name, "ip", "link", "set", far_side, "up"],
                ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"]]
    try:
        for command in commands:
            result = subprocess.run(command, capture_output=True, text=True, timeout=30)
            if result.returncode != 0:
                pytest.skip(f"could not make a network namespace ({' '.join(command)}: {result.stderr.strip()})")
        yield name, f"10.233.{octet}.1"
    finally:
        subprocess.run(["ip", "link", "delete", host_side], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)


def test_a_stranger_in_another_network_namespace_cannot_end_the_job(tmp_path: Path) -> None:
    """The stranger reaches the job's store over a link, as a process on another machine would."""
    with stranger_namespace() as (namespace, address):
        job, said = run_job_with_stranger(tmp_path, [], address, ["ip", "netns", "exec", namespace])
    assert_fault_free(job, said)


def reaches(namespace: str, address: str, port: int) -> bool:
    """Whether a process in ``namespace`` can open a TCP connection to ``address:port``."""
    probe = f"import socket; socket.create_connection(({address!r}, {port}), timeout=3).close()"
    return subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", probe], capture_output=True,
                          timeout=30).returncode == 0


@pytest.mark.parametrize(("recovery", "bind"), [("fail-fast", ""), ("in-place", ""), ("in-place", "all")],
                         ids=["rank-zeros-store", "store-host", "store-host-bound-to-all-when-asked"])
def test_a_single_node_jobs_store_is_out_of_reach_of_other_machines(tmp_path: Path, recovery: str, bind: str) -> None:
    """The job meets on 127.0.0.1; its store listens there only (torch's own listens on every
    interface), so the far end of a link cannot even connect, unless DDPKIT_STORE_BIND=all asks."""
    (tmp_path / "job.py").write_text(JOB)
    port = find_free_port("127.0.0.1")
    flags = ["--recovery", recovery] + (["--max-restarts", "1"] if recovery == "in-place" else [])
    with stranger_namespace() as (namespace, address):
        job = subprocess.Popen([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", "--master-port",
                                str(port), *flags, "job.py", str(tmp_path)], cwd=tmp_path, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "DDPKIT_STORE_BIND": bind})
        try:
            deadline = time.monotonic() + 60
            while not all((tmp_path / f"connected{rank}").exists() for rank in (0, 1)):
                assert time.monotonic() < deadline and job.poll() is None, job.communicate()
                time.sleep(0.05)
            reached = reaches(namespace, address, port)
            (tmp_path / "struck").write_text("1")
            out, err = job.communicate(timeout=60)
        finally:
            job.kill()
    assert job.returncode == 0, err
    assert reached is (bind == "all")


PROVE = """
import ddpkit
from ddpkit.environments import LocalEnvironment
try:
    ddpkit.init_dist_connection(LocalEnvironment(), timeout=5)
    print("formed", flush=True)
except Exception as error:
    print("refused", type(error).__name__, error, flush=True)
"""


@pytest.mark.parametrize("secrets", [("a" * 32, "a" * 32), ("a" * 32, "b" * 32)], ids=["same", "rank1-differs"])
def test_a_member_with_another_secret_is_kept_out_of_the_group(tmp_path: Path, secrets: tuple[str, str]) -> None:
    """Rank 1 stands for a process that writes itself into the store as a member: it has another
    secret. Torch's values in the store are signed, so neither rank takes the other's address: the
    connection fails within its timeout, naming the key, instead of forming a group with it."""
    (tmp_path / "script.py").write_text(PROVE)
    port = find_free_port()
    ranks = [subprocess.Popen([sys.executable, "script.py"], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                                   "DDPKIT_JOB_SECRET": secrets[rank]})
             for rank in (0, 1)]
    outputs = []
    try:
        outputs = [rank.communicate(timeout=60) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    said = [out for out, _ in outputs]
    if secrets[0] == secrets[1]:
        assert said == ["formed\n", "formed\n"], outputs
    else:
        for out in said:
            assert out.startswith("refused") and "does not carry this job's secret" in out, outputs


def members_prove_with(secrets: tuple[bytes, bytes]) -> str:
    """Every rank of the pool's group proves the secret its ``secrets`` entry gives it."""
    import torch.distributed as dist

    from ddpkit.membership.group import Group, MemberProofError, Membership

    rank = dist.get_rank()
    group = Group(Membership(0, rank, 2), "gloo", timedelta(seconds=30), secret=JobSecret(secrets[rank], "test"))
    try:
        group.prove_members()
    except MemberProofError as error:
        return str(error)
    return "proved"


def test_the_members_proof_names_a_member_without_the_secret(pool2: WorkerPool) -> None:
    """Past the store (a process that joins Gloo's connections directly), the members' proof over the
    group's own connections names a member that does not hold the secret, before anything is sent."""
    assert pool2.run(members_prove_with, (b"a" * 32, b"a" * 32), timeout=60) == ["proved", "proved"]
    told = pool2.run(members_prove_with, (b"a" * 32, b"b" * 32), timeout=60)
    assert told[0].startswith("rank(s) [1] of the group just formed (attempt 0 generation 0) did not prove"), told
    assert told[1].startswith("rank(s) [0]"), told


def test_records_are_bound_to_their_key_scope_and_contents() -> None:
    secret = JobSecret(b"s" * 32, "test")
    signer = RecordSigner(secret, "attempt 0 generation 1")
    key = signer.key("failure")
    assert key.startswith("ddpkit/job-") and key.endswith("/failure")
    signed = signer.sign(key, '{"rank": 1}')
    assert signer.verify(key, signed.encode()) == '{"rank": 1}'
    assert signer.verify(signer.key("peer_lost"), signed) is None  # copied under another key
    assert RecordSigner(secret, "attempt 0 generation 2").verify(key, signed) is None  # or into another generation
    assert RecordSigner(JobSecret(b"t" * 32, "other"), "attempt 0 generation 1").verify(key, signed) is None
    assert signer.verify(key, signed.replace('"rank": 1', '"rank": 0')) is None  # its contents changed
    assert signer.verify(key, '{"rank": 1}') is None  # unsigned
    assert RecordSigner(None).verify("ddpkit/failure", '{"rank": 1}') == '{"rank": 1}'  # no secret: as before
    assert RecordSigner(None).key("failure") == "ddpkit/failure"


@pytest.mark.parametrize(("variables", "message"), [
    ({"DDPKIT_JOB_SECRET": "short"}, "is 5 characters long: a job secret needs at least 16"),
    ({"DDPKIT_JOB_SECRET": ""}, "is set but empty"),
    ({"DDPKIT_JOB_SECRET": "x" * 20, "DDPKIT_JOB_SECRET_FILE": "/nonexistent"}, "give the job's secret one way only"),
    ({"DDPKIT_JOB_SECRET_FILE": "/nonexistent/secret"}, "cannot be read (No such file or directory)"),
])
def test_an_unusable_secret_is_refused_naming_the_variable_and_the_fix(variables: dict[str, str], message: str) -> None:
    with pytest.raises(JobSecretError) as raised:
        job_secret(variables)
    assert message in str(raised.value)


def test_a_secret_file_is_read_and_one_others_can_read_is_warned_about(tmp_path: Path,
                                                                       capfd: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "secret"
    path.write_text("f" * 40 + "\n")
    path.chmod(0o644)
    secret = job_secret({"DDPKIT_JOB_SECRET_FILE": str(path)})
    assert secret is not None and secret.value == b"f" * 40 and str(path) in secret.source
    assert "can be read by other users" in capfd.readouterr().err
    assert "f" * 40 not in repr(secret)  # never shown


def test_ddpkit_run_refuses_a_malformed_secret_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("raise SystemExit('started')\n")
    result = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", "job.py"], cwd=tmp_path,
                            env={**os.environ, "DDPKIT_JOB_SECRET": "tiny"}, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "DDPKIT_JOB_SECRET is 4 characters long" in result.stderr and "Traceback" not in result.stderr
    assert "started" not in result.stderr


def test_a_job_without_a_secret_says_so_once_on_rank_zero(tmp_path: Path) -> None:
    """Started without ddpkit run (torchrun, srun): no secret is made, and the job is told."""
    (tmp_path / "script.py").write_text(
        "import ddpkit\nfrom ddpkit.environments import LocalEnvironment\n"
        "ddpkit.init_dist_connection(LocalEnvironment())\nddpkit.destroy_dist_connection()\n")
    port = find_free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("DDPKIT_")}
    ranks = [subprocess.Popen([sys.executable, "script.py"], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                                   "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)})
             for rank in (0, 1)]
    try:
        errors = [rank.communicate(timeout=60)[1] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert errors[0].count("this job has no secret (DDPKIT_JOB_SECRET)") == 1, errors
    assert "no secret" not in errors[1]
