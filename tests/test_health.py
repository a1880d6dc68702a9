"""The job's health (issue 49): each rank's step windows (``diagnostics.step_windows``), the
launcher's view of them (``health.job_health``: the health line, the metrics file, stragglers
named) and ``ddpkit report``. Here on records made up to the point; tests/test_stragglers.py runs
real jobs with a rank made slow."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.diagnostics.step_windows import RankWindow, WindowRecorder, read_windows
from ddpkit.health.job_health import JobHealth, compare_ranks, read_job_windows
from ddpkit.health.report import report


def window(rank: int, start: float, forward: float = 0.010, backward: float = 0.020, data: float = 0.002,
           communication: float = 0.005) -> RankWindow:
    step = data + 0.001 + forward + backward + communication
    return RankWindow(rank, start, 1.0, 50, data + 0.001, forward, backward, communication, 0.001, data, step, step * 1.1,
                      covered=0.9)


def test_a_rank_writes_one_line_per_window_once_the_next_windows_first_step_ends(tmp_path: Path) -> None:
    path = str(tmp_path / "rank.windows")
    recorder = WindowRecorder(path, 2.0, to_wall=0.0)  # perf_counter readings are wall-clock time here
    for ended, forward in [(100.5, 0.01), (100.9, 0.03), (101.9, 0.02), (102.1, 0.5), (102.5, 0.5)]:
        recorder.add(ended, between=0.004, forward=forward, backward=0.02, communication=0.001, optimizer=0.001)
    windows, offset = read_windows(path, 0)
    assert len(windows) == 1 and offset == Path(path).stat().st_size  # 102-104 has not ended yet
    (first,) = windows
    assert (first.start, first.seconds, first.steps) == (100.0, 2.0, 3)
    assert first.forward == pytest.approx(0.02) and first.compute == pytest.approx(0.04)
    assert first.data == pytest.approx(0.003) and first.step == pytest.approx(0.045)
    assert first.covered == pytest.approx(0.035 + 0.055 + 0.045)  # the three steps' time, not the window's
    assert read_windows(path, offset) == ([], offset)
    with open(path, "a") as handle:  # a line still being written is left for the next read
        handle.write('{"rank": 0, "start"')
    assert read_windows(path, offset) == ([], offset)


def test_the_rank_slower_in_its_compute_or_its_data_comes_first_and_noise_below_the_share_does_not() -> None:
    compared = compare_ranks([window(0, 0), window(1, 0, forward=0.025), window(2, 0)])
    assert compared[0][:2] == (1, "compute") and compared[0][2] == pytest.approx(1.5)
    compared = compare_ranks([window(0, 0, data=0.0001), window(1, 0, data=0.00015)])
    rank, phase, factor, share, _ = next(entry for entry in compared if entry[1] == "data" and entry[0] == 1)
    assert factor == pytest.approx(1.5) and share < 0.01  # 1.5x of almost nothing
    health = JobHealth(1.0, False, None, 1.2)
    jobs = [health.window([window(0, start, data=0.0001), window(1, start, data=0.00015)]) for start in range(4)]
    assert not any(job.stragglers for job in jobs)


def test_a_straggler_is_named_after_two_windows_once_and_said_well_after_two_more(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    metrics = tmp_path / "metrics.jsonl"
    health = JobHealth(2.5, True, str(metrics), 1.2, node=0, recoveries=lambda: 1)  # two windows are 5 s
    slow = [False, True, True, True, False, False, False]
    for start, rank1_slow in enumerate(slow):
        health.window([window(0, start), window(1, start, backward=0.045 if rank1_slow else 0.021)])
    lines = capfd.readouterr().err.splitlines()  # ddpkit's logger writes to stderr's descriptor
    named = [line for line in lines if "run: straggler:" in line]
    assert len(named) == 1 and named[0].startswith("ddpkit run: straggler: rank 1 (node 0, host ")
    assert "its compute (forward + backward) is 1.83x the other ranks' median since" in named[0]
    assert lines.index(named[0]) == 2  # in the second slow window, before its health line
    well = [line for line in lines if "no longer a straggler" in line]
    assert len(well) == 1 and lines.index(well[0]) == 6  # in the second window well again
    health_lines = [line for line in lines if line.startswith("ddpkit run: health ")]
    assert len(health_lines) == 7 and "2 ranks, 55.6 steps/s, step 38.5 ms (p90 42.9 ms)" in health_lines[0]
    assert "slowest rank 1 (node 0): compute 1.83x the others' median" in health_lines[1]
    windows = read_job_windows(str(metrics))
    assert len(windows) == 7 and [bool(job.stragglers) for job in windows] == [False, False, True, True, True, False,
                                                                                False]
    assert windows[2].stragglers[0]["since"] == 1.0 and windows[2].recoveries == 1
    assert [rank.rank for rank in windows[0].rank_windows()] == [0, 1]


def test_with_short_windows_a_rank_must_be_slow_for_five_seconds_to_be_named() -> None:
    """A spell of a busy host (seconds, either rank) is not a straggler; one that stays is."""
    health = JobHealth(1.0, False, None, 1.2)
    slow = [window(0, start) if start % 4 < 3 else window(0, start, backward=0.05) for start in range(4)] * 3
    assert not any(health.window([rank0, window(1, 0)]).stragglers for rank0 in slow)
    named = [bool(health.window([window(0, start), window(1, start, backward=0.05)]).stragglers) for start in range(6)]
    assert named == [False, False, False, False, True, True]


def test_a_straggler_whose_node_is_replaced_is_watched_afresh_and_named_again_if_its_replacement_is_slow() -> None:
    """``--stragglers replace`` (``JobHealth.on_named``): each straggler named is handed on once; when
    its node is being replaced, its ranks' record starts again, so a slow replacement is named anew."""
    asked: list[tuple[int, int]] = []
    health = JobHealth(2.5, False, None, 1.2, on_named=lambda straggler: asked.append((straggler.rank, straggler.node)) or True)
    placed = {0: (0, "a"), 1: (1, "b")}
    named = [bool(health.window([window(0, start), window(1, start, backward=0.045)], placed).stragglers)
             for start in range(5)]
    assert asked == [(1, 1), (1, 1)] and named == [False, True, False, True, False]


