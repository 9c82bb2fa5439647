"""A run as the data its pictures draw: the run record (state.json) and its progress history (progress.jsonl),
read once as untrusted bytes, turned into one JSON-ready dict of seconds since the run's start. The PNG report
and the live page both draw it; every number that is not a finite value of its type and range is left out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NotRequired, TypedDict, TypeVar

from launcher.diagnose import timeline
from launcher.diagnose.values import Clock, items, measure, measures, text
from launcher.errors import ReportError
from launcher.run.files import read_file
from launcher.run.progress import EpochEnd, Progress, real, typed, whole
from launcher.run.record import PROGRESS_LOG, STATE

HISTORY_BYTES = 64 << 20  # of a longer progress history, the newest part is drawn
POINTS_DRAWN = 1000  # a longer line is drawn from at most this many of its points (thin())


class Row(TypedDict):
    time: float
    task: int
    attempt: int
    progress: Progress


class Timed(TypedDict):
    t: float
    attempt: int


class Point(Timed):
    state: str | None
    epoch: int | None
    step: int | None
    global_step: int | None
    samples_per_s: float | None
    loss: float | None
    metrics: dict[str, float]
    compute_ms: float | None
    wait_ms: float | None


class Epoch(Timed):
    task: int
    epoch: int
    start: float | None
    samples_per_s: float | None
    loss: float | None
    metrics: dict[str, float]


class Within(Timed):
    samples_per_s: float
    task: int


class TaskSeries(TypedDict):
    index: int
    host: str
    points: list[Point]


class Group(TypedDict):
    within: list[Within]
    epochs: list[Epoch]


class Startup(TypedDict):
    attempt: int
    start: float
    end: float


class Series(TypedDict):
    run_id: str
    state: str | None
    t0: float
    end: float | None
    until: float | None
    refused: bool
    restarts: int
    preemptions: int
    hosts_lost: list[int]
    failure: timeline.FailureData | None
    tasks: list[TaskSeries]
    epochs: list[Epoch]
    group: Group
    phases: list[timeline.Phase]
    startups: list[Startup]
    attempts: list[timeline.AttemptData]
    restart_phases: list[timeline.Restart]
    events: list[timeline.Event]
    axis: NotRequired[tuple[list[float], list[float]] | None]  # the page's (launcher.dashboard.data.series)


P = TypeVar("P", bound=Mapping[str, object])


def from_files(state: Path, progress: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:  # Any: JSON as read
    """The run record and its progress history as plain data, read as untrusted bytes (launcher.run.files):
    lines that are not UTF-8 JSON objects of the expected shape are skipped; of a history larger than
    HISTORY_BYTES, the newest part. A file that cannot be read is one paragraph (exit 2)."""
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
    history: list[dict[str, Any]] = []
    for line in lines:
        try:
            item = json.loads(line)  # bytes: not UTF-8 is a ValueError too
        except (ValueError, RecursionError):
            continue
        if isinstance(item, dict) and isinstance(item.get("progress"), dict) and real(item.get("time")) is not None:
            history.append(item)
    return run, history


def load(run_dir: Path, now: float | None = None) -> Series:
    """build() of the run in `run_dir` ($MGPU_HOME/runs/<run-id>)."""
    run_dir = Path(run_dir)
    return build(*from_files(run_dir / STATE, run_dir / PROGRESS_LOG), now=now)


# --------------------------------------------------------------------------- the series

def build(run: dict[str, Any], history: list[dict[str, Any]], now: float | None = None) -> Series:
    """The run as one JSON-ready dict (see docs/report.md): times in seconds since `t0` (the run's start);
    `now`: where a run that has not ended is drawn up to when it has no newer progress."""
    run = run if isinstance(run, dict) else {}
    now = real(now)
    rows = _rows(history)
    t0 = real(run.get("created_at")) or min((r["time"] for r in rows), default=0.0)
    ended = real(run.get("ended_at"))
    clock = Clock(t0, ended if ended is not None else now)
    rows = [r for r in rows if clock(r["time"]) is not None]
    offsets = _offsets(rows)
    tasks, epochs = _tasks(run, rows, clock, offsets), _epochs(rows, clock, offsets)
    until = ended if ended is not None else timeline.open_end(run, rows[-1]["time"] if rows else None, now)
    phases = timeline.phases(run, clock, until)
    tried = timeline.attempts(run, clock)
    lost = run.get("hosts_lost")
    lost = lost if isinstance(lost, list) else []
    startups = _startups(phases, tried, tasks, epochs)
    share = max(POINTS_DRAWN // 10, POINTS_DRAWN // max(1, len(tasks)))  # the tasks' lines share the points
    tasks = [{**t, "points": thin(t["points"], ("loss", "samples_per_s", "compute_ms", "wait_ms"), share)}
             for t in tasks]
    within, group_epochs = thin(_group_within(tasks), ("samples_per_s",)), _group_epochs(epochs)
    return {"run_id": text(run.get("run_id")) or "?", "state": text(run.get("state")), "t0": t0,
            "end": clock(ended), "until": clock(until), "refused": timeline.refused(run),
            "restarts": whole(run.get("restarts")) or 0, "preemptions": whole(run.get("preemptions")) or 0,
            "hosts_lost": [i for i in lost if whole(i) is not None],
            "failure": timeline.failure(run.get("failure")), "tasks": tasks,
            "epochs": thin(epochs, ("samples_per_s", "loss")),
            "group": {"within": within, "epochs": thin(group_epochs, ("samples_per_s", "loss"))},
            "phases": phases, "startups": startups,
            "attempts": tried, "restart_phases": timeline.restarts(run, clock),
            "events": timeline.events(run, clock, tried)}


def thin(points: list[P], keys: tuple[str, ...], most: int = POINTS_DRAWN) -> list[P]:
    """At most `most` of time-ordered `points`, the one reduction the PNG and the page both draw: the points cut
    in runs of equal count, of each run the last and those that hold each key's lowest and highest value, so
    a spike or a dip stays drawn and the line runs up to its newest point."""
    per = 2 * len(keys) + 1
    if len(points) <= most or most < per:
        return points
    buckets = most // per
    kept: list[P] = []
    for b in range(buckets):
        run = range(len(points) * b // buckets, len(points) * (b + 1) // buckets)
        chosen = {run[-1]}
        for key in keys:
            valued = {i: v for i in run if isinstance(v := points[i].get(key), (int, float))}
            if valued:
                chosen |= {min(valued, key=lambda i: valued[i]), max(valued, key=lambda i: valued[i])}
        kept += [points[i] for i in sorted(chosen)]
    return kept


def _rows(history: list[dict[str, Any]]) -> list[Row]:
    """History lines as {time, task, attempt, progress (typed)}, in time order."""
    rows: list[Row] = []
    for item in items(history):
        task, at = whole(item.get("task")), real(item.get("time"))
        if task is None or at is None:
            continue
        rows.append({"time": at, "task": task, "attempt": whole(item.get("attempt")) or 0,
                     "progress": typed(item.get("progress"))})
    return sorted(rows, key=lambda r: r["time"])


def _offsets(rows: list[Row]) -> dict[int, float]:
    """Per task, the launcher's clock minus the task's (its host's clock, and the up to a second before the
    launcher reads a write): the low tenth of the differences, so a few damaged times do not move it."""
    gaps: dict[int, list[float]] = {}
    for r in rows:
        if "time" in r["progress"]:
            gaps.setdefault(r["task"], []).append(r["time"] - r["progress"]["time"])
    return {task: sorted(g)[len(g) // 10] for task, g in gaps.items()}


def _tasks(run: dict[str, Any], rows: list[Row], clock: Clock, offsets: dict[int, float]) -> list[TaskSeries]:
    hosts = {t["index"]: (text(t.get("host")) or "?")[:200] for t in items(run.get("tasks"))
             if whole(t.get("index")) is not None}
    points: dict[int, list[Point]] = {i: [] for i in hosts}
    for r in rows:
        point = _point(r, clock, offsets.get(r["task"], 0.0))
        if point is not None:
            points.setdefault(r["task"], []).append(point)
    return [{"index": i, "host": hosts.get(i, "?"), "points": sorted(points[i], key=lambda p: p["t"])}
            for i in sorted(points)]


def _point(row: Row, clock: Clock, offset: float) -> Point | None:
    p = row["progress"]
    t = clock(p["time"] + offset) if "time" in p else clock(row["time"])
    if t is None:
        return None
    return {"t": t, "attempt": row["attempt"], "state": p.get("state"), "epoch": p.get("epoch"),
            "step": p.get("step"), "global_step": p.get("global_step"),
            "samples_per_s": measure(p.get("samples_per_sec")), "loss": measure(p.get("loss")),
            "metrics": measures(p.get("metrics")), "compute_ms": measure(p.get("compute_ms")),
            "wait_ms": measure(p.get("wait_ms"))}


def _epochs(rows: list[Row], clock: Clock, offsets: dict[int, float]) -> list[Epoch]:
    """Each finished epoch of each task and attempt, once (the newest word on it): its training throughput, loss
    and metrics, from the summaries the worker keeps; for a task whose history has none (an older worker), where
    the epoch was seen complete, without a rate."""
    found: dict[tuple[int, int, int], Epoch] = {}
    summarised = {r["task"] for r in rows if "epoch_ends" in r["progress"]}
    for r in rows:
        shift = offsets.get(r["task"], 0.0)
        ends: list[tuple[EpochEnd, float | None]]
        if r["task"] in summarised:
            ends = [(e, clock(e["end"] + shift) if "end" in e else None) for e in r["progress"].get("epoch_ends", [])]
        else:
            ends = [(e, clock(r["time"])) for e in _seen_complete(r["progress"])]
        for e, t in ends:
            start = clock(e["start"] + shift) if "start" in e else None
            if t is not None:
                found[(r["task"], r["attempt"], e["epoch"])] = {
                    "task": r["task"], "attempt": r["attempt"], "epoch": e["epoch"], "t": t,
                    "start": start if start is not None and start <= t else None,
                    "samples_per_s": measure(e.get("samples_per_sec")), "loss": measure(e.get("loss")),
                    "metrics": measures(e.get("metrics"))}
    return sorted(found.values(), key=lambda e: (e["t"], e["task"]))


def _seen_complete(p: Progress) -> list[EpochEnd]:
    """An older worker's record at the last step of its epoch, as an epoch summary without a rate."""
    steps, epoch = p.get("steps_per_epoch"), p.get("epoch")
    if not steps or not epoch or p.get("step") != steps or p.get("state") not in ("training", "done"):
        return []
    end: EpochEnd = {"epoch": epoch}
    if "loss" in p:
        end["loss"] = p["loss"]
    if "metrics" in p:
        end["metrics"] = p["metrics"]
    return [end]


def _group_within(tasks: list[TaskSeries]) -> list[Within]:
    """The group's training throughput (the epoch's so far) over time, drawn once: every task trains the same
    global batch in step, so per attempt the lowest task that measured it."""
    chosen: dict[int, int] = {}
    for task in tasks:
        for p in task["points"]:
            if p["samples_per_s"] is not None:
                chosen.setdefault(p["attempt"], task["index"])
    return [{"t": p["t"], "samples_per_s": p["samples_per_s"], "task": task["index"], "attempt": p["attempt"]}
            for task in tasks for p in task["points"]
            if p["samples_per_s"] is not None and chosen.get(p["attempt"]) == task["index"]]


def _group_epochs(epochs: list[Epoch]) -> list[Epoch]:
    """Each epoch of each attempt once, as the lowest task measured it: metrics are all-reduced, and the rate is
    the group's as the lowest task measured it, as the console's merged epoch line shows it (run.screen)."""
    chosen: dict[tuple[int, int], Epoch] = {}
    for e in sorted(epochs, key=lambda e: e["task"]):
        chosen.setdefault((e["attempt"], e["epoch"]), e)
    return sorted(chosen.values(), key=lambda e: e["t"])


def _startups(phases: list[timeline.Phase], tried: list[timeline.AttemptData], tasks: list[TaskSeries],
              epochs: list[Epoch]) -> list[Startup]:
    """Each attempt's start-up: from its start (the run's, preflight included, for the first) to its first
    step (a rate measured, an epoch's rate window opened), or to its end where it never trained."""
    first = next((p["end"] for p in phases if p["name"] == "to first step"), None)
    found: list[Startup] = []
    after = 0.0
    for n, a in enumerate(tried):
        began = [p["t"] for t in tasks for p in t["points"] if p["attempt"] == a["index"] and p["samples_per_s"]]
        began += [e["start"] for e in epochs if e["attempt"] == a["index"] and e["start"] is not None]
        start = 0.0 if n == 0 else a["start"]
        end = first if n == 0 and first is not None else min(began, default=a["end"])
        if end is not None and start >= after and end > start:
            found.append({"attempt": a["index"], "start": start, "end": end})
            after = end
    return found
