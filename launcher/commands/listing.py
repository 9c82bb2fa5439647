"""The runs recorded on this machine: `mgpu-cluster ls`, `rm` and `prune`, and which run a command without a
run id means.

A command given no run id acts on the newest run that did not end in its preflight: a refused `up` (a port
taken, a host down) started nothing, so it never hides the run that trains. Reading only: a damaged
record is listed as damaged, never a traceback.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from typing import Union
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from launcher.errors import RunCorrupt, RunNotFound, SpecError
from launcher.run.home import RUN_ID, run_folder, runs_dir
from launcher.run import record
from launcher.run.lock import Lock
from launcher.run.states import Listed, RunPhase, RunState
from launcher.run.view import shown_run_state
from worker.host import layout


Shown = Union[RunState, Listed]  # a run's state as `ls` shows it


@dataclass(frozen=True)
class RunRow:
    run_id: str
    state: Shown
    spec: str | None = None
    engine: str | None = None
    started_at: float | None = None
    duration_s: float | None = None
    tasks: int | None = None
    why: str | None = None  # a damaged record's reason, a failed run's kind

    def to_json(self) -> dict[str, object]:
        return {"run_id": self.run_id, "state": str(self.state), "spec": self.spec, "engine": self.engine,
                "started_at": self.started_at, "duration_s": self.duration_s, "tasks": self.tasks, "why": self.why}


def run_ids() -> list[str]:
    """Every recorded run's id, newest first (ids start with their start time)."""
    folder = runs_dir()
    if not folder.is_dir():
        return []
    with os.scandir(folder) as found:  # plain strings: thousands of runs are listed at every scrape
        return sorted((e.name for e in found if RUN_ID.match(e.name)
                       and os.path.exists(os.path.join(e.path, record.STATE))), reverse=True)


def past_preflight(run: record.RunRecord) -> bool:
    """Its preflight passed: its tasks were started."""
    return RunPhase.PREFLIGHT_S in run.phases


def ended_in_preflight(run: record.RunRecord) -> bool:
    """It ended without starting a task: refused, or stopped or lost during its preflight. (A run still in
    its preflight is a live run: a bare `down` stops that one.)"""
    return run.ended and not past_preflight(run)


def row(run_id: str, now: float) -> RunRow:
    try:
        run = record.load(run_id)
    except (RunCorrupt, RunNotFound) as exc:
        return RunRow(run_id, Listed.DAMAGED, why=str(exc)[:300])
    state: Shown = shown_run_state(run, record.launcher_alive(run))  # launcher gone: `status` settles it with its hosts
    end = run.ended_at if run.ended and run.ended_at else now
    return RunRow(run_id, state, spec=run.spec_path, engine=run.engine, started_at=run.created_at,
                  duration_s=round(max(0.0, end - run.created_at), 1), tasks=len(run.tasks),
                  why=str(run.failure.kind) if run.failure else None)


def rows() -> list[RunRow]:
    """Every recorded run's row, newest first. An ended run's record no longer changes: its row is read once
    and kept while its state.json stays the same file (a scrape costs the live runs, not the history)."""
    now, ids, folder = time.time(), run_ids(), str(runs_dir())
    for gone in _kept.keys() - set(ids):
        _kept.pop(gone, None)
    return [_row(run_id, os.path.join(folder, run_id, record.STATE), now) for run_id in ids]


_kept: dict[str, tuple[tuple[int, int, int], RunRow]] = {}  # run id: (its state.json's inode, size, mtime; its row)
_SETTLED: set[Shown] = {Listed.REFUSED, Listed.DAMAGED, *(s for s in RunState if s.ended)}


def _row(run_id: str, state: str, now: float) -> RunRow:
    try:
        st = os.stat(state)
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        stamp = None
    kept = _kept.get(run_id)
    if stamp is not None and kept is not None and kept[0] == stamp:
        return kept[1]
    found = row(run_id, now)
    if stamp is not None and found.state in _SETTLED:
        _kept[run_id] = (stamp, found)
    return found


@dataclass(frozen=True)
class Chosen:
    run_id: str
    said: str  # which run, and why that one


def choose(run_id: str | None) -> Chosen:
    """The run a command means: the one named, else the newest that did not end in its preflight (else the
    newest of all). A newest record that cannot be read is taken: what it was is unknown, and the command
    says so in one paragraph."""
    if run_id:
        return Chosen(run_id, "")
    ids = run_ids()
    if not ids:
        raise RunNotFound(f"No runs yet under {runs_dir()}; start one with 'mgpu-cluster up SPEC'.")
    skipped = 0
    for candidate in ids:
        try:
            if ended_in_preflight(record.load(candidate)):
                skipped += 1
                continue
        except RunNotFound:  # removed meanwhile
            continue
        except RunCorrupt:
            pass
        newer = f"; {skipped} newer run(s) skipped: they ended in their preflight" if skipped else ""
        return Chosen(candidate, f"run {candidate}: the newest run that did not end in its preflight{newer} "
                                 "('mgpu-cluster ls' lists every run)")
    return Chosen(ids[0], f"run {ids[0]}: the newest run (every run ended in its preflight; 'mgpu-cluster ls' lists "
                          "every run)")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def cells(r: RunRow) -> list[str]:
    started = time.strftime("%m-%d %H:%M:%S", time.localtime(r.started_at)) if r.started_at else ""
    spec = r.spec.replace(str(Path.home()), "~", 1) if r.spec and r.spec.startswith(str(Path.home())) else r.spec
    return [r.run_id, str(r.state), r.engine or "", "" if r.tasks is None else str(r.tasks), started,
            _duration(r.duration_s), spec or (r.why or "")]


