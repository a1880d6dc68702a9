"""torchrun's c10d rendezvous on ``ddpkit run`` (issue 15, item 2): the same command on every node,
no ``--node-rank``; nodes receive their rank at the rendezvous. Real launchers on loopback and
across network namespaces."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import example_summary

from ddpkit.environments import find_free_port
from ddpkit.launching.cli import main
from ddpkit.launching.rendezvous import DEFAULT_PORT, Endpoint, StoreWaits, parse_endpoint, parse_rdzv_conf

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.py"

# Each worker reports its place, says it started, and lives a moment (restart tests: one rank
# fails in the first attempt).
PLACE = textwrap.dedent(
    """
    import os, sys, time
    rank, attempt = os.environ["RANK"], os.environ["DDPKIT_RESTART_COUNT"]
    print(f"rank {rank} of {os.environ['WORLD_SIZE']} node {os.environ['NODE_RANK']} attempt {attempt} "
          f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    open(f"started{rank}", "w").close()
    if os.environ.get("FAIL_RANK") == rank and attempt == "0":
        sys.exit(f"rank {rank} fails on purpose")
    if os.environ.get("LIVE_UNTIL_RELEASED"):  # until the test is done with the job
        deadline = time.monotonic() + 60
        while not os.path.exists("released") and time.monotonic() < deadline:
            time.sleep(0.05)
    """
)


def launcher(folder: Path, *arguments: str, namespace: str | None = None, **variables: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "ddpkit", "run", *arguments]
    if namespace is not None:
        command = ["ip", "netns", "exec", namespace, *command]
    return subprocess.Popen(command, cwd=folder, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **variables})


def ended(launchers: list[subprocess.Popen[str]], timeout: float = 120) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each launcher; every one is ended, whatever happens."""
    try:
        outputs = [process.communicate(timeout=timeout) for process in launchers]
    finally:
        for process in launchers:
            process.kill()
            process.wait()
    return [(process.returncode, out, err) for process, (out, err) in zip(launchers, outputs)]


def c10d(port: int, run_id: str = "job", nnodes: int = 2) -> list[str]:
    return ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", run_id]


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    (tmp_path / "place.py").write_text(PLACE)
    return tmp_path


def test_two_launchers_without_node_ranks_form_one_world_of_four_and_train_like_one_process(tmp_path: Path) -> None:
    """The acceptance: every node runs the same command; one gets node 0, the other node 1."""
    port = find_free_port()
    arguments = [*c10d(port), "--nproc-per-node", "2", str(EXAMPLE), "--epochs", "2", "--samples", "1024"]
    results = ended([launcher(tmp_path, *arguments), launcher(tmp_path, *arguments)], timeout=180)
    assert [code for code, _, _ in results] == [0, 0], "\n".join(err[-3000:] for _, _, err in results)
    nodes = sorted(int(re.findall(r"this is node (\d) of 2", err)[0]) for _, _, err in results)
    assert nodes == [0, 1]
    out = "".join(out for _, out, _ in results)
    assert example_summary(out)["world_size"] == 4 and example_summary(out)["identical"], out
    assert example_summary(out)["max_difference"] < 1e-5


def test_a_launcher_too_many_and_another_job_on_the_endpoint_are_refused(folder: Path) -> None:
    port = find_free_port()
    job = [launcher(folder, *c10d(port), "--nproc-per-node", "1", "place.py", LIVE_UNTIL_RELEASED="1")
           for _ in range(2)]
    deadline = time.monotonic() + 60
    while not all((folder / f"started{rank}").exists() for rank in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.05)
    extra = launcher(folder, *c10d(port), "--rdzv-conf", "join_timeout=5", "place.py")
    other = launcher(folder, *c10d(port, run_id="another"), "--rdzv-conf", "join_timeout=5", "place.py")
    (extra_code, _, extra_err), (other_code, _, other_err) = ended([extra, other], timeout=30)
    (folder / "released").touch()
    assert extra_code == 1 and "rendezvous 'job' at 127.0.0.1" in extra_err, extra_err
    assert "already has its --nnodes=2 nodes; this launcher arrived as number 3" in extra_err
    assert other_code == 1 and "serves --rdzv-id='job', not 'another'" in other_err, other_err
    assert [code for code, _, _ in ended(job)] == [0, 0]  # the job itself is untouched


def test_a_node_that_does_not_come_ends_the_launcher_after_the_join_timeout(folder: Path) -> None:
    started = time.monotonic()
    code, _, err = ended([launcher(folder, *c10d(find_free_port()), "--rdzv-conf", "join_timeout=2",
                                   "place.py")], timeout=60)[0]
    assert code == 1 and "1 of --nnodes=2 launchers arrived within 2 s (--rdzv-conf join_timeout)" in err, err
    # join_timeout counts from the launcher's arrival: before it, its own store host starts (torch's
    # import, seconds on two loaded cores), which the launcher waits for apart (``StoreHost.wait_serving``).
    assert time.monotonic() - started < 30
    assert not list(folder.glob("started*"))  # no worker started


def test_an_endpoint_port_held_here_by_a_process_that_does_not_listen_ends_the_launchers_in_seconds(
        folder: Path) -> None:
    """The endpoint's port taken on its host by a socket that never listens (a connection's own port,
    as a port picked free can be taken before the launchers bind it): no launcher can host the store
    and none serves it, so both launchers end within seconds saying so, not after the join timeout
    (600 s by default: before, they waited it out without a word)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        started = time.monotonic()
        results = ended([launcher(folder, *c10d(port), "place.py") for _ in range(2)], timeout=40)
    for code, _, err in results:
        assert code == 1 and f"the endpoint 127.0.0.1:{port} is this host's, and another process holds its port " \
            "without listening on it" in err, err[-2000:]
    assert time.monotonic() - started < 30
    assert not list(folder.glob("started*"))


def test_both_nodes_restart_together_and_keep_their_node_ranks(folder: Path) -> None:
    port = find_free_port()
    arguments = [*c10d(port), "--nproc-per-node", "1", "--max-restarts", "1", "place.py"]
    results = ended([launcher(folder, *arguments, FAIL_RANK="1"), launcher(folder, *arguments, FAIL_RANK="1")])
    assert [code for code, _, _ in results] == [0, 0], "\n".join(err[-3000:] for _, _, err in results)
    for _, out, err in results:
        node = re.findall(r"this is node (\d) of 2", err)[0]
        # Both streams on failure: a line missing from stdout once here, with nothing else to tell why.
        seen = f"stdout:\n{out}\nstderr:\n{err[-3000:]}"
        assert f"rank {node} of 2 node {node} attempt 0" in out, seen
        assert f"rank {node} of 2 node {node} attempt 1" in out, seen
        assert "restart 1 of 1" in err, seen
        assert f"master 127.0.0.1:{port}" in out  # the workers meet at the endpoint
    assert any("rank 1 fails on purpose" in err for _, _, err in results)


# On a launcher's path: when the launcher (``python -m ddpkit run``) starts to import torch, note
# whether its store host (``launching.store_host``) is one of its processes already.
NOTE_THE_STORE_HOST_AT_TORCHS_IMPORT = textwrap.dedent(
    """
    import contextlib, os, sys, time, traceback

    def child_commands():
        commands = []
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as handle:
                for pid in handle.read().split():
                    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline") as command:
                        commands.append(command.read())  # (a child that ended meanwhile has none)
        return commands

    class NoteAtTorchsImport:
        def find_spec(self, name, path=None, target=None):
            # (``importlib.util.find_spec("torch")`` only looks: the launcher asks which build torch is)
            if name != "torch" or any(frame.filename == "<frozen importlib.util>"
                                      for frame in traceback.extract_stack()):
                return None
            sys.meta_path.remove(self)
            # A child's command line reads empty until its exec has laid out the new one, which may
            # be after Popen returned (Popen returns once the exec closed its pipe): read again.
            commands, deadline = child_commands(), time.monotonic() + 2
            while "" in commands and time.monotonic() < deadline:
                time.sleep(0.01)
                commands = child_commands()
            hosting = any("ddpkit.launching.store_host" in command for command in commands)
            with open(os.path.join(os.environ["NOTES"], str(os.getpid())), "w") as note:
                note.write("store host started" if hosting else "no store host yet")
            return None

    if sys.orig_argv[1:4] == ["-m", "ddpkit", "run"]:
        sys.meta_path.insert(0, NoteAtTorchsImport())
    """
)


@pytest.mark.parametrize("meeting", ["c10d", "static-restarts"])
def test_the_store_host_starts_before_its_launcher_imports_torch_so_that_both_import_at_once(
        folder: Path, meeting: str) -> None:
    """The launcher that hosts the job's store starts its store host before it imports the store's
    client (torch): the two processes import at once, and the store serves when the launcher first
    asks it (before, one waited for the other: seconds at every start of a job of several nodes)."""
    (folder / "site").mkdir()
    (folder / "site" / "sitecustomize.py").write_text(NOTE_THE_STORE_HOST_AT_TORCHS_IMPORT)
    (folder / "notes").mkdir()
    path = os.pathsep.join(filter(None, [str(folder / "site"), os.environ.get("PYTHONPATH")]))
    port = find_free_port()
    nodes = [c10d(port)] * 2 if meeting == "c10d" else [
        ["--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
         "--max-restarts", "1"] for node in (0, 1)]
    results = ended([launcher(folder, *arguments, "--nproc-per-node", "1", "place.py", PYTHONPATH=path,
                              NOTES=str(folder / "notes")) for arguments in nodes])
    assert [code for code, _, _ in results] == [0, 0], "\n".join(err[-3000:] for _, _, err in results)
    notes = sorted(note.read_text() for note in (folder / "notes").iterdir())
    assert notes == ["no store host yet", "store host started"], (notes, [err[-2000:] for _, _, err in results])


def test_a_static_endpoint_is_the_master_address_and_port(folder: Path) -> None:
    port = find_free_port()
    code, out, err = ended([launcher(folder, "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                     "place.py")])[0]
    assert code == 0, err
    assert f"rank 1 of 2 node 0 attempt 0 master 127.0.0.1:{port}" in out


def test_two_nodes_in_separate_network_namespaces_meet_at_the_rendezvous(
        two_namespaces: list[tuple[str, str]], tmp_path: Path) -> None:
    # The endpoint is node 0's address on a real (virtual) interface; the other namespace cannot
    # bind it, so it joins as a client and gets its node rank from the store.
    (tmp_path / "sum.py").write_text(textwrap.dedent(
        """
        import os, torch, torch.distributed as dist, ddpkit
        ddpkit.init_dist_connection(ddpkit.detect_environment())
        total = torch.ones(1) * dist.get_rank()
        dist.all_reduce(total)
        print(f"rank {dist.get_rank()} of {dist.get_world_size()} on node {os.environ['NODE_RANK']}: {total.item()}")
        ddpkit.destroy_dist_connection()
        """))
    endpoint = f"{two_namespaces[0][1]}:29533"
    arguments = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                 "--rdzv-id", "ns", "sum.py"]
    results = ended([launcher(tmp_path, *arguments, namespace=namespace) for namespace, _ in two_namespaces])
    assert [code for code, _, _ in results] == [0, 0], "\n".join(err[-3000:] for _, _, err in results)
    out = "".join(out for _, out, _ in results)
    assert sorted(re.findall(r"rank (\d) of 2 on node (\d): 1.0", out)) == [("0", "0"), ("1", "1")], out


def refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], folder: Path, *arguments: str) -> str:
    monkeypatch.chdir(folder)
    assert main(["run", *arguments]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("arguments", "message"), [
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1"], "--rdzv-backend='etcd': ddpkit run's rendezvous is"),
    (["--rdzv-backend", "c10d"], "--rdzv-backend=c10d needs --rdzv-endpoint HOST[:PORT]"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:99999"], "--rdzv-endpoint='h:99999': '99999' is not a TCP"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", ":80"], "--rdzv-endpoint=':80' names no host"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1", "--rdzv-conf", "join_timeout=soon"],
     "join_timeout='soon' is not a number of seconds"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "no-such-host.invalid:5"],
     "--rdzv-endpoint='no-such-host.invalid:5' does not resolve"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1", "--rdzv-id", ""], "needs --rdzv-id"),
])
def test_bad_rendezvous_settings_are_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                             folder: Path, arguments: list[str], message: str) -> None:
    assert message in refused(monkeypatch, capsys, folder, "--nnodes", "2", *arguments, "place.py")


def test_endpoints_and_settings_are_read_as_torchrun_reads_them() -> None:
    assert parse_endpoint("node0") == Endpoint("node0", DEFAULT_PORT) and DEFAULT_PORT == 29400
    assert parse_endpoint("node0:1234") == Endpoint("node0", 1234)
    assert parse_endpoint("[::1]:1234") == Endpoint("::1", 1234) and str(Endpoint("::1", 5)) == "[::1]:5"
    assert parse_rdzv_conf("") == StoreWaits(join_timeout=600, read_timeout=30)
    assert parse_rdzv_conf("read_timeout=60, join_timeout=30,last_call_timeout=5") == StoreWaits(30, 60, 5)
    assert parse_rdzv_conf("rdzv_timeout=9") == StoreWaits()  # torchrun's own tuning: ignored


def test_the_checks_of_the_script_hold_under_a_rendezvous_too(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], folder: Path) -> None:
    program = folder / "job.sh"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    c10d_here = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1"]
    assert "script 'missing.py' does not exist" in refused(monkeypatch, capsys, folder, *c10d_here, "missing.py")
    message = refused(monkeypatch, capsys, folder, *c10d_here, "--recovery", "in-place", "--max-restarts", "1",
                      "--no-python", "./job.sh")
    assert "--recovery in-place with --no-python" in message


def test_a_stranger_at_the_endpoint_takes_no_nodes_place(folder: Path) -> None:
    """Between the first launcher's arrival and the second's, a process outside the job that reaches
    the endpoint adds to the arrival counts (the one ddpkit kept before job secrets, and the
    tickets') and writes the next tickets itself (issue 33): both nodes still form the job."""
    port = find_free_port()
    secret = {"DDPKIT_JOB_SECRET": "both-nodes-share-this-secret"}
    first = launcher(folder, *c10d(port), "--nproc-per-node", "1", "place.py", **secret)
    stranger = textwrap.dedent(f"""
        import time
        from datetime import timedelta
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", {port}, is_master=False, timeout=timedelta(seconds=30))
        deadline = time.monotonic() + 30
        while (not [key for key in store.list_keys() if key.endswith(("rendezvous/tickets", "rendezvous/arrived"))]
               and time.monotonic() < deadline):
            time.sleep(0.02)
        store.add("ddpkit/rendezvous/arrived", 1)
        for key in [key for key in store.list_keys() if key.endswith("rendezvous/tickets")]:
            drawn = int(store.add(key, 1))
            for number in range(1, drawn + 3):
                if number != 1:  # the first launcher's stays; the rest are taken or pre-empted
                    store.set(key.replace("tickets", f"ticket/{{number}}"), "arrived")
        print("struck", flush=True)
        """)
    struck = subprocess.run([sys.executable, "-c", stranger], capture_output=True, text=True, timeout=60)
    assert "struck" in struck.stdout, struck.stderr
    second = launcher(folder, *c10d(port), "--nproc-per-node", "1", "place.py", **secret)
    results = ended([first, second], timeout=60)
    assert [code for code, _, _ in results] == [0, 0], "\n".join(err[-3000:] for _, _, err in results)
    assert sorted(int(re.findall(r"this is node (\d) of 2", err)[0]) for _, _, err in results) == [0, 1]


def test_ddpkit_store_serves_until_stopped_and_refuses_a_port_it_cannot_listen_on(folder: Path) -> None:
    port = find_free_port()
    store = subprocess.Popen([sys.executable, "-m", "ddpkit", "store", "--host", "127.0.0.1", "--port", str(port)],
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert store.stdout is not None and "serving a job's store on 127.0.0.1 port" in store.stdout.readline()
        taken = subprocess.run([sys.executable, "-m", "ddpkit", "store", "--port", str(port)], capture_output=True,
                               text=True, timeout=60)
        assert taken.returncode == 2 and f"cannot listen on every interface port {port}" in taken.stderr, taken.stderr
        store.send_signal(signal.SIGTERM)
        out, _ = store.communicate(timeout=30)
        assert store.returncode == 0 and "stopped" in out
    finally:
        store.kill()
        store.wait()
    bad = subprocess.run([sys.executable, "-m", "ddpkit", "store", "--port", "70000"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--port='70000' is not a TCP port (1..65535)" in bad.stderr
