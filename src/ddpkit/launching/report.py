"""``ddpkit report FILE [--plot out.png]``: what a ``ddpkit run --metrics FILE`` job's windows say
(``launching.health``): one line per window, the stragglers named, and with ``--plot`` the step time
and each phase per rank over time, and across nodes each node's link time (matplotlib, which
``ddpkit run`` itself does not need)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

from ddpkit.launching.health import PHASE_NAMES, JobWindow, Straggler, read_job_windows_and_malformed

__all__ = ["plot_windows", "report"]

#: The phases drawn, one panel each, after the step time.
PLOTTED = ("step", "forward", "backward", "communication", "data")


def report(path: str, plot: str | None = None) -> int:
    """Print ``path``'s windows (and draw them to ``plot``); the exit code."""
    try:
        windows, malformed = read_job_windows_and_malformed(path)
    except OSError as error:
        print(f"ddpkit report: cannot read {path} ({error}). Give the file of ddpkit run --metrics.", file=sys.stderr)
        return 2
    if not windows and malformed:
        print(f"ddpkit report: {path} holds no window of ddpkit run --metrics: none of its {len(malformed)} lines is "
              f"one ({_lines(malformed)}). Give the file of ddpkit run --metrics.", file=sys.stderr)
        return 2
    if not windows:
        print(f"ddpkit report: {path} holds no window of ddpkit run --metrics (a job shorter than one window, "
              "--report-every, writes none).", file=sys.stderr)
        return 1
    if malformed:
        print(f"ddpkit report: {len(malformed)} line(s) of {path} are not windows and were passed over "
              f"({_lines(malformed)}): cut short by a job that ended while writing, or another file's.", file=sys.stderr)
    if plot is not None and (refused := _refuse_the_plot_path(plot)) is not None:
        print(f"ddpkit report: {refused}", file=sys.stderr)
        return 2
    for window in windows:
        print(window.line().removeprefix("ddpkit run: "))
    named: dict[tuple[int, str], Straggler] = {}
    for window in windows:
        for fields in window.stragglers:
            named.setdefault((fields["rank"], fields["phase"]), Straggler(**fields))
    for straggler in named.values():
        print(f"straggler: {straggler.describe()}")
    print(f"{len(windows)} windows, {len(named)} stragglers named, {windows[-1].recoveries} recoveries")
    if plot is not None:
        try:
            plot_windows(windows, plot)
        except ImportError:
            print("ddpkit report: --plot needs matplotlib: pip install matplotlib", file=sys.stderr)
            return 2
        print(f"plot: {plot}")
    return 0


def _lines(numbers: Sequence[int]) -> str:
    """Line numbers as a person reads them: the first ten, and how many more."""
    shown = ", ".join(map(str, numbers[:10]))
    return f"line{'s' if len(numbers) > 1 else ''} {shown}" + (f" and {len(numbers) - 10} more" if len(numbers) > 10 else "")


def _refuse_the_plot_path(path: str) -> str | None:
    """Why ``--plot path`` cannot be written (its folder missing, a format matplotlib does not write),
    or None. Without matplotlib: None (the plot then says what to install)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"--plot {path}: the folder {folder} does not exist. Make it, or give a path in a folder that does."
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return None
    formats = FigureCanvasBase.get_supported_filetypes()
    extension = os.path.splitext(path)[1].removeprefix(".").lower()
    if extension not in formats:
        return (f"--plot {path}: {'.' + extension if extension else 'no extension'} is not a format matplotlib "
                f"writes; end the path with one of {', '.join('.' + name for name in sorted(formats))}.")
    return None


def plot_windows(windows: Sequence[JobWindow], path: str) -> None:
    """Step time and each phase per rank over the windows, one panel each, to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({rank["rank"] for window in windows for rank in window.ranks})
    nodes = sorted({node for window in windows for node in window.links}, key=int)
    origin = windows[0].start
    panels = len(PLOTTED) + bool(nodes)  # across nodes, the nodes' link times last
    figure, axes = plt.subplots(panels, 1, figsize=(9, 2.2 * panels), sharex=True)
    for axis, phase in zip(axes, PLOTTED, strict=False):
        for rank in ranks:
            points = [(window.start - origin, 1000 * entry[phase]) for window in windows for entry in window.ranks
                      if entry["rank"] == rank]
            axis.plot([x for x, _ in points], [y for _, y in points], marker=".", label=f"rank {rank}")
        axis.set_ylabel(f"{PHASE_NAMES.get(phase, phase).split(' (')[0]} (ms)")
        for window in windows:
            if window.stragglers:
                axis.axvspan(window.start - origin, window.start - origin + window.seconds, color="red", alpha=0.08)
    if nodes:
        for node in nodes:
            points = [(window.start - origin, 1000 * window.links[node]) for window in windows if node in window.links]
            axes[-1].plot([x for x, _ in points], [y for _, y in points], marker=".", label=f"node {node}")
        axes[-1].set_ylabel("link (ms)")
        axes[-1].legend(loc="upper right", fontsize="small", ncol=min(4, len(nodes)))
    axes[0].legend(loc="upper right", fontsize="small", ncol=min(4, len(ranks)))
    axes[0].set_title(f"ddpkit report: median per window, from {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(origin))}"
                      " (red: a straggler named)")
    axes[-1].set_xlabel("seconds")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
