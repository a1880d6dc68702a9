"""One rank's failure reaches the others through the store, in seconds, naming the rank and its
exception (ddpkit.diagnostics.failures), with a process-group timeout of 5 s and Gloo, no launcher involved."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from helpers import Flaky

import ddpkit
from ddpkit.diagnostics.failures import PeerFailedError
from ddpkit.diagnostics.hangs import watch_for_hangs
from ddpkit.testing import WorkerPool

PG_TIMEOUT = 5.0


def outcome(action, own: type[Exception] = ValueError) -> tuple[str, str, int | None, float]:  # type: ignore[no-untyped-def]
    """Run ``action``; report which exception ended it (a peer's, or this rank's ``own``), its
    text, the rank it names and when."""
    start = time.monotonic()
    try:
        action()
    except PeerFailedError as error:
        return "peer", str(error), error.rank, time.monotonic() - start
    except own as error:
        return "own", str(error), None, time.monotonic() - start
    return "none", "", None, time.monotonic() - start


def train_with_a_failing_forward(failing_rank: int) -> tuple[str, str, int | None, float]:
    model = ddpkit.DistributedDataParallel(Flaky(failing_rank, failing_step=3))

    def train() -> None:
        for _ in range(6):
            model(torch.randn(8, 4)).sum().backward()

    return outcome(train)


def check(results: list[tuple[str, str, int | None, float]], failing_rank: int) -> None:
    for rank, (kind, text, named, seconds) in enumerate(results):
        if rank == failing_rank:
            assert kind == "own" and f"rank {failing_rank} broke on purpose" in text
        else:
            assert kind == "peer", (kind, text)
            assert named == failing_rank
            assert text.startswith(f"rank {failing_rank} failed: ValueError: rank {failing_rank} broke on purpose")
            assert "Flaky" in text or "guard" in text or "Traceback" in text  # the failing rank's traceback
            assert seconds < PG_TIMEOUT, seconds  # not the process-group timeout: the peer was freed


@pytest.mark.parametrize("failing_rank", [1, 0], ids=["rank1-fails", "rank0-fails-it-hosts-the-store"])
def test_a_failing_step_is_named_on_every_rank_before_the_timeout(failing_rank: int) -> None:
    with WorkerPool(2, timeout=60, pg_timeout=PG_TIMEOUT) as pool:
        check(pool.run(train_with_a_failing_forward, failing_rank), failing_rank)


def train_with_a_failing_forward_while_watching_for_hangs(failing_rank: int) -> tuple[str, str, int | None, float]:
    watch_for_hangs(30)
    try:
        return train_with_a_failing_forward(failing_rank)
    finally:
        watch_for_hangs(None)


def test_hang_diagnosis_does_not_keep_a_failed_rank_connected() -> None:
    # The watch once held the group itself, which kept its connections open after the failing
    # rank destroyed it: the peer waited for the whole process-group timeout.
    with WorkerPool(2, timeout=60, pg_timeout=PG_TIMEOUT) as pool:
        check(pool.run(train_with_a_failing_forward_while_watching_for_hangs, 1), 1)


def train_with_an_optimizer_and_a_failing_forward(failing_rank: int) -> tuple[str, str, int | None, float]:
    """As users train: optimizer steps (which import torch._dynamo after the group exists) before the failure."""
    model = ddpkit.DistributedDataParallel(Flaky(failing_rank, failing_step=3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train() -> None:
        for _ in range(6):
            optimizer.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            optimizer.step()

    return outcome(train)


def test_a_failure_after_optimizer_steps_still_frees_the_peers() -> None:
    """torch._dynamo, imported by the first optimizer step while the group exists, kept the group
    alive past guard()'s teardown; ddpkit.membership.connection imports it before any group exists."""
    with WorkerPool(2, timeout=60, pg_timeout=PG_TIMEOUT) as pool:
        check(pool.run(train_with_an_optimizer_and_a_failing_forward, 1), 1)


def collectives_with_a_guarded_failure() -> tuple[str, str, int | None, float]:
    def work() -> None:
        for step in range(4):
            with ddpkit.guard():
                if dist.get_rank() == 1 and step == 2:
                    time.sleep(0.5)  # rank 0 is already waiting in the collective
                    raise ValueError("rank 1 broke on purpose")
                ddpkit.sync_ddp(torch.ones(3))

    return outcome(work)


def test_a_guarded_failure_frees_a_rank_blocked_in_a_collective() -> None:
    with WorkerPool(3, timeout=60, pg_timeout=PG_TIMEOUT) as pool:
        check(pool.run(collectives_with_a_guarded_failure), failing_rank=1)


DIES_WHILE_SAVING = """
import os, signal, sys
import torch
import ddpkit

class KillsRankZeroWhenPickled:
    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)

strategy = ddpkit.DDPStrategy()
strategy.setup_environment()
path = sys.argv[1]
strategy.save_checkpoint(path, {"epoch": 1, "weights": torch.ones(1000)})
strategy.save_checkpoint(path, {"epoch": 2, "weights": torch.zeros(100000), "dies": KillsRankZeroWhenPickled()})
"""