def test_a_window_the_steps_did_not_fill_names_nobody(tmp_path: Path) -> None:
    """A run's first window holds its start-up: a rank that started later, or imported slower, is no straggler."""
    health = JobHealth(1.0, False, None, 1.2)
    partial = dataclasses.replace(window(1, 0, backward=0.1), covered=0.3)
    assert not any(health.window([window(0, start), partial]).stragglers for start in range(4))


def test_the_launcher_reports_a_window_once_every_rank_wrote_it_or_a_window_later(tmp_path: Path) -> None:
    files = [str(tmp_path / f"rank{rank}.windows") for rank in (0, 1)]
    health = JobHealth(1.0, False, str(tmp_path / "metrics.jsonl"), 1.2)
    for rank, path in enumerate(files):
        with open(path, "w") as handle:
            handle.write(window(rank, 100.0).to_json() + "\n" + (window(rank, 101.0).to_json() + "\n" if rank else ""))
    health.poll(files, 2, now=102.2)
    assert [job.start for job in read_job_windows(str(tmp_path / "metrics.jsonl"))] == [100.0]
    health.poll(files, 2, now=104.5)  # rank 0 never wrote 101 (lost): reported without it
    assert [len(job.ranks) for job in read_job_windows(str(tmp_path / "metrics.jsonl"))] == [2, 1]


def test_ddpkit_report_prints_each_window_and_the_stragglers_and_plots_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    metrics = tmp_path / "metrics.jsonl"
    health = JobHealth(2.5, False, str(metrics), 1.2)
    for start in range(4):
        health.window([window(0, start), window(1, start, data=0.030)])
    assert report(str(metrics), str(tmp_path / "plot.png")) == 0
    out = capsys.readouterr().out
    assert out.count("health ") == 4 and "straggler: rank 1 (node 0, host" in out and "data wait" in out
    assert "4 windows, 1 stragglers named, 0 recoveries" in out
    assert (tmp_path / "plot.png").stat().st_size > 10_000
    assert report(str(tmp_path / "missing.jsonl")) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value", "said"), [("--report-every", "-1", "is not a number of seconds"),
                                                     ("--straggler-factor", "0.5", "is not a factor of 1 or more")])
