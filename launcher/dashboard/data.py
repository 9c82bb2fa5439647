"""What the dashboard shows, read from the run records at every request (kept only what an ended run's
unchanged files gave): the runs as `ls` lists them, a run as `status --json` shows it (with the spec it ran,
secrets masked), its charts' data as `report` draws it (launcher.diagnose.series, the start-up compressed as
there), the bounded tail of each task's log as `up` shows it, and its live tasks' stacks."""

from __future__ import annotations

import json
import threading
import time
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from launcher.commands import listing, recorded
from launcher.engines.base import parallel
from launcher.errors import MgpuError, RunNotFound
from launcher.run.home import RUN_ID
from launcher.plan import mask_env
from launcher.run import files, record
from launcher.run.logs import Lines, screen, unreadable
from launcher.run.screen import is_noise
from launcher.run.states import RunState
from launcher.run.view import GroupRow, Snapshot, refused, snapshot

if TYPE_CHECKING:
    from launcher.diagnose.series import Series

LIVE = {s.value for s in RunState if not s.ended}  # the states of a run /metrics watches
RUNS_SHOWN = 500  # the runs page lists the newest; `mgpu-cluster ls` lists every run
LOG_TAIL = 40  # lines of each task's log on a run's page (read from at most its last 160 KiB)
LINE_CHARS = 1000  # of a longer line, its start: a task's tail is at most about 40 KB


class RunList(TypedDict):
    runs: list[dict[str, object]]
    total: int


class Status(Snapshot):
    """A run as its page shows it: as `status --json` does, with what the page adds."""

    refused: bool
    spec: str
    created_at: float
    ended_at: float | None
    start_said: str | None
    final: GroupRow | None  # an ended run's group at its end
    spec_text: str | None


class LogTail(TypedDict):
    index: int
    host: str
    lines: list[str]
    hidden: NotRequired[int]  # lines of start-up chatter left out
    error: str | None


class TaskStacksJson(TypedDict):
    index: int
    host: str
    ok: bool
    text: str


def run_list(shown: int = RUNS_SHOWN) -> RunList:
    """The newest `shown` recorded runs, as `ls --json` gives them, and how many there are."""
    found = listing.rows()
    return {"runs": [r.to_json() for r in found[:shown]], "total": len(found)}


def watched() -> list[str]:
    """The runs /metrics reports: every run that has not ended, and the run a bare `status` shows (the newest
    that did not end in its preflight: a refused `up` does not hide the run that trained)."""
    found = listing.rows()
    if not found:
        return []
    live = {r.run_id for r in found if r.state in LIVE}
    return sorted(live | {listing.choose(None).run_id}, reverse=True)


def checked(run_id: str) -> str:
    """A run id from a URL, before it names a folder."""
    if not RUN_ID.match(run_id):
        raise RunNotFound(f"{run_id!r} is not a run id")
    return run_id


def status(run_id: str) -> Status:
    """The run as `status --json` shows it (a run whose launcher is gone is settled with its hosts, as there)."""
    seen = recorded.look(record.load(checked(run_id)))
    run = seen.run
    snap = snapshot(run, seen.probes)
    return {**snap, "unrecorded": seen.unrecorded, "refused": refused(run),
            "spec": run.spec_path, "created_at": run.created_at, "ended_at": run.ended_at,
            "start_said": run.start.words() if run.start else None,  # as `up` told it
            "final": snap["group"] if run.ended and snap["group"] and snap["group"]["epoch"] else None,
            "spec_text": spec_text(run.run_id)}


