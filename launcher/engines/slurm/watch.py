"""The one place that asks Slurm about a job's state: a watcher, whose thread polls `scontrol show job`
while a run follows its job and caches the record for everyone (the follower, the queue wait, the
verdict, status); the others read the cache, or ask through it (`fresh`), one question at a time."""

from __future__ import annotations

import threading
import time
from typing import Callable

from launcher.engines.slurm.commands import slurm
from launcher.engines.slurm.job import Scontrol, record_of

POLL_S = 0.5


def show_job(job_id: str) -> Scontrol | None:
    """The job's record as Slurm shows it now; None: purged (MinJobAge), or the controller does not answer."""
    res = slurm(["scontrol", "-o", "show", "job", job_id], 30.0)
    return record_of(res.stdout) if res.returncode == 0 and res.stdout.strip() else None


class Watcher:
    """A job's record, asked of Slurm by one thread every `poll_s` once started, and on demand.

    `record()` is the last record Slurm gave (kept when it does not answer for a moment); `fresh()`
    what it says now (None: no answer, or purged)."""

    def __init__(self, job_id: str | None = None, ask: Callable[[str], Scontrol | None] = show_job,
                 poll_s: float = POLL_S):
        self.ask, self.poll_s = ask, poll_s
        self._lock = threading.Lock()  # guards the fields below
        self._asking = threading.Lock()  # one question to Slurm at a time, whoever asks
        self._job_id = job_id
        self._record: Scontrol | None = None
        self._asked_at: float | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def job_id(self) -> str | None:
        with self._lock:
            return self._job_id

    def watch(self, job_id: str) -> None:
        """Follow this job from now on (a new job: what was cached of another is dropped); polled once started."""
        with self._lock:
            if job_id != self._job_id:
                self._job_id, self._record, self._asked_at = job_id, None, None
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll, daemon=True, name="slurm-watcher")
            self._thread.start()

    def record(self) -> Scontrol | None:
        with self._lock:
            return self._record

    def fresh(self, max_age: float = 0.0) -> Scontrol | None:
        """What Slurm says of the job now (what it said at most `max_age` seconds ago will do)."""
        with self._asking:
            with self._lock:
                job_id, cached = self._job_id, self._asked_at is not None and time.monotonic() - self._asked_at <= max_age
                if cached:
                    return self._record
            if not job_id:
                return None
            found = self.ask(job_id)
            with self._lock:
                if job_id == self._job_id:
                    self._asked_at = time.monotonic()
                    self._record = found or self._record
            return found

    def steps(self, name: str) -> list[str]:
        """The job's steps named `name` that Slurm still lists (ids such as '41.3')."""
        job_id = self.job_id
        if not job_id:
            return []
        with self._asking:
            res = slurm(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"], 10.0)
        rows = [line.split() for line in res.stdout.splitlines()]
        return [r[0] for r in rows if len(r) == 2 and r[1] == name]

    def _poll(self) -> None:
        while not self._closed.wait(self.poll_s):
            self.fresh(max_age=self.poll_s / 2)

    def close(self) -> None:
        self._closed.set()
