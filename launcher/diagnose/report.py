"""`mgpu-cluster report`: one PNG of a run, drawn from series.build(): throughput per epoch and within epochs,
each task's step split (own work, waiting), loss and metrics per epoch, phases and attempts; start-up compressed
on the time axis, failures and restarts in full words below. matplotlib: the `report` extra.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.diagnose import panels
from launcher.diagnose.series import Series, Startup
from launcher.errors import ReportError
from worker.host.files import write_private

if TYPE_CHECKING:
    import numpy as np
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from numpy.typing import ArrayLike, NDArray

    Scale = Callable[[ArrayLike], NDArray[np.float64]]  # one way of squeeze()'s time axis

STARTUP_SHARE = 0.12  # of the time axis: a longer start-up is compressed into it
WRAP = 150  # characters of a notes line at the figure's width
NOTE_LINE_IN = 0.16  # inches per notes line

RATE_NOTE = ("samples/s is the training throughput, the one figure the console's epoch lines, status, the page and "
             "/metrics show: samples trained / the seconds spent training them (each training step from its begin "
             "to its end; no validation, saves or fit's first, traced, step). It is the whole group's (every task "
             "trains the same global batch in step), so it is drawn once. Bars: each epoch's figure over the time "
             "it took (its console line's samples/s); line: the epoch's figure so far, which ends at the bar's.")
SPLIT_NOTE = ("own work: a task's time per step to compute its gradients (input, forward and backward pass). "
              "waiting: the rest of its step, in the all-reduce waiting for the slowest task, and the update. A task "
              "with more own work than its peers is the straggler: the others wait for it.")
EPOCH_NOTE = ("dotted lines: epoch ends, numbered; loss and metrics at each epoch's end as its console line "
              "(all-reduced: the same on every task), the running loss within epochs as a thin line (the mean over "
              "every replica's batches of the epoch so far, as Keras' progress bar shows it).")


def refused_words(data: Series) -> str:
    rid = data["run_id"]
    return (f"run {rid} ended in its preflight ({data['state'] or 'no state recorded'}): no task was started, so "
            f"there is nothing to draw. 'mgpu-cluster status {rid}' tells why.")


def knots(startups: list[Startup], until: float | None) -> tuple[list[float], list[float]] | None:
    """The time axis that draws the start-ups in STARTUP_SHARE of [0, until] together and the rest to scale, as
    the knots (times, positions) of a piecewise linear map; None where they take no more than that share anyway.
    The PNG (squeeze) and the live page's charts both draw with it."""
    if not until:
        return None
    spans = [(s["start"], min(s["end"], until)) for s in startups if s["start"] < min(s["end"], until)]
    taken = sum(b - a for a, b in spans)
    if not spans or taken >= until or taken <= STARTUP_SHARE * until:
        return None
    slow, fast = STARTUP_SHARE * until / taken, (1 - STARTUP_SHARE) * until / (until - taken)
    ts, xs = [-until, 0.0], [-until * fast, 0.0]  # knots; past both ends the axis goes on to scale
    for a, b in spans:
        if a > ts[-1]:
            ts, xs = ts + [a], xs + [xs[-1] + (a - ts[-1]) * fast]
        ts, xs = ts + [b], xs + [xs[-1] + (b - a) * slow]
    return ts + [until, 3 * until], xs + [until, 3 * until]


def squeeze(startups: list[Startup], until: float | None) -> tuple[Scale, Scale] | None:
    """(forward, inverse) of knots()' time axis (piecewise linear); None where it has none."""
    found = knots(startups, until)
    if found is None:
        return None
    import numpy as np

    ts, xs = found
    return (lambda t: np.interp(np.asarray(t, dtype=float), ts, xs),
            lambda x: np.interp(np.asarray(x, dtype=float), xs, ts))


def notes(data: Series) -> list[str]:
    """The words under the panels, wrapped, never cut: what the rates and the split mean, the compressed
    start-up, then each event numbered as on the panels with its reason in full."""
    paragraphs = [RATE_NOTE, SPLIT_NOTE, EPOCH_NOTE]
    if _squeezed(data):
        took = sum(s["end"] - s["start"] for s in data["startups"])
        paragraphs.append(f"start-up (preflight, spawn, until the first step; again after each restart) took "
                          f"{took:.1f} s in all: compressed into {STARTUP_SHARE:.0%} of the time axis, shaded; "
                          "the rest is to scale.")
    paragraphs += [r["line"] for r in data["restart_phases"]]
    reasons = {a["end"]: a["reason"] or (a["failure"]["message"] if a["failure"] else None) for a in data["attempts"]}
    own = data["failure"]["message"] if data["failure"] else None
    for n, ev in enumerate(data["events"], 1):
        why = reasons.get(ev["t"]) if ev["kind"] == "failure" else None
        why = why or (own if ev["kind"] == "failure" else None)
        paragraphs.append(f"[{n}] at {ev['t']:.1f} s: {ev['label']}" + (f". {why}" if why else ""))
    return [line for p in paragraphs for line in _wrap(p)]