def spec_text(run_id: str) -> str | None:
    """The spec the run ran (the copy it keeps) as TOML, every value whose name looks secret masked (mask_env,
    as `--dry-run` masks a task's env); None where the copy cannot be read."""
    try:
        spec = tomllib.loads(files.read_file(record.run_path(run_id) / "spec.toml").decode())
    except (OSError, MgpuError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    return "\n".join(_toml(_masked(spec))).strip() + "\n"


def _masked(value: Any) -> Any:  # Any: a parsed TOML value (tomllib's), returned with the same shape
    if isinstance(value, dict):
        texts = mask_env({k: v for k, v in value.items() if isinstance(v, str)})
        return {k: texts.get(k) if isinstance(v, str) else _masked(v) for k, v in value.items()}
    return [_masked(v) for v in value] if isinstance(value, list) else value


def _toml(table: dict[str, Any], name: str = "") -> list[str]:  # Any: a parsed TOML table
    """A parsed TOML document as TOML again: values first, then its tables and arrays of tables."""
    def key(k: str) -> str:
        return k if k.replace("_", "").replace("-", "").isalnum() and k.isascii() else json.dumps(k)

    def value(v: object) -> str:
        if isinstance(v, dict):
            return "{" + ", ".join(f"{key(k)} = {value(x)}" for k, x in v.items()) + "}"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return ("true" if v else "false") if isinstance(v, bool) else json.dumps(v) if isinstance(v, str) else str(v)

    def tables(v: object) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)

    lines = [f"{key(k)} = {value(v)}" for k, v in table.items() if not isinstance(v, dict) and not tables(v)]
    for k, v in table.items():
        path = f"{name}.{key(k)}" if name else key(k)
        if isinstance(v, dict):
            lines += ["", f"[{path}]", *_toml(v, path)]
        elif tables(v):
            for item in v:
                lines += ["", f"[[{path}]]", *_toml(item, path)]
    return lines


def series(run_id: str) -> Series:
    """The run's charts, the same data as its report's. An ended run's is read again only when its files
    change (a long run's history takes seconds to read); a live run's when the last read is older than
    REREAD times what it took (its chart runs up to now; a long history costs the server a share, not all)."""
    from launcher.diagnose import series as made

    folder = record.run_path(checked(run_id))
    key = (run_id, _stat(folder / record.STATE), _stat(folder / record.PROGRESS_LOG))
    with _lock:
        drawn = _drawn.get(key)
        due, live = _live.get(run_id, (0.0, None))
    if drawn is not None:
        return drawn
    if live is not None and time.monotonic() < due:
        return live
    from launcher.diagnose.report import knots, trained

    started = time.monotonic()
    drawn = made.load(folder)
    drawn["axis"] = knots(drawn["startups"], drawn["until"]) if trained(drawn) else None  # as the PNG's
    with _lock:
        if drawn.get("end") is not None:
            while len(_drawn) >= DRAWN_KEPT:
                _drawn.pop(next(iter(_drawn)))
            _drawn[key] = drawn
            _live.pop(run_id, None)
        else:
            _live[run_id] = (time.monotonic() + REREAD * (time.monotonic() - started), drawn)
    return drawn


REREAD = 4
DRAWN_KEPT = 8  # the series of this many ended runs kept
_drawn: dict[tuple[str, tuple[int, int] | None, tuple[int, int] | None], Series] = {}
_live: dict[str, tuple[float, Series]] = {}  # a live run's last series: (when to read it again, the series)
_lock = threading.Lock()


def _stat(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def log_tails(run_id: str, tail: int = LOG_TAIL) -> list[LogTail]:
    """The last `tail` lines of each task's log as a terminal shows them (screen()), without TensorFlow's start-up
    chatter as `up` hides it (`hidden`: how many of those lines), or the paragraph that says why it cannot be
    read."""
    run = record.load(checked(run_id))
    if not run.attempts:
        return [{"index": t.index, "host": t.host, "lines": [], "error": "not started yet"} for t in run.tasks]
    engine = recorded.inspector(run)
    try:
        indices = [t.index for t in run.tasks]
        read = parallel(lambda i: engine.read_log(i, 0, tail), indices)
        tails: list[LogTail] = []
        for i, res in zip(indices, read):
            lines = ([screen(x, LINE_CHARS) for x in Lines().feed(res.value[0], final=True)[-tail:]]
                     if res.value is not None else [])
            shown = [x for x in lines if not is_noise(x)]
            tails.append({"index": i, "host": run.task(i).host, "lines": shown, "hidden": len(lines) - len(shown),
                          "error": None if res.error is None else unreadable(run, engine, i, res.error)})
        return tails
    finally:
        engine.close()


def stacks(run_id: str) -> list[TaskStacksJson]:
    """The Python stacks of each running task, as `mgpu-cluster stacks` takes them; RunFailed when none runs."""
    from launcher.diagnose.commands import live_tasks, take_stacks

    run, _, live = live_tasks(checked(run_id))
    return [{"index": ts.index, "host": ts.host, "ok": ts.ok, "text": ts.text()} for ts in take_stacks(run, live)]
