"""What `status` reads of a Slurm run, with no launcher needed: each task's latest records (the task
core's events file in the shared run folder) with the job's state."""

from __future__ import annotations

import time
from pathlib import Path

from launcher.engines.base import JobRecord, ProbeRow
from launcher.engines.slurm import job as jobs
from launcher.run.states import TaskState
from worker.host import protocol
from worker.host import layout

TAIL_BYTES = 1 << 18  # what `status` reads of an events file: its last records


def last_records(path: Path) -> dict[str, protocol.Event]:
    """The last record of each kind in an events file (read from its end)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - TAIL_BYTES))
            data = f.read()
    except OSError:
        return {}
    found: dict[str, protocol.Event] = {}
    for line in data.split(b"\n"):
        try:
            ev = protocol.decode(line)
        except protocol.BadRecord:
            continue
        found[ev.kind] = ev
    return found


def latest_attempt(root: Path, index: int) -> int | None:
    found = layout.attempts(layout.task_dir(root, index))
    return found[-1] if found else None


def job_row(job: JobRecord, info: jobs.Scontrol | None) -> dict[str, object]:
    """The job as `status` shows it: the run record's (id, ids, mode) with its `scontrol show job` record
    (None: unknown, or purged)."""
    reason = (info or {}).get("Reason")
    return {"id": job.get("id"), "ids": list(job.get("ids") or []), "mode": job.get("mode"),
            "state": jobs.state_of(info).lower() or None, "reason": reason if reason not in (None, "None") else None,
            "nodes": (info or {}).get("NodeList")}


def task_row(root: Path, index: int, job: dict[str, object], stopping: bool) -> ProbeRow:
    """One task as its latest attempt's records tell it (last Started, Progress, Stats, Exit) and its job."""
    attempt = latest_attempt(root, index)
    folder = layout.task_dir(root, index)
    last = last_records(layout.events_file(folder, attempt)) if attempt is not None else {}
    started, stats = last.get(protocol.Started.kind), last.get(protocol.Stats.kind)
    ended, progress = last.get(protocol.Exit.kind), last.get(protocol.Progress.kind)
    assert isinstance(started, (protocol.Started, type(None))) and isinstance(stats, (protocol.Stats, type(None)))
    assert isinstance(ended, (protocol.Exit, type(None))) and isinstance(progress, (protocol.Progress, type(None)))
    state = str(job["state"] or "").upper()
    alive = state in jobs.RUNNING and started is not None and ended is None
    known = None
    if state in jobs.QUEUED or (state in jobs.RUNNING and not alive and ended is None):
        known = str(TaskState.PENDING)
    elif not alive and ended is None and stopping:
        known = str(TaskState.STOPPED)
    # its GPUs: as its supervisor relayed them (the record)
    return ProbeRow(dir=str(folder), pid=started.pid if started else None, alive=alive,
                    exit_code=ended.code if ended else None, host=started.host if started else None,
                    port=started.port if started else None, progress=progress.progress if progress else None,
                    cpu_percent=stats.cpu_percent if alive and stats else None,
                    rss=stats.rss if alive and stats else None, status=stats.status if alive and stats else None,
                    time=time.time(), job=job, state=known)