def _wrap(paragraph: str) -> list[str]:
    """Lines of at most WRAP characters; a line of the paragraph (a log line in a reason) stays a line, its
    indent kept."""
    lines = []
    for line in paragraph.splitlines() or [""]:
        indent = line[:len(line) - len(line.lstrip())]
        lines += textwrap.wrap(line, WRAP, subsequent_indent=indent + "  ", break_on_hyphens=False) or [""]
    return lines


def trained(data: Series) -> bool:
    """Whether the run trained: else start-up is all there is to see, drawn to scale."""
    return bool(data["group"]["within"] or data["group"]["epochs"])


def _squeezed(data: Series) -> tuple[Scale, Scale] | None:
    """The time axis' squeeze() where the run trained."""
    return squeeze(data["startups"], data["until"]) if trained(data) else None


def _title(data: Series) -> str:
    lost = data["hosts_lost"]
    return (f"run {data['run_id']}: {data['state'] or '?'}, {len(data['attempts'])} attempt(s), "
            f"{data['restarts']} restart(s), {data['preemptions']} preemption(s)"
            + (f", lost tasks {lost}" if lost else ""))


def _time_axis(axes: list[Axes], data: Series) -> None:
    """Start-ups compressed (shaded), training to scale; ticks where each start-up ends and over training."""
    from matplotlib.ticker import MaxNLocator

    until = data["until"] or max((p["t"] for t in data["tasks"] for p in t["points"]), default=1.0) or 1.0
    bottom, funcs = axes[-1], _squeezed(data)
    bottom.set_xlim(0, until)
    if funcs is None:
        bottom.set_xlabel("seconds since the run was created")
        return
    bottom.set_xscale("function", functions=funcs)
    ticks, candidates = [0.0], [s["end"] for s in data["startups"]]
    edges = [0.0, *(x for s in data["startups"] for x in (s["start"], s["end"])), until]
    for a, b in zip(edges[::2], edges[1::2]):  # the stretches to scale, each with ticks for its width
        bins = round(10 * float(funcs[0](b) - funcs[0](a)) / until)
        candidates += [t for t in MaxNLocator(bins).tick_values(a, b) if a <= t <= b] if bins else []
    for t in candidates:
        if 0 <= t <= until and all(abs(funcs[0](t) - funcs[0](u)) > 0.04 * until for u in ticks):
            ticks.append(float(t))
    bottom.set_xticks(sorted(ticks), [f"{t:.1f}".removesuffix(".0") for t in sorted(ticks)])
    for s in data["startups"]:
        for ax in axes:
            ax.axvspan(s["start"], s["end"], color="#eeeeee", zorder=0)
        axes[0].annotate(f"start-up {s['end'] - s['start']:.1f} s", ((s["start"] + s["end"]) / 2, 0.03),
                         xycoords=("data", "axes fraction"), ha="center", va="bottom", rotation=90, fontsize=7,
                         color="#777777")
    bottom.set_xlabel("seconds since the run was created (start-up compressed, shaded)")


def figure(data: Series) -> Figure:
    """The report as a matplotlib Figure (no pyplot, no display), a pure function of series.build()'s dict.
    ReportError for a run that ended in its preflight, or without matplotlib."""
    if data["refused"]:
        raise ReportError(refused_words(data))
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError("the report needs matplotlib, which the launcher's base install leaves out: "
                          "pip install 'mgpu-cluster[report]' (or pip install matplotlib)") from None
    words = notes(data)
    heights = [3, 2, 2, 2, 1.2, 0.6 + NOTE_LINE_IN * len(words)]
    fig = Figure(figsize=(12, sum(heights) + 0.8), layout="constrained")
    grid = fig.add_gridspec(len(heights), 1, height_ratios=heights)
    rate = fig.add_subplot(grid[0])
    axes = [rate] + [fig.add_subplot(grid[i], sharex=rate) for i in range(1, 5)]
    rate, split, lossax, metricsax, timelineax = axes
    colours = {t["index"]: f"C{n % 10}" for n, t in enumerate(data["tasks"])}
    panels.throughput(rate, data)
    panels.step_split(split, data, colours)
    panels.loss(lossax, data)
    panels.metrics(metricsax, data)
    panels.timeline(timelineax, data)
    panels.epoch_marks(axes[:4], data)
    panels.events(axes, data)
    for ax in axes[:4]:
        ax.grid(alpha=0.3)
        ax.tick_params(labelbottom=False)
    _time_axis(axes, data)
    text = fig.add_subplot(grid[5])
    text.axis("off")
    text.text(0, 1, "\n".join(words), transform=text.transAxes, va="top", ha="left", fontsize=8, family="monospace")
    fig.suptitle(_title(data), fontsize=10)
    return fig


def write(data: Series, path: Path) -> Path:
    """figure() of series.build()'s dict saved as a PNG at `path` (whatever its name ends with), owner-only
    (0600) like every file of a run, written whole (a reader never sees half)."""
    fig, png = figure(data), io.BytesIO()
    fig.savefig(png, dpi=100, format="png")
    path = Path(path)
    try:
        write_private(path, png.getvalue())
    except OSError as exc:
        raise ReportError(f"cannot write the report to {path}: {exc.strerror or exc}; choose another path "
                          "with -o FILE.png") from None
    return path
