"""The report's panels, each drawn on its own matplotlib Axes from series.build()'s dict: throughput, the step
split, loss, metrics, and the timeline of phases and attempts; epoch marks and events across them."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, TypedDict, TypeVar, Unpack

from launcher.diagnose.series import Epoch, Point, Series, Timed

if TYPE_CHECKING:
    from matplotlib.axes import Axes

OUTCOME_COLOURS = {"succeeded": "#4c9a2a", "failed": "#c0392b", "preempted": "#e67e22", "shrunk": "#8e44ad",
                   "regrouped": "#16a085", "stopped": "#7f8c8d", None: "#95a5a6"}
PHASE_COLOURS = {"preflight": "#bdc3c7", "setup": "#d5dbdb", "to first step": "#e67e22", "training": "#27ae60",
                 "first step": "#e67e22",
                 "teardown": "#7f8c8d", "detected": "#c0392b", "spawn": "#f1c40f",  # the last four: a restart's
                 "backup copy": "#16a085", "steps redone": "#a04000"}
EVENT_COLOURS = {"failure": "#c0392b", "restart": "#2c3e50", "preemption": "#e67e22", "lost": "#8e44ad",
                 "back": "#16a085"}
BAR, LINE = "#9ecae1", "#08519c"
MAX_EPOCH_LABELS = 15  # more epochs than this: every n-th mark (and bar) is labelled
LOG_SPAN = 100.0  # a loss whose largest value is this many times its smallest (two decades) is drawn on a log axis
SPLIT: tuple[tuple[Literal["compute_ms", "wait_ms"], str, str], ...] = (
    ("compute_ms", "-", "own work"), ("wait_ms", "--", "waiting"))

T = TypeVar("T", bound=Timed)


class Style(TypedDict, total=False):
    """What _lines hands to matplotlib's plot for each line."""

    color: str
    marker: str
    markersize: float
    linewidth: float
    alpha: float


def _empty(ax: Axes, words: str) -> None:
    ax.text(0.5, 0.5, words, transform=ax.transAxes, ha="center", va="center", color="grey")


def _from_zero(ax: Axes, values: list[float]) -> None:
    top = max(values, default=0.0)
    ax.set_ylim(0, top * 1.15 if top > 0 else 1)


def _legend(ax: Axes) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, frameon=False)


def _lines(ax: Axes, points: list[T], value: Callable[[T], float | None], style: str, label: str | None,
           **kw: Unpack[Style]) -> list[float]:
    """One line per attempt (a line never joins two attempts across a restart) of `value(point)`; labelled once.
    The values drawn."""
    attempts: dict[int, list[tuple[float, float]]] = {}
    for p in points:
        if (v := value(p)) is not None:
            attempts.setdefault(p["attempt"], []).append((p["t"], v))
    for pts in attempts.values():
        ax.plot(*zip(*pts), style, label=label, **kw)
        label = None
    return [v for pts in attempts.values() for _, v in pts]


def throughput(ax: Axes, data: Series) -> None:
    """The training throughput (worker.training.progress.training_rate): each epoch's as a bar over the time it took, the
    epoch's so far as a line; the group's, once (series: group)."""
    epochs = [(e, rate) for e in data["group"]["epochs"] if (rate := e["samples_per_s"]) is not None]
    within = data["group"]["within"]
    label: str | None = "per epoch: its console\nline's samples/s"
    every = max(1, math.ceil(len(epochs) / MAX_EPOCH_LABELS))  # as the epoch marks: labels that do not overlap
    for n, (e, rate) in enumerate(epochs):
        if e["start"] is not None and e["t"] > e["start"]:
            ax.bar(e["start"], rate, width=e["t"] - e["start"], align="edge", color=BAR,
                   edgecolor="#3182bd", linewidth=0.8, label=label)
        else:
            ax.plot([e["t"]], [rate], "s", color="#3182bd", label=label)
        label = None
        if not labelled(n, len(epochs), every):
            continue
        middle = (e["start"] + e["t"]) / 2 if e["start"] is not None else e["t"]
        ax.annotate(f"{rate:.0f}", (middle, rate), textcoords="offset points",
                    xytext=(0, -3), ha="center", va="top", fontsize=7, color="#08306b")
    if within:
        tasks = ", ".join(map(str, sorted({p["task"] for p in within})))
        _lines(ax, within, lambda p: p["samples_per_s"], "-", f"within epochs: the epoch\nso far (task {tasks})",
               marker=".", markersize=3, color=LINE, linewidth=1.2)
    if not epochs and not within:
        _empty(ax, "no samples/s recorded")
    _from_zero(ax, [rate for _, rate in epochs] + [p["samples_per_s"] for p in within])
    ax.set_ylabel("samples/s (group,\ntraining)")
    _legend(ax)


def step_split(ax: Axes, data: Series, colours: dict[int, str]) -> None:
    """Per task, its own work and its wait per step (ms)."""
    values: list[float] = []
    for task in data["tasks"]:
        for key, style, words in SPLIT:
            values += _lines(ax, task["points"], lambda p: p[key], style, f"task {task['index']} {words}",
                             color=colours[task["index"]], marker=".", markersize=3, linewidth=1.1)
    if not values:
        _empty(ax, "no step split recorded (compute_ms, wait_ms)")
    _from_zero(ax, values)
    ax.set_ylabel("ms per step")
    _legend(ax)


def _within(data: Series) -> list[Point]:
    """The points of the lowest task per attempt: metrics are all-reduced, every task shows the same."""
    chosen: dict[int, int] = {}
    for task in data["tasks"]:
        for p in task["points"]:
            chosen.setdefault(p["attempt"], task["index"])
    return [p for task in data["tasks"] for p in task["points"] if chosen.get(p["attempt"]) == task["index"]]


