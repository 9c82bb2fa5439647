"""`mgpu-cluster report`: one PNG of a run from its record (state.json) and its progress history
(progress.jsonl): per task samples/s and the step split (own work, waiting) over time; attempts,
restarts, preemptions and lost hosts on the same axis; the phases. matplotlib: the `report` extra.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from launcher.errors import MgpuError
from launcher.run.files import read_file

OUTCOME_COLOURS = {"succeeded": "#4c9a2a", "failed": "#c0392b", "preempted": "#e67e22", "shrunk": "#8e44ad",
                   "stopped": "#7f8c8d", None: "#95a5a6"}
PHASE_COLOURS = {"preflight": "#bdc3c7", "start": "#f1c40f", "first step": "#e67e22", "training": "#27ae60",
                 "teardown": "#7f8c8d"}


HISTORY_BYTES = 64 << 20  # of a longer progress history, the newest part is drawn


class ReportError(MgpuError):
    exit_code = 2


def from_files(state: Path, progress: Path) -> tuple[dict, list[dict]]:
    """The run record and its progress history as plain data, read as untrusted bytes (launcher.run.files):
    lines that are not UTF-8 JSON objects of the expected shape are skipped; of a history larger than
    HISTORY_BYTES, the newest part. A file that cannot be read is RunCorrupt (one paragraph, exit 2)."""
    try:
        run = json.loads(read_file(Path(state)))
    except FileNotFoundError:
        raise ReportError(f"{state} is missing: the run has no record to draw") from None
    except (ValueError, RecursionError):
        run = None
    if not isinstance(run, dict):
        raise ReportError(f"{state} is not the JSON record mgpu-cluster writes; 'mgpu-cluster status' tells more")
    try:
        lines = read_file(Path(progress), limit=HISTORY_BYTES, newest=True).split(b"\n")
    except FileNotFoundError:
        lines = []
    history = []
    for line in lines:
        try:
            item = json.loads(line)  # bytes: not UTF-8 is a ValueError too
        except (ValueError, RecursionError):
            continue
        if isinstance(item, dict) and isinstance(item.get("progress"), dict) and _finite(item.get("time")):
            history.append(item)
    return run, history


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def open_end(run: dict, history: list[dict], now: float | None = None) -> float | None:
    """Where a run that has not ended (still going, or hung) is drawn up to: its newest progress time, else
    `now`, and never before the newest time its record holds. None for a run that has ended."""
    if run.get("ended_at") is not None:
        return None
    ph = run.get("phases") or {}
    known = [run.get("created_at"), *(ph.get(k) for k in ("spawn_started", "all_started", "first_step")),
             *(a.get("started_at") for a in run.get("attempts") or []),
             *(t.get("heartbeat") for t in run.get("tasks") or [])]
    newest = max((h["time"] for h in history), default=now)
    known = [x for x in (*known, newest) if isinstance(x, (int, float))]
    return max(known) if known else None


def phases(run: dict, until: float | None = None) -> list[tuple[str, float, float]]:
    """(name, start, end) of preflight, start, first step, training and teardown, as far as recorded;
    `until`: where training ends in a run that has not ended (open_end())."""
    ph, t0 = run.get("phases") or {}, run.get("created_at")
    attempts = run.get("attempts") or []
    end = ph.get("end") or (attempts[-1].get("ended_at") if attempts else None) or until
    marks = [("preflight", t0, ph.get("spawn_started") or (t0 + ph["preflight_s"] if t0 and "preflight_s" in ph else None)),
             ("start", ph.get("spawn_started"), ph.get("all_started")),
             ("first step", ph.get("all_started"), ph.get("first_step")),
             ("training", ph.get("first_step"), end),
             ("teardown", end, run.get("ended_at"))]
    return [(name, a, b) for name, a, b in marks if a is not None and b is not None and b >= a]


def events(run: dict) -> list[tuple[float, str]]:
    """(time, label) of restarts, preemptions, lost hosts and the run's failure."""
    found = []
    attempts = run.get("attempts") or []
    for prev, nxt in zip(attempts, attempts[1:]):
        what = {"preempted": "preemption", "shrunk": "host lost"}.get(prev.get("outcome"), "restart")
        found.append((nxt["started_at"], f"{what} -> attempt {nxt['number']}"))
    for a in attempts:
        failure = a.get("failure") or {}
        if a.get("ended_at") and failure.get("kind"):
            who = f"task {failure['task']} " if failure.get("task") is not None else ""
            found.append((a["ended_at"], f"{who}{failure['kind']}"))
    return sorted(found)


