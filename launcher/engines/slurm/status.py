"""What `status` and `logs` read of a Slurm run, with no launcher needed: each task's latest records
(the task core's events file) with the job's state, and worker.log, all in the shared run folder."""

from __future__ import annotations

import os
import time
from pathlib import Path

from launcher.engines.slurm import job as jobs
from worker import protocol
from worker.protocol import TaskState
from worker.task.slurm import events_path

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
    numbers = []
    for p in (root / f"task-{index}").glob("events-*.jsonl"):
        try:
            numbers.append(int(p.stem.split("-", 1)[1]))
        except ValueError:
            continue
    return max(numbers) if numbers else None


def job_row(job_id: str | None, job_ids: list[str], mode: str, info: dict | None) -> dict:
    """The job as `status` shows it, from its `scontrol show job` record (None: unknown, or purged)."""
    reason = (info or {}).get("Reason")
    return {"id": job_id, "ids": list(job_ids), "mode": mode, "state": jobs.state_of(info).lower() or None,
            "reason": reason if reason not in (None, "None") else None, "nodes": (info or {}).get("NodeList")}


def task_row(root: Path, index: int, job: dict, stopping: bool) -> dict:
    """One task as its latest attempt's records tell it (last Started, Progress, Stats, Exit) and its job."""
    attempt = latest_attempt(root, index)
    last = last_records(events_path(root, index, attempt)) if attempt is not None else {}
    started, stats, ended, progress = (last.get(k) for k in ("started", "stats", "exit", "progress"))
    state = (job["state"] or "").upper()
    alive = state in jobs.RUNNING and started is not None and ended is None
    row = {"dir": str(root / f"task-{index}"), "pid": started.pid if started else None, "alive": alive,
           "exit_code": ended.code if ended else None, "host": started.host if started else None,
           "port": started.port if started else None, "progress": progress.progress if progress else None,
           "cpu_percent": stats.cpu_percent if alive and stats else None,
           "rss": stats.rss if alive and stats else None, "status": stats.status if alive and stats else None,
           "gpu_util": None, "time": time.time(), "job": job}
    if state in jobs.QUEUED or (state in jobs.RUNNING and not alive and ended is None):
        row["state"] = str(TaskState.PENDING)
    elif not alive and ended is None and stopping:
        row["state"] = str(TaskState.STOPPED)
    return row


def read_log(path: Path, offset: int, tail: int | None = None) -> tuple[str, int]:
    """A log from byte `offset` (or its last `tail` lines): (text, next offset); nothing yet: ("", offset)."""
    try:
        with open(path, "rb") as log:
            size = os.fstat(log.fileno()).st_size
            if tail is not None:
                start, data = size, b""
                while start > 0 and data.count(b"\n") <= tail:
                    start = max(0, start - 65536)
                    log.seek(start)
                    data = log.read(size - start)
                lines = data.decode("utf-8", "replace").splitlines()[-tail:] if tail else []
                return "".join(line + "\n" for line in lines), size
            log.seek(offset)
            data = log.read()
    except FileNotFoundError:
        return "", offset
    return data.decode("utf-8", "replace"), offset + len(data)
