"""``ddpkit report FILE [--plot out.png]``: what a ``ddpkit run --metrics FILE`` job's windows say
(``health.job_health``): one line per window, the stragglers named, and with ``--plot`` the step time
and each phase per rank over time, and across nodes each node's link time (matplotlib, which
``ddpkit run`` itself does not need)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ddpkit.health.job_health import JobWindow, Straggler, read_job_windows_and_malformed

__all__ = ["draw_windows", "phases_held", "plot_windows", "report"]

#: The phases drawn, one panel each where the file holds them, the step time first.
PLOTTED = ("step", "forward", "backward", "communication", "optimizer", "data", "between")


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
    """Draw ``windows`` (``draw_windows``) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = draw_windows(windows)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def phases_held(windows: Sequence[JobWindow]) -> list[str]:
    """The phases the windows hold a time for (``PLOTTED``'s order), each drawn in a panel of its own."""
    return [phase for phase in PLOTTED
            if any(entry.get(phase) is not None for window in windows for entry in window.ranks)]


def draw_windows(windows: Sequence[JobWindow]) -> Any:
    """A matplotlib figure: each phase's median per rank per window, a panel per phase (and across
    nodes one of each node's link time). Time runs from the first window's start; every axis of
    milliseconds starts at 0; each rank (and node) is named once, in the figure's legend; each
    window that named a straggler is shaded on its phase's panels and the step's, with its rank and phase."""
    import matplotlib.pyplot as plt

    ranks = sorted({rank["rank"] for window in windows for rank in window.ranks})
    nodes = sorted({node for window in windows for node in window.links}, key=int)
    phases = phases_held(windows)
    origin = windows[0].start
    panels = len(phases) + bool(nodes)  # across nodes, the nodes' link times last
    figure, grid = plt.subplots(panels, 1, figsize=(9, 1.9 * panels + 1.0), sharex=True, squeeze=False)
    axes = [row[0] for row in grid]
    panel_of = dict(zip([*phases, *(["link"] if nodes else [])], axes, strict=True))
    colours = {rank: f"C{index % 10}" for index, rank in enumerate(ranks)}

    def middle(window: JobWindow) -> float:  # a window's median is drawn at its middle
        return window.start - origin + window.seconds / 2

    for phase in phases:
        axis = panel_of[phase]
        for rank in ranks:
            points = [(middle(window), 1000 * entry[phase]) for window in windows for entry in window.ranks
                      if entry["rank"] == rank and entry.get(phase) is not None]
            axis.plot([x for x, _ in points], [y for _, y in points], marker=".", color=colours[rank], label=f"rank {rank}")
        axis.set_ylabel(f"{_PANEL_NAMES.get(phase, phase)}\n(ms)", fontsize="small")
    if nodes:
        for index, node in enumerate(nodes):
            points = [(middle(window), 1000 * window.links[node]) for window in windows if node in window.links]
            panel_of["link"].plot([x for x, _ in points], [y for _, y in points], marker="x", linestyle="--",
                                  color=f"C{(len(ranks) + index) % 10}", label=f"node {node}")
        panel_of["link"].set_ylabel("link of each node\n(ms)", fontsize="small")
    for axis in axes:
        axis.set_ylim(0, axis.get_ylim()[1] * 1.25)  # room above the lines for a straggler's label
        axis.grid(alpha=0.3)
    _shade_stragglers(windows, origin, panel_of)
    axes[-1].set_xlim(0, max(window.start - origin + window.seconds for window in windows))
    axes[-1].set_xlabel(f"seconds since the first window's start ({time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(origin))})")
    handles, labels = [], []
    for axis in axes:
        for handle, label in zip(*axis.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    height = figure.get_figheight()
    figure.suptitle("ddpkit report: each rank's median per window (shaded: a straggler named)",
                    y=1 - 0.1 / height, va="top", fontsize="medium")
    figure.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.35 / height),
                  ncol=min(8, len(labels)), fontsize="small", frameon=False)
    figure.tight_layout(rect=(0, 0, 1, 1 - 0.7 / height))
    return figure


# A panel's name: the phase as the health line says it, short.
_PANEL_NAMES = {"step": "step", "forward": "forward", "backward": "backward", "communication": "communication",
                "optimizer": "optimizer step", "data": "data wait", "between": "between steps"}
# The panels a straggler of each phase is shaded on, besides the step's.
_STRAGGLER_PANELS = {"compute": ("forward", "backward"), "data": ("data",), "link": ("link",)}


def _shade_stragglers(windows: Sequence[JobWindow], origin: float, panel_of: dict[str, Any]) -> None:
    """One band, labelled once, for each run of windows that named the same straggler."""
    bands: list[tuple[str, str, float, float]] = []  # (who, phase, from, to), seconds since ``origin``
    for window in windows:
        left, right = window.start - origin, window.start - origin + window.seconds
        for fields in window.stragglers:
            straggler = Straggler(**fields)
            who = f"node {straggler.node}" if straggler.phase == "link" else f"rank {straggler.rank}"
            same = [index for index, band in enumerate(bands) if band[:2] == (who, straggler.phase)
                    and abs(band[3] - left) < 1e-6]
            if same:
                bands[same[0]] = (who, straggler.phase, bands[same[0]][2], right)
            else:
                bands.append((who, straggler.phase, left, right))
    for who, phase, left, right in bands:
        for name in ("step", *_STRAGGLER_PANELS.get(phase, ())):
            axis = panel_of.get(name)
            if axis is not None:
                axis.axvspan(left, right, color="red", alpha=0.08)
                axis.text((left + right) / 2, 0.97, f"{who}: {_PANEL_NAMES.get(phase, phase)}",
                          transform=axis.get_xaxis_transform(), ha="center", va="top", fontsize="small",
                          color="darkred", bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
