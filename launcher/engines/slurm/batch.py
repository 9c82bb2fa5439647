"""A batch job per attempt: submitted with sbatch, followed through the queue until it runs; a job that
Slurm requeues runs again by itself and is followed as the next attempt."""

from __future__ import annotations

import math
import shlex
import shutil
import time
from typing import Callable

from launcher.engines.base import JobRecord, SchedulerCause, SchedulerEnd
from launcher.engines.slurm import job as jobs
from launcher.engines.slurm.commands import slurm
from launcher.engines.slurm.follow import began
from launcher.engines.slurm.job import Scontrol
from launcher.engines.slurm.kind import JobKind, Say
from launcher.engines.slurm.plan import Mode, script_file
from launcher.engines.slurm.preflight import batch_problems
from launcher.engines.slurm.script import batch_script, sbatch_options
from launcher.engines.slurm.watch import Watcher
from launcher.spec.cluster import SlurmSpec
from worker.host.clock import wait_until
from worker.host.files import write_private

SETTLE_S = 10.0  # how long Slurm may take to show how an ended attempt's job ended


class BatchJob(JobKind):
    mode = Mode.BATCH

    def __init__(self, spec: SlurmSpec, run_id: str, job_id: str | None = None, ids: list[str] | None = None,
                 watcher: Watcher | None = None):
        super().__init__(spec, run_id, job_id, watcher)
        self.job_ids = list(ids or [])  # one job an attempt; the last one is the run's job
        self.requeued = False  # the last attempt's job went back to the queue: the next attempt follows it
        self.restarts_before = 0  # the job's Restarts when this attempt began

    def ids(self) -> list[str]:
        return list(self.job_ids)

    def title(self) -> str:
        return f"the Slurm job ({self.cfg.nodes} node(s), partition {self.cfg.partition or '(default)'})"

    def problems(self) -> list[str]:
        return batch_problems(self.spec, self.run_id)

    def show(self, say: Say) -> None:
        script = script_file(self.root, 0)
        say(f"# submitted with: sbatch --parsable {shlex.join(sbatch_options(self.spec, self.run_id))} {script}")
        say(f"# {script} (attempt 0; a restart submits the same with its own attempt number):")
        say(batch_script(self.spec, self.run_id, 0))

    # ---- an attempt
    def launch(self, attempt: int, say: Say, on_job: Callable[[JobRecord], None]) -> str | None:
        self.stopping = False
        if self.requeued:
            self.requeued = False
        else:
            why = self._submit(attempt, say)
            if why is not None:
                return why
            on_job(self.record())
        return self._until_it_runs(attempt, say)

    def _submit(self, attempt: int, say: Say) -> str | None:
        script = script_file(self.root, attempt)
        write_private(script, batch_script(self.spec, self.run_id, attempt))
        t0 = time.monotonic()
        res = slurm(["sbatch", "--parsable", *sbatch_options(self.spec, self.run_id), str(script)], 60.0)
        if res.returncode != 0:
            return f"sbatch refused the job: {(res.stderr or res.stdout).strip()}"
        job_id = res.stdout.strip().split(";")[0]
        self.job_ids.append(job_id)
        self.restarts_before = 0
        self.watcher.watch(job_id)
        say(f"submitted Slurm job {job_id} ({self.name}) in {time.monotonic() - t0:.2f} s; "
            f"'mgpu-cluster down' or 'scancel {job_id}' cancels it")
        return None

    def _until_it_runs(self, attempt: int, say: Say) -> str | None:
        """Wait, however long, until the job leaves the queue (a Ctrl-C ends the wait: the teardown cancels it).
        COMPLETING waits too: a requeued job ends its last run before it queues."""
        said = [""]

        def left_queue() -> Scontrol | None:
            info = self.watcher.fresh(max_age=self.watcher.poll_s)  # the watcher's thread may have just asked
            state, reason = jobs.state_of(info), (info or {}).get("Reason")
            if state in jobs.QUEUED and reason not in (None, "None", said[0]):
                said[0] = reason
                say(f"Slurm job {self.job_id} is waiting in the queue ({reason})")
            return info if state in jobs.RUNNING or jobs.gone(info) else None

        info = wait_until(left_queue, math.inf, self.watcher.poll_s)
        if jobs.state_of(info) in jobs.RUNNING:
            return None
        if began(self.root, range(self.cfg.nodes), attempt):
            return None  # so short that it ran and ended between two looks: its records tell
        return (f"Slurm job {self.job_id} ended before it ran ({jobs.state_of(info)}, reason "
                f"{(info or {}).get('Reason')})")

    def over(self) -> str | None:
        info = self.watcher.record()  # COMPLETING: Slurm is still ending its processes, whose last records may come
        state = jobs.state_of(info)
        if not info or state in jobs.RUNNING or state == "COMPLETING":
            return None
        return (f"Slurm job {self.job_id} ended or left its nodes ({state}, reason {info.get('Reason')}) "
                "with no exit report from this task")

    def verdict(self, attempt: int, notices: set[str]) -> SchedulerEnd | None:
        info = self.watcher.record() if self.stopping else self.watcher.fresh()  # we stopped it: nothing to wait for
        if not self.stopping and jobs.ending(info, self.restarts_before, notices):
            # until Slurm shows how it ended (or took it back), seconds at most; a job that still runs with
            # nothing from Slurm (a hang, a lost or failed task) is not waited for: the peers stop at once
            settled = wait_until(self._settled, SETTLE_S)
            info = settled[0] if settled else self.watcher.record()
        found = jobs.verdict_of(info, self.restarts_before, notices, self.job_id, self.cfg.time, self.stopping)
        if found is not None and found.cause == SchedulerCause.REQUEUED:
            self.requeued, self.restarts_before = True, jobs.restarts(info)
        return found

    def _settled(self) -> list[Scontrol | None] | None:
        """[the job's record] once it tells how the attempt's job ended (None inside: purged), else None."""
        info = self.watcher.fresh()
        return [info] if jobs.settled(info, self.restarts_before) else None

    # ---- stopping
    def cancel(self) -> None:
        self.stopping = True
        info = self.watcher.record() or (self.watcher.fresh() if self.job_id else None)
        for job_id in dict.fromkeys([*self.job_ids, self.job_id]):
            if job_id:
                if jobs.state_of(info) in jobs.RUNNING:
                    slurm(["scancel", "--signal=INT", job_id], 10.0)  # quicker than Slurm's KillWait
                slurm(["scancel", job_id], 10.0)
        slurm(["scancel", f"--name={self.name}"], 10.0)  # one submitted as we were interrupted

    def still_there(self) -> bool:
        info = self.watcher.fresh()
        return info is not None and not jobs.gone(info)

    def cannot_stop(self) -> str | None:
        if not shutil.which("scancel"):
            return "scancel is not on PATH: run 'mgpu-cluster down' where Slurm's commands work"
        return None

    def close(self) -> None:
        if not shutil.which("scontrol"):
            return
        if not self.job_id:  # an sbatch may have submitted as `up` was interrupted, before its id was known
            slurm(["scancel", f"--name={self.name}"], 10.0)
            return
        if not self.stopping:  # a job whose tasks all ended ends by itself, in a moment
            wait_until(lambda: not self.still_there(), 10.0, 0.1)
        if self.still_there() or jobs.state_of(self.watcher.record()) in jobs.QUEUED:
            self.cancel()
        else:
            slurm(["scancel", f"--name={self.name}"], 10.0)
