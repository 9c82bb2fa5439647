"""What the dashboard shows, read from the run records at every request (it keeps no state of its own):
the runs as `ls` lists them, a run as `status --json` shows it, its charts' data as `report` draws it
(launcher.diagnose.series), the tail of each task's log, and the stacks of its live tasks."""

from __future__ import annotations

import threading

from launcher import listing, runs
from launcher.engines.base import parallel
from launcher.errors import RunNotFound
from launcher.home import RUN_ID
from launcher.run import record
from launcher.run.logs import Lines, unreadable
from launcher.run.states import RunState

LOG_TAIL = 40  # lines of each task's log on a run's page


def run_list() -> list[dict]:
    """Every recorded run, newest first, as `ls --json` gives it."""
    return [r.to_json() for r in listing.rows()]


def watched() -> list[str]:
    """The runs /metrics reports: every run that has not ended, and the run a bare `status` shows (the newest
    that did not end in its preflight: a refused `up` does not hide the run that trained)."""
    found = listing.rows()
    if not found:
        return []
    live = {r.run_id for r in found if str(r.state) in {s.value for s in RunState if not s.ended}}
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
    change (a long run's history takes seconds to read); a live run's always (its chart runs up to now)."""
    from launcher.diagnose import series as made

    folder = record.run_path(checked(run_id))
    key = (run_id, *(_stat(folder / name) for name in (record.STATE, record.PROGRESS_LOG)))
    with _lock:
        drawn = _drawn.get(key)
    if drawn is None:
        drawn = made.load(folder)
        if drawn.get("end") is not None:
            with _lock:
                while len(_drawn) >= DRAWN_KEPT:
                    _drawn.pop(next(iter(_drawn)))
                _drawn[key] = drawn
    return drawn


DRAWN_KEPT = 8  # the series of this many ended runs kept
_drawn: dict[tuple, dict] = {}
_lock = threading.Lock()


def _stat(path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def log_tails(run_id: str, tail: int = LOG_TAIL) -> list[dict]:
    """The last `tail` lines of each task's log, or the paragraph that says why it cannot be read."""
    run = record.load(checked(run_id))
    if not run.attempts:
        return [{"index": t.index, "host": t.host, "lines": [], "error": "not started yet"} for t in run.tasks]
    engine = runs.inspector(run)
    try:
        indices = [t.index for t in run.tasks]
        read = parallel(lambda i: engine.read_log(i, 0, tail), indices)
        tails = []
        for i, res in zip(indices, read):
            lines = Lines().feed(res.value[0], final=True)[-tail:] if res.ok else []
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