def test_a_health_flag_out_of_range_is_refused_naming_it(tmp_path: Path, flag: str, value: str, said: str) -> None:
    (tmp_path / "train.py").write_text("")
    result = subprocess.run([sys.executable, "-m", "ddpkit", "run", flag, value, str(tmp_path / "train.py")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"{flag}='{value}' {said}" in result.stderr, result.stderr


def test_a_node_whose_link_time_stays_over_the_others_by_the_factor_and_20_ms_is_named_as_its_first_rank(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Across nodes each window holds the nodes' link times (``health.link_probe``): a node 1.5x
    the others' median by 6 ms is a busy host, not a slow link; one 4.5x by 40 ms, two windows in a
    row, is named for its link, as its first rank, and ``ddpkit report --plot`` draws the links."""
    metrics = tmp_path / "metrics.jsonl"
    health = JobHealth(2.5, False, str(metrics), 1.2)
    placed = {rank: (rank // 2, "abc"[rank // 2]) for rank in range(6)}
    near = [health.window([window(rank, start) for rank in range(6)], placed, {0: 0.012, 1: 0.018, 2: 0.011})
            for start in range(3)]
    assert not any(job.stragglers for job in near) and near[0].slowest is not None
    assert near[0].slowest["phase"] == "link" and near[0].slowest["rank"] == 2  # the slowest, not a straggler
    far = [health.window([window(rank, start) for rank in range(6)], placed, {0: 0.012, 1: 0.052, 2: 0.011})
           for start in range(3, 6)]
    assert [bool(job.stragglers) for job in far] == [False, True, True]
    named = far[1].stragglers[0]
    assert (named["rank"], named["node"], named["host"], named["phase"]) == (2, 1, "b", "link")
    assert named["factor"] == pytest.approx(0.052 / 0.0115, rel=1e-3) and far[1].links["1"] == 0.052
    assert report(str(metrics), str(tmp_path / "plot.png")) == 0
    out = capsys.readouterr().out
    assert "straggler: rank 2 (node 1, host b): its node's link (its launcher sending 4 MiB to its neighbours') is " \
           "4.52x the other nodes' median" in out
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_ddpkit_report_names_the_lines_that_are_not_windows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A line cut short (the job ended while writing it) or another file's: counted and named, not
    passed over in silence; a file of nothing else is refused as not a metrics file."""
    metrics = tmp_path / "metrics.jsonl"
    health = JobHealth(2.5, False, str(metrics), 1.2)
    for start in range(3):
        health.window([window(0, start), window(1, start)])
    good = metrics.read_text().splitlines()
    metrics.write_text("\n".join([good[0], "not json", good[1], good[2][:40]]) + "\n")
    assert report(str(metrics)) == 0
    captured = capsys.readouterr()
    assert "2 windows" in captured.out
    assert (f"ddpkit report: 2 line(s) of {metrics} are not windows and were passed over (lines 2, 4): cut short by a "
            "job that ended while writing, or another file's.") in captured.err
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(b"\x00\xff garbage\n{\"x\": 1}\n")
    assert report(str(garbage)) == 2
    assert (f"{garbage} holds no window of ddpkit run --metrics: none of its 2 lines is one (lines 1, 2)"
            in capsys.readouterr().err)


@pytest.mark.parametrize(("name", "said"), [
    ("no-such-folder/plot.png", "the folder {folder} does not exist"),
    ("plot.xyz", ".xyz is not a format matplotlib writes; end the path with one of"),
    ("plot", "no extension is not a format matplotlib writes"),
])
def test_ddpkit_report_refuses_a_plot_path_it_cannot_write_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, said: str) -> None:
    metrics = tmp_path / "metrics.jsonl"
    JobHealth(2.5, False, str(metrics), 1.2).window([window(0, 0), window(1, 0)])
    assert report(str(metrics), str(tmp_path / name)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said.format(folder=tmp_path / "no-such-folder") in err, err


def test_the_plot_reads_at_a_glance(tmp_path: Path) -> None:
    """Issue 64, item 5: every phase the file holds in a panel whose milliseconds start at 0, time
    from the first window's start (a single window too), every rank named once for all panels, and
    each straggler's shading labelled with its rank and phase."""
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (pip install matplotlib; .ci/run installs it)")
    import matplotlib

    matplotlib.use("Agg")
    from ddpkit.health.report import draw_windows

    metrics = tmp_path / "metrics.jsonl"
    health = JobHealth(2.5, False, str(metrics), 1.2)
    for start in range(4):
        health.window([window(0, 1000.0 + start), window(1, 1000.0 + start, data=0.030)])
    figure = draw_windows(read_job_windows(str(metrics)))
    panels = {axis.get_ylabel().split("\n")[0]: axis for axis in figure.axes}
    assert list(panels) == ["step", "forward", "backward", "communication", "optimizer step", "data wait",
                            "between steps"]
    assert all(axis.get_ylim()[0] == 0 for axis in figure.axes)
    assert figure.axes[-1].get_xlim() == (0.0, 4.0) and "since the first window's start" in figure.axes[-1].get_xlabel()
    assert [text.get_text() for text in figure.legends[0].get_texts()] == ["rank 0", "rank 1"]
    assert all(axis.get_legend() is None for axis in figure.axes)
    labelled = {name: {text.get_text() for text in axis.texts} for name, axis in panels.items()}
    assert labelled["data wait"] == {"rank 1: data wait"} and labelled["step"] == {"rank 1: data wait"}
    assert labelled["forward"] == set()

    alone = draw_windows(read_job_windows(str(metrics))[:1])
    xs = [x for axis in alone.axes for line in axis.get_lines() for x in line.get_xdata()]
    assert alone.axes[-1].get_xlim() == (0.0, 1.0) and all(0 < x < 1 for x in xs)