def figure(run: dict, history: list[dict], now: float | None = None):
    """The report as a matplotlib Figure (no pyplot, no display): a pure function of the data; `now`: the
    end of a run that has not ended and has no progress (open_end())."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError("the report needs matplotlib, which the launcher's base install leaves out: "
                          "pip install 'mgpu-cluster[report]' (or pip install matplotlib)") from None
    t0 = run.get("created_at") or min((h["time"] for h in history), default=0.0)
    fig = Figure(figsize=(11, 8.5), layout="constrained")
    rate, split, timeline = fig.subplots(3, 1, sharex=True, height_ratios=[3, 3, 2])
    tasks = sorted({h["task"] for h in history if isinstance(h.get("task"), int)})
    colours = {t: f"C{n % 10}" for n, t in enumerate(tasks)}
    for t in tasks:
        mine = [h for h in history if h.get("task") == t]
        for key, ax, style, label in (("samples_per_sec", rate, "-", f"task {t}"),
                                      ("compute_ms", split, "-", f"task {t} own work"),
                                      ("wait_ms", split, "--", f"task {t} waiting")):
            pts = [(h["time"] - t0, h["progress"][key]) for h in mine
                   if isinstance(h["progress"].get(key), (int, float))]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, style, color=colours[t], label=label, marker=".", markersize=3, linewidth=1.2)
    rate.set_ylabel("samples/s")
    split.set_ylabel("ms per step")
    for ax, empty in ((rate, "no samples/s recorded"), (split, "no step split recorded (compute_ms, wait_ms)")):
        if ax.lines:
            ax.legend(loc="upper left", fontsize=8, ncols=min(4, len(ax.lines)))
        else:
            ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center", color="grey")
        ax.grid(alpha=0.3)
    # the timeline: phases (row 1), attempts coloured by outcome (row 0), events as lines on every axis
    from matplotlib.patches import Patch

    until = open_end(run, history, now)
    shown = phases(run, until)
    for name, a, b in shown:
        timeline.broken_barh([(a - t0, max(b - a, 0.01))], (1.1, 0.8), color=PHASE_COLOURS[name])
    if shown:
        timeline.legend(handles=[Patch(color=PHASE_COLOURS[n], label=f"{n} {b - a:.1f} s") for n, a, b in shown],
                        loc="upper center", bbox_to_anchor=(0.5, -0.35), ncols=len(shown), fontsize=8, frameon=False)
    for a in run.get("attempts") or []:
        end = a.get("ended_at") or run.get("ended_at") or until or a["started_at"]
        outcome = a.get("outcome")
        timeline.broken_barh([(a["started_at"] - t0, max(end - a["started_at"], 0.01))], (0.1, 0.8),
                             color=OUTCOME_COLOURS.get(outcome, OUTCOME_COLOURS[None]))
        timeline.text((a["started_at"] + end) / 2 - t0, 0.5, f"attempt {a['number']}: {outcome or 'running'}",
                      ha="center", va="center", fontsize=7, color="white", clip_on=True)
    for when, label in events(run):
        for ax in (rate, split, timeline):
            ax.axvline(when - t0, color="#c0392b", linestyle=":", linewidth=1)
        rate.annotate(label, (when - t0, 1), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                      va="top", ha="right", color="#c0392b")
    timeline.set_yticks([0.5, 1.5], ["attempts", "phases"])
    timeline.set_ylim(0, 2)
    timeline.set_xlabel("seconds since the run was created")
    lost = run.get("hosts_lost") or []
    title = (f"run {run.get('run_id', '?')}: {run.get('state', '?')}, {len(run.get('attempts') or [])} attempt(s), "
             f"{run.get('restarts', 0)} restart(s), {run.get('preemptions', 0)} preemption(s)"
             + (f", lost tasks {lost}" if lost else ""))
    fig.suptitle(title, fontsize=10)
    return fig


def write(data: tuple[dict, list[dict]], path: Path, now: float | None = None) -> Path:
    """figure() of (run, history) saved as a PNG at `path`."""
    fig = figure(*data, now=now)
    path = Path(path)
    try:
        fig.savefig(path, dpi=100, format="png")  # a PNG whatever the name ends with
    except OSError as exc:
        raise ReportError(f"cannot write the report to {path}: {exc.strerror or exc}; choose another path "
                          "with -o FILE.png") from None
    return path
