"""What the dashboard shows, read from the run records at every request (kept only what an ended run's
unchanged files gave): the runs as `ls` lists them, a run as `status --json` shows it, its charts' data as
`report` draws it (launcher.diagnose.series), the bounded tail of each task's log, and its live tasks' stacks."""

from __future__ import annotations

import threading
import time

from launcher import listing, runs
from launcher.engines.base import parallel
from launcher.errors import RunNotFound
from launcher.home import RUN_ID
from launcher.run import record
from launcher.run.logs import Lines, screen, unreadable
from launcher.run.states import RunState

LIVE = {s.value for s in RunState if not s.ended}  # the states of a run /metrics watches
RUNS_SHOWN = 500  # the runs page lists the newest; `mgpu-cluster ls` lists every run
LOG_TAIL = 40  # lines of each task's log on a run's page (read from at most its last 160 KiB)
LINE_CHARS = 1000  # of a longer line, its start: a task's tail is at most about 40 KB


def run_list(shown: int = RUNS_SHOWN) -> dict:
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


def status(run_id: str) -> dict:
    """The run as `status --json` shows it (a run whose launcher is gone is settled with its hosts, as there)."""
    seen = runs.look(record.load(checked(run_id)))
    run = seen.run
    return {**runs.snapshot(run, seen.probes), "unrecorded": seen.unrecorded, "refused": listing.refused(run),
            "spec": run.spec_path, "created_at": run.created_at, "ended_at": run.ended_at,
            "start_said": run.start.words() if run.start else None}  # as `up` told it


def series(run_id: str) -> dict:
    """The run's charts, the same data as its report's. An ended run's is read again only when its files
    change (a long run's history takes seconds to read); a live run's when the last read is older than
    REREAD times what it took (its chart runs up to now; a long history costs the server a share, not all)."""
    from launcher.diagnose import series as made

    folder = record.run_path(checked(run_id))
    key = (run_id, *(_stat(folder / name) for name in (record.STATE, record.PROGRESS_LOG)))
    with _lock:
        drawn = _drawn.get(key)
        due, live = _live.get(run_id, (0.0, None))
    if drawn is not None:
        return drawn
    if live is not None and time.monotonic() < due:
        return live
    started = time.monotonic()
    drawn = made.load(folder)
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
_drawn: dict[tuple, dict] = {}
_live: dict[str, tuple[float, dict]] = {}  # a live run's last series: (when to read it again, the series)
_lock = threading.Lock()


def _stat(path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def log_tails(run_id: str, tail: int = LOG_TAIL) -> list[dict]:
    """The last `tail` lines of each task's log as a terminal shows them (screen()), or the paragraph that says
    why it cannot be read."""
    run = record.load(checked(run_id))
    if not run.attempts:
        return [{"index": t.index, "host": t.host, "lines": [], "error": "not started yet"} for t in run.tasks]
    engine = runs.inspector(run)
    try:
        indices = [t.index for t in run.tasks]
        read = parallel(lambda i: engine.read_log(i, 0, tail), indices)
        tails = []
        for i, res in zip(indices, read):
            lines = [screen(x, LINE_CHARS) for x in Lines().feed(res.value[0], final=True)[-tail:]] if res.ok else []
            tails.append({"index": i, "host": run.task(i).host, "lines": lines,
                          "error": None if res.ok else unreadable(run, engine, i, res.error)})
        return tails
    finally:
        engine.close()


def stacks(run_id: str) -> list[dict]:
    """The Python stacks of each running task, as `mgpu-cluster stacks` takes them; RunFailed when none runs."""
    from launcher.diagnose.commands import live_tasks, take_stacks

    run, _, live = live_tasks(checked(run_id))
    return [{"index": ts.index, "host": ts.host, "ok": ts.ok, "text": ts.text()} for ts in take_stacks(run, live)]