def _per_epoch(ax: Axes, epochs: list[Epoch], name: str, marker: str, colour: str) -> list[float]:
    def value(e: Epoch) -> float | None:
        return e["loss"] if name == "loss" else e["metrics"].get(name)

    return _lines(ax, epochs, value, "-", f"{name} (epoch)", marker=marker, color=colour, linewidth=1.2,
                  markersize=5)


def loss(ax: Axes, data: Series) -> None:
    """The loss (and every metric named like one, val_loss) at each epoch's end; the running loss within."""
    epochs = data["group"]["epochs"]
    values: list[float] = []
    names = ["loss"] + sorted({m for e in epochs for m in e["metrics"] if "loss" in m})
    for n, name in enumerate(names):
        values += _per_epoch(ax, epochs, name, "os^v"[n % 4], f"C{n}")
    values += _lines(ax, _within(data), lambda p: p["loss"], "-", "loss within epochs\n(running mean)", color="C0",
                     alpha=0.4, linewidth=0.9)
    if not values:
        _empty(ax, "no loss recorded")
    elif min(values) > 0 and max(values) / min(values) >= LOG_SPAN:
        ax.set_yscale("log")
        ax.set_ylabel("loss (log axis)")
        _legend(ax)
        return
    elif min(values) >= 0:
        _from_zero(ax, values)
    ax.set_ylabel("loss")
    _legend(ax)


def metrics(ax: Axes, data: Series) -> None:
    """Every other metric (accuracy, val_accuracy, ...) at each epoch's end."""
    epochs = data["group"]["epochs"]
    names = sorted({m for e in epochs for m in e["metrics"] if "loss" not in m})
    for n, name in enumerate(names):
        _per_epoch(ax, epochs, name, "os^vD"[n % 5], f"C{n + 2}")
    if not names:
        _empty(ax, "no metrics recorded at an epoch's end")
    ax.set_ylabel("metrics")
    _legend(ax)


def labelled(n: int, count: int, every: int) -> bool:
    """Whether the n-th of `count` epochs is labelled: every `every`-th, and the last where it is not too close to
    the one before it (labels never overlap)."""
    return n % every == 0 or n == count - 1 and n % every >= every / 2


def epoch_marks(axes: list[Axes], data: Series) -> None:
    """A dotted line at each epoch's end, labelled with its number on every panel given."""
    epochs = data["group"]["epochs"]
    every = max(1, math.ceil(len(epochs) / MAX_EPOCH_LABELS))
    for n, e in enumerate(epochs):
        for ax in axes:
            ax.axvline(e["t"], color="#555555", linestyle=":", linewidth=0.8, zorder=0)
            if labelled(n, len(epochs), every):
                ax.annotate(f"epoch {e['epoch']}", (e["t"], 1), xycoords=("data", "axes fraction"), xytext=(-1, -2),
                            textcoords="offset points", ha="right", va="top", rotation=90, fontsize=6.5,
                            color="#555555")


def events(axes: list[Axes], data: Series) -> None:
    """Restarts, preemptions, lost hosts and failures: a line across every panel, numbered as in the notes."""
    for n, ev in enumerate(data["events"], 1):
        colour = EVENT_COLOURS[ev["kind"]]
        for ax in axes:
            ax.axvline(ev["t"], color=colour, linestyle="--", linewidth=1.2)
        axes[0].annotate(f"[{n}]", (ev["t"], 0.6 - 0.1 * ((n - 1) % 5)), xycoords=("data", "axes fraction"),
                         xytext=(3, 0), textcoords="offset points", fontsize=8, color=colour, weight="bold")


def timeline(ax: Axes, data: Series) -> None:
    """Phases (upper row) and attempts coloured by outcome (lower row)."""
    from matplotlib.patches import Patch

    until = data["until"] or 0.0
    for p in data["phases"]:
        ax.broken_barh([(p["start"], max(p["end"] - p["start"], 0.01))], (1.1, 0.8), color=PHASE_COLOURS[p["name"]])
    for a in data["attempts"]:
        end = a["end"] if a["end"] is not None else max(until, a["start"])
        ax.broken_barh([(a["start"], max(end - a["start"], 0.01))], (0.1, 0.8),
                       color=OUTCOME_COLOURS.get(a["outcome"], OUTCOME_COLOURS[None]))
        ax.text((a["start"] + end) / 2, 0.5, f"attempt {a['index']}: {a['outcome'] or 'running'}", ha="center",
                va="center", fontsize=7, color="white", clip_on=True)
    restart_parts: dict[str, float] = {}  # each restart's phases in the same row, summed over restarts in the legend
    guessed = {p["name"] for r in data["restart_phases"] for p in r["parts"] if p.get("estimated")}
    for r in data["restart_phases"]:
        for p in r["parts"]:
            ax.broken_barh([(p["start"], max(p["end"] - p["start"], 0.01))], (1.1, 0.8), color=PHASE_COLOURS[p["name"]],
                           hatch="//", edgecolor="white", linewidth=0.3)
            restart_parts[p["name"]] = restart_parts.get(p["name"], 0.0) + p["end"] - p["start"]
    handles = [Patch(color=PHASE_COLOURS[p["name"]], label=f"{p['name']} {p['end'] - p['start']:.1f} s")
               for p in data["phases"]]
    handles += [Patch(facecolor=PHASE_COLOURS[name], hatch="//", edgecolor="white",
                      label=f"restarts: {name} {'about ' if name in guessed else ''}{took:.1f} s")
                for name, took in restart_parts.items()]
    if handles:
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.45), ncols=min(len(handles), 5),
                  fontsize=8, frameon=False)
    ax.set_yticks([0.5, 1.5], ["attempts", "phases"])
    ax.set_ylim(0, 2)