HEADER = ["run", "state", "engine", "tasks", "started", "duration", "spec"]


def table(found: list[RunRow]) -> Table:
    out = Table(title=f"{len(found)} run(s) under {runs_dir()}, newest first")
    for name in HEADER:
        out.add_column(name, overflow="fold", no_wrap=name != "spec")
    for r in found:
        out.add_row(*cells(r))
    return out


def plain(found: list[RunRow]) -> str:
    lines = [HEADER, *(cells(r) for r in found)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) + "  " + line[-1] for line in lines)


def ls(as_json: bool = False) -> None:
    """`mgpu-cluster ls`: every recorded run, newest first."""
    import json

    from launcher.run.output import Output

    found = rows()
    if as_json:
        print(json.dumps([r.to_json() for r in found], allow_nan=False), flush=True)
        return
    out = Output(threaded=False)
    if not found:
        out.say(f"no runs yet under {runs_dir()}; start one with 'mgpu-cluster up SPEC'")
    elif out.console.is_terminal:
        out.show(table(found))
    else:
        print(plain(found), flush=True)


AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])\Z")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def age_s(text: str) -> float:
    found = AGE.match(text.strip())
    if not found:
        raise SpecError(f"--older-than {text!r}: give an age as a number and a unit, s, m, h, d or w (90m, 12h, 7d).")
    return float(found[1]) * UNIT_S[found[2]]


def _erase(run_id: str) -> str:
    """Remove a run's record, under its lock; a local host's checkpoint and model (beside the task folders in
    the run's folder) stay. What was kept, in words ('' for nothing)."""
    folder = run_folder(run_id)
    lock = Lock(folder / "run.lock")
    if not lock.acquire():
        raise SpecError(f"run {run_id} is in use (its launcher or a 'status' or 'down' holds it); nothing was removed. "
                        "Try again once it has ended.")
    try:
        local = layout.local_run_root(folder)
        kept = sorted(e.name for e in local.iterdir() if layout.task_index(e.name) is None) if local.is_dir() else []
        for entry in folder.iterdir():
            if entry.name == "run.lock" or (kept and entry.name == layout.LOCAL_HOSTS[0]):
                continue
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        for entry in local.iterdir() if kept else ():
            if entry.name not in kept:
                shutil.rmtree(entry)
    finally:
        lock.release()
    if kept:
        return f"kept {', '.join(kept)} in {local}"
    (folder / "run.lock").unlink(missing_ok=True)
    folder.rmdir()
    return ""


def _refusal(run_id: str) -> str | None:
    """Why a run's record may not be removed now: it has not ended (a damaged record may go)."""
    try:
        run = record.load(run_id)
    except RunCorrupt:
        return None
    if run.ended:
        return None
    if record.launcher_alive(run):
        return f"run {run_id} is {run.state} (its launcher, pid {run.agent_pid}, runs): stop it first with 'mgpu-cluster down {run_id}'"
    return (f"run {run_id} has no recorded end and its launcher is gone: 'mgpu-cluster status {run_id}' asks its "
            f"hosts and records it (or 'mgpu-cluster down {run_id}' stops what runs)")


def _removed(found: list[str], dry_run: bool = False) -> None:
    from launcher.run.output import Output

    out = Output(threaded=False)
    for run_id in found:
        if dry_run:
            out.say(f"would remove run {run_id}")
            continue
        kept = _erase(run_id)
        out.say(f"removed run {run_id}" + (f" ({kept}: remove that folder yourself when done)" if kept else ""))
    if not found:
        out.say("nothing to remove")


def remove(run_ids_given: list[str]) -> None:
    """`mgpu-cluster rm RUN...`: every named run's record, once each has ended; nothing is removed when one is
    unknown or live."""
    wanted = list(dict.fromkeys(run_ids_given))
    unknown = [r for r in wanted if not RUN_ID.match(r) or not (run_folder(r) / record.STATE).exists()]
    if unknown:
        raise RunNotFound(f"no run {', '.join(unknown)} under {runs_dir()} ('mgpu-cluster ls' lists them); nothing was "
                          "removed.")
    refusals = [why for why in map(_refusal, wanted) if why]
    if refusals:
        raise SpecError("; ".join(refusals) + ". Nothing was removed.")
    _removed(wanted)


def prune(older_than: str | None, dry_run: bool = False) -> None:
    """`mgpu-cluster prune`: the runs the preflight refused, and with `older_than` every ended run that
    started longer ago than that."""
    limit = age_s(older_than) if older_than is not None else None
    now = time.time()
    found = [r.run_id for r in rows() if r.state == Listed.REFUSED or (
        limit is not None and r.state in _SETTLED - {Listed.DAMAGED} and r.started_at is not None
        and now - r.started_at > limit) and _refusal(r.run_id) is None]
    _removed(found, dry_run)
