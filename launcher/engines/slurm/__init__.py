"""The Slurm engine: Slurm starts, signals and stops the tasks; the launcher submits, follows, reports.

Each attempt is one srun step (one task per node, each under the task core, `worker.task.slurm`) in
what its job kind gives: a job we submit for it (batch.BatchJob), or a step in the user's own allocation
(step.AllocationStep). The agent decides restarts as for every engine; a job that Slurm requeues runs
again by itself and is followed as the next attempt. The tasks' records come from their events files in
the shared run folder (follow.py); the job's state from the one watcher (watch.py); where each task
landed and the job of a recorded run, from the run record (`landed`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

from launcher.engines.base import (EngineKind, Inspecting, JobRecord, Landed, Launching, ProbeRow, Pump, Result,
                                   SchedulerEnd, Sink, TaskCheck)
from launcher.engines.slurm import status
from launcher.engines.slurm.batch import BatchJob
from launcher.engines.slurm.commands import slurm
from launcher.engines.slurm.follow import Follower
from launcher.engines.slurm.kind import JobKind
from launcher.engines.slurm.lifeline import Lifeline
from launcher.engines.slurm.plan import Mode, given, mode_here, plan_slurm, run_folder
from launcher.engines.slurm.script import show_environment
from launcher.engines.slurm.step import AllocationStep
from launcher.plan import TaskPlan
from launcher.spec.cluster import SlurmSpec
from worker.host import protocol
from worker.host import layout
from worker.host.clock import wait_until
from worker.host.files import read_log, write_private

KINDS: dict[str, type[BatchJob] | type[AllocationStep]] = {Mode.BATCH: BatchJob, Mode.ALLOCATION: AllocationStep}


def job_kind(spec: SlurmSpec, run_id: str, recorded: JobRecord | None) -> JobKind:
    """The run's job: as the run record has it (status, logs, down), else as `up` here makes it (inside an
    allocation, a step of it; else a batch job of its own)."""
    recorded = recorded or {}
    mode, job_id, ids = recorded.get("mode"), recorded.get("id"), recorded.get("ids")
    kind = KINDS.get(mode if isinstance(mode, str) else "", KINDS[mode_here()])
    return kind(spec, run_id, job_id if isinstance(job_id, str) else None, ids if isinstance(ids, list) else None)


class SlurmEngine(Launching, Inspecting):
    kind = EngineKind.SLURM
    spec: SlurmSpec

    def __init__(self, spec: SlurmSpec, run_id: str, only: list[int] | None = None, landed: Landed | None = None):
        super().__init__(spec, run_id, only, landed)
        self.root = Path(run_folder(spec, run_id))
        self.job = job_kind(spec, run_id, landed.job if landed is not None else None)
        self.say: Callable[[str], None] = lambda _text: None
        self.sink: Sink | None = None  # the attempt's, once started
        self.follower: Follower | None = None  # the attempt's, once its job left the queue
        self.notices: set[str] = set()  # the signals that gave the attempt's tasks notice
        self.lifeline: Lifeline | None = None  # only `up` keeps the tasks' lifeline fresh
        self.started = False  # by `up`; an engine made for status, logs or down leaves the job alone

    def plan_tasks(self, only: list[int] | None) -> list[TaskPlan]:
        return plan_slurm(self.spec, self.run_id)

    def dry_run(self, say: Callable[[str], None]) -> None:
        self.job.show(say)
        show_environment(self.spec, self.run_id, say)

    def preflight(self, base: Path | None, say: Callable[[str], None], for_start: bool = False) -> list[TaskCheck]:
        self.say = say
        return [TaskCheck(plan=self.plans[0], problems=self.job.problems(), title=self.job.title())]

    # ---- an attempt
    def start(self, attempt: int, sink: Sink) -> dict[int, str]:
        if self.follower is not None:
            self.follower.stop()
        self.sink, self.follower, self.notices, self.started = sink, None, set(), True
        why = self._prepare() or self.job.launch(attempt, self.say, self.on_job)
        if why is not None:
            return {p.index: why for p in self.plans}
        self.follower = Follower(self.root, [p.index for p in self.plans], attempt, sink, self.job.over, self._noted)
        return {}

    def _prepare(self) -> str | None:
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_private(self.root / layout.ENV, json.dumps(given(self.spec, self.run_id)))
        except OSError as exc:
            return f"cannot write the run's folder {self.root}: {exc.strerror or exc}"
        if self.lifeline is None:
            self.lifeline = Lifeline(self.root / layout.ALIVE)
        return None

    def _noted(self, ev: protocol.Exit) -> None:
        if ev.notice:
            self.notices.add(ev.notice)

    def verdict(self, attempt: int) -> SchedulerEnd | None:
        return self.job.verdict(attempt, self.notices)

    def stop(self, indices: list[int], broken: bool = False) -> None:
        self.job.cancel()  # Slurm signals the tasks itself: with stop_grace, broken or not
        if self.follower is None and self.sink is not None:
            # the attempt's job never left the queue: no task ran, so none can report; said now, once
            why = (f"its Slurm job {self.job.job_id} was cancelled before it ran" if self.job.job_id else
                   "it was stopped before its Slurm job was submitted")
            for i in indices:
                Pump(i, self.sink, lambda: why).end()
            self.sink = None

    def close(self) -> None:
        """When `up` ends for any reason, no job of the run is left queued or running (a job made for
        status, logs or down is left as it is)."""
        self.job.watcher.close()
        if self.follower is not None:
            self.follower.stop()
        if self.lifeline is not None:
            self.lifeline.stop()
        if self.started:
            self.job.close()

    # ---- a recorded run: status, logs, down, commands on a node
    def probe(self, indices: list[int]) -> list[Result[ProbeRow]]:
        info = self.job.watcher.fresh() if self.job.job_id and shutil.which("scontrol") else None
        job = status.job_row(self.job.record(), info)
        return [Result(value=status.task_row(self.root, i, job, self.job.stopping)) for i in indices]

    def read_log(self, index: int, offset: int, tail: int | None = None) -> tuple[bytes, int]:
        try:
            return read_log(Path(layout.file(layout.task_dir(self.root, index), layout.WORKER_LOG)), offset, tail)
        except FileNotFoundError:  # not started yet (its job may wait in the queue)
            return b"", offset

    def call(self, index: int, argv: list[str], timeout: float) -> tuple[int, str, str]:
        node = self._landed(index)
        job_id = (self.landed.job or {}).get("id") if self.landed is not None else None
        if not job_id or not node:
            return 1, "", f"task {index} has no node yet (its job is not running)"
        res = slurm(["srun", f"--jobid={job_id}", "--overlap", "-N1", "-n1", f"--nodelist={node}",
                     f"--chdir={layout.task_dir(self.root, index)}", *argv], timeout)
        return res.returncode, res.stdout, res.stderr

    def _landed(self, index: int) -> str | None:
        """The node task `index` landed on, as its Started report said (the run record), or None."""
        if self.landed is None:
            return None
        node, _port = self.landed.host_of(index)
        return node if node and node != self.plan[index].host.label else None

    def stop_from_folders(self, indices: list[int]) -> list[Result[ProbeRow]]:
        why = self.job.cannot_stop()
        if why is None:
            self.job.cancel()
            if not wait_until(lambda: not self.job.still_there(), self.spec.launch.stop_grace + 60.0):
                why = (f"Slurm has not ended job {self.job.job_id} after 'scancel'; see "
                       f"'scontrol show job {self.job.job_id}'")
        if why is not None:
            return [Result(error=RuntimeError(why)) for _ in indices]
        return self.probe(indices)