def test_rank_zero_killed_while_saving_leaves_the_previous_checkpoint_loadable(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    script, checkpoint = tmp_path / "dies_saving.py", tmp_path / "ckpt.pt"
    script.write_text(DIES_WHILE_SAVING)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", str(script), str(checkpoint)],
                            capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < 30
    assert result.returncode != 0 and "rank 0" in result.stderr and "SIGKILL" in result.stderr, result.stderr
    loaded = torch.load(checkpoint, weights_only=True)
    assert loaded["epoch"] == 1 and torch.equal(loaded["weights"], torch.ones(1000))


def a_local_runtime_error_leaves_the_store_as_it_was() -> tuple[str, float, float]:
    store = dist.distributed_c10d._get_default_store()
    before = store.timeout.total_seconds()
    try:
        ddpkit.sync_ddp(torch.ones(2), reduce_op=dist.ReduceOp.BAND)  # Gloo refuses bitwise ops on floats
    except RuntimeError as error:
        kind = type(error).__name__
    else:
        kind = "no error"
    return kind, before, store.timeout.total_seconds()


def test_looking_for_a_peer_failure_does_not_change_the_store(pool2: WorkerPool) -> None:
    for kind, before, after in pool2.run(a_local_runtime_error_leaves_the_store_as_it_was, timeout=30):
        assert kind == "RuntimeError"  # the original error, since no rank published a failure
        assert after == before


QUERY_HAS_NO_EFFECTS = """
import json, sys
import torch.distributed as dist
from ddpkit.diagnostics import failures
from ddpkit.diagnostics.records import failure_record

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
store = dist.distributed_c10d._get_default_store()
signer = failures.record_signer()
key = signer.key(failures.FAILURE)
store.set(key, signer.sign(key, json.dumps(failure_record(1, "ValueError", "broken", "a trace"))))
hook = sys.excepthook
found = [failures.peer_failure() for _ in range(3)]
print("query", [type(f).__name__ for f in found], sys.excepthook is hook, failures.peer_failure_raised(),
      store.check([signer.key(failures._SEEN)]))
failures.raising(found[0])
print("raising", sys.excepthook is hook, failures.peer_failure_raised(), int(store.add(signer.key(failures._SEEN), 0)))
"""


def test_looking_for_a_peer_failure_is_a_query_and_raising_it_is_said_once() -> None:
    """``peer_failure`` changes nothing (no exit hook, no acknowledgement); ``raising`` does both."""
    result = subprocess.run([sys.executable, "-c", QUERY_HAS_NO_EFFECTS], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "query ['PeerFailedError', 'PeerFailedError', 'PeerFailedError'] True False False" in result.stdout
    assert "raising False True 1" in result.stdout


def save_where_rank_zero_cannot_write(folder: str) -> tuple[str, str, int | None, float]:
    from helpers import strategy

    s = strategy()
    blocker = f"{folder}/a-file"
    if s.is_global_zero:
        open(blocker, "w").close()
    return outcome(lambda: s.save_checkpoint(f"{blocker}/ckpt.pt", {"step": 1}), own=OSError)


def test_rank_zero_failing_to_write_a_checkpoint_is_named_on_the_ranks_waiting_for_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with WorkerPool(2, timeout=60, pg_timeout=PG_TIMEOUT) as pool:
        (kind0, text0, _, _), (kind1, text1, named, seconds) = pool.run(save_where_rank_zero_cannot_write, str(tmp_path))
    assert kind0 == "own" and "Errno" in text0, text0  # cannot make a folder where a file is
    assert kind1 == "peer" and named == 0 and text1.startswith("rank 0 failed: "), text1
    assert seconds < PG_TIMEOUT


RECONCILED_TRACE = 'Traceback (most recent call last):\n  File "train.py", line 9, in <module>\nValueError: bad batch 7\n'


def reconcile_on_rank_one(folder: str) -> tuple[str, str, int | None, float] | dict[str, object]:
    """Rank 1 handles its own exception and reports it as a Lightning trainer would; rank 0 waits at a barrier."""
    import json
    import os

    from helpers import strategy

    s = strategy()
    if s.global_rank == 0:
        return outcome(lambda: s.barrier("next epoch"))
    error_file = os.path.join(folder, "rank1.json")
    pool_error_file = os.environ.get("DDPKIT_ERROR_FILE")
    os.environ["DDPKIT_ERROR_FILE"] = error_file  # as `ddpkit run` sets it
    try:
        time.sleep(0.3)  # rank 0 is already waiting
        s.reconciliate_processes(RECONCILED_TRACE)
    finally:
        if pool_error_file is None:
            del os.environ["DDPKIT_ERROR_FILE"]
        else:
            os.environ["DDPKIT_ERROR_FILE"] = pool_error_file
    with open(error_file, encoding="utf-8") as handle:
        record: dict[str, object] = json.load(handle)
    return record


# Beside another test: the bound (2 s, against a process-group timeout of PG_TIMEOUT) is on a rank
# freed by the failure's record, which it reads as soon as the kernel wakes it.
def test_reconciliate_processes_names_the_failure_on_the_other_ranks_and_for_the_launcher(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with WorkerPool(2, timeout=60, pg_timeout=PG_TIMEOUT) as pool:
        (kind, text, named, seconds), record = pool.run(reconcile_on_rank_one, str(tmp_path))
    assert kind == "peer" and named == 1, (kind, text)
    assert text.startswith("rank 1 failed: ValueError: bad batch 7") and 'File "train.py", line 9' in text
    assert seconds < 2.0, seconds  # freed by the record, not the process-group timeout
    assert record["rank"] == 1 and record["type"] == "ValueError" and record["message"] == "bad batch 7"
    assert record["traceback"] == RECONCILED_TRACE
