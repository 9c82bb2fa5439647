"""The Slurm engine: Slurm starts, signals and stops the tasks; the launcher submits, follows, reports.

Each attempt is one srun step (one task per node, each under the task core, `worker.task.slurm`):
in a job we submit for it (sbatch), or, inside the user's own allocation (SLURM_JOB_ID set), run
directly. The agent decides restarts as for every engine; a job that Slurm requeues (a node failure,
`scontrol requeue`) runs again by itself, and is followed as the next attempt. The tasks' records
come from their events files in the shared run folder; the job is polled in one place (`_watch`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from launcher.engines.base import Engine, EngineKind, Result, SchedulerCause, SchedulerEnd, Sink, TaskCheck
from launcher.engines.slurm import job as jobs
from launcher.engines.slurm import status
from launcher.engines.slurm.follow import Follower
from launcher.engines.slurm.plan import Mode, common_env, job_name, mode_here, plan_slurm, run_folder
from launcher.engines.slurm.preflight import problems
from launcher.engines.slurm.script import batch_script, print_dry_run, sbatch_options, srun_argv
from launcher.plan import TaskPlan
from worker import protocol
from worker.task.files import write_private
from worker.task.slurm import events_path

JOB_POLL_S = 0.5
SETTLE_S = 10.0  # how long Slurm may take to show how an ended attempt's job ended


class SlurmEngine(Engine):
    kind = EngineKind.SLURM

    def __init__(self, spec, run_id: str, only: list[int] | None = None):
        super().__init__(spec, run_id, only)
        self.cfg, self.root, self.mode = spec.slurm, Path(run_folder(spec, run_id)), mode_here()
        self.job_id = os.environ.get("SLURM_JOB_ID") if self.mode == Mode.ALLOCATION else None
        self.job_ids: list[str] = []
        self.job: dict = {}  # the job's last `scontrol show job` record
        self.where: dict[int, tuple[str, int]] = {}  # where each task landed (node, port)
        self.say: Callable[[str], None] = lambda _text: None
        self.stopping = self.requeued = False
        self.started = False  # this engine started an attempt (`up`), not one made for status, logs or down
        self.restarts_before, self.notices = 0, set()
        self.srun: subprocess.Popen | None = None
        self.follower: Follower | None = None
        self.closed = threading.Event()
        self.watcher: threading.Thread | None = None

    def plan_tasks(self, only: list[int] | None) -> list[TaskPlan]:
        return plan_slurm(self.spec, self.run_id)

    def dry_run(self, say: Callable[[str], None]) -> None:
        print_dry_run(self.spec, self.run_id, say)

    def preflight(self, base: Path | None, say: Callable[[str], None], for_start: bool = False) -> list[TaskCheck]:
        self.say = say
        title = (f"the Slurm job ({self.cfg.nodes} node(s), partition {self.cfg.partition or '(default)'})"
                 if self.mode == Mode.BATCH else f"the step in allocation {self.job_id}")
        return [TaskCheck(plan=self.plans[0], problems=problems(self.spec, self.run_id, self.mode, self.job_id),
                          title=title)]

    def attach(self, where: dict[int, tuple[str, int]], job: dict | None) -> None:
        self.where = {i: w for i, w in where.items() if w[0] and w[0] != "slurm"}
        if job:
            self.job_id, self.mode, self.job_ids = job.get("id"), Mode(job.get("mode") or "batch"), job.get("ids") or []

    def job_record(self) -> dict:
        return {"id": self.job_id, "mode": str(self.mode), "ids": list(self.job_ids), "name": job_name(self.run_id)}

    # ---- starting an attempt
    def start(self, attempt: int, sink: Sink) -> dict[int, str]:
        self.notices, self.stopping, self.started = set(), False, True
        why = self._prepare()
        if why is None and self.mode == Mode.BATCH:
            why = self._run_job(attempt)
        elif why is None:
            self.on_job(self.job_record())
            self.say(f"inside allocation {self.job_id}: attempt {attempt} runs as a step of it (srun), no job of its own")
            out = open(self.root / f"step-{attempt}.out", "ab")
            self.srun = subprocess.Popen(srun_argv(self.spec, self.run_id, attempt), stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT, cwd=self.root)
        if why is not None:
            return {p.index: why for p in self.plans}
        self._watch_start()
        self.follower = Follower(self.root, [p.index for p in self.plans], attempt, _Where(self, sink),
                                 self._over, lambda ev: ev.notice and self.notices.add(ev.notice))
        return {}

    def _prepare(self) -> str | None:
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_private(self.root / "env.json", json.dumps({"env": common_env(self.spec, self.run_id)}))
            (self.root / "launcher.alive").touch()
        except OSError as exc:
            return f"cannot write the run's folder {self.root}: {exc.strerror or exc}"
        return None

    def _run_job(self, attempt: int) -> str | None:
        """Submit the attempt's job (or, after a requeue, follow the same job); wait until it runs."""
        if self.requeued:
            self.requeued = False
        else:
            script = self.root / f"job-{attempt}.sh"
            write_private(script, batch_script(self.spec, self.run_id, attempt))
            t0 = time.time()
            res = jobs.slurm(["sbatch", "--parsable", *sbatch_options(self.spec, self.run_id), str(script)], 60.0)
            if res.returncode != 0:
                return f"sbatch refused the job: {(res.stderr or res.stdout).strip()}"
            self.job_id = res.stdout.strip().split(";")[0]
            self.job_ids.append(self.job_id)
            self.restarts_before = 0
            self.on_job(self.job_record())
            self.say(f"submitted Slurm job {self.job_id} ({job_name(self.run_id)}) in {time.time() - t0:.2f} s; "
                     f"'mgpu-cluster down' or 'scancel {self.job_id}' cancels it")
        self._watch_start()
        said = ""
        while True:  # until the job leaves the queue (Ctrl-C ends the wait: up's teardown cancels it)
            info = self._job_info()
            state = jobs.state_of(info)
            if state in jobs.RUNNING:
                return None
            if jobs.gone(info):  # COMPLETING waits too: a requeued job ends its last run before it queues
                if any(events_path(self.root, p.index, attempt).exists() for p in self.plans):
                    return None  # so short that it ran and ended between two looks: its records tell
                return f"Slurm job {self.job_id} ended before it ran ({state}, reason {info.get('Reason')})"
            if state in jobs.QUEUED and info.get("Reason") not in (None, "None", said):
                said = info.get("Reason")
                self.say(f"Slurm job {self.job_id} is waiting in the queue ({said})")
            time.sleep(JOB_POLL_S)

    def _over(self) -> str | None:
        """Why the attempt can report no more (its job or step is over), or None."""
        if self.mode == Mode.ALLOCATION:
            if self.srun is not None and self.srun.poll() is not None:
                return f"its srun step ended (exit code {self.srun.returncode}) with no exit report from this task"
            return None
        info = self.job  # COMPLETING: Slurm is still ending its processes, whose last records may come
        if not info or jobs.state_of(info) in jobs.RUNNING or jobs.state_of(info) == "COMPLETING":
            return None
        return (f"Slurm job {self.job_id} ended or left its nodes ({jobs.state_of(info)}, reason "
                f"{info.get('Reason')}) with no exit report from this task")

    # ---- the job, polled in one place
    def _watch_start(self) -> None:
        if self.watcher is None:
            self.watcher = threading.Thread(target=self._watch, daemon=True)
            self.watcher.start()

    def _watch(self) -> None:
        while not self.closed.wait(JOB_POLL_S):
            try:  # the tasks' lifeline: they stop when this file goes stale (this launcher is gone)
                (self.root / "launcher.alive").touch()
            except OSError:
                pass
            if self.mode == Mode.BATCH:
                self._job_info()

    def _job_info(self) -> dict | None:
        if not self.job_id:
            return None
        res = jobs.slurm(["scontrol", "-o", "show", "job", self.job_id], 30.0)
        if res.returncode != 0 or not res.stdout.strip():
            return None  # purged (MinJobAge), or the controller does not answer
        self.job = jobs.record_of(res.stdout)
        return self.job

    def verdict(self, attempt: int) -> SchedulerEnd | None:
        if self.mode == Mode.ALLOCATION:
            return None
        info = self.job if self.stopping else self._job_info()  # we stopped it: no verdict to wait for
        if not self.stopping and jobs.ending(info, self.restarts_before, self.notices):
            # until Slurm shows how it ended (or took it back), seconds at most; a job that still runs with
            # nothing from Slurm (a hang, a lost or failed task) is not waited for: the peers stop at once
            found = jobs.wait_until(self._settled, SETTLE_S)
            info = found[0] if found else self.job
        found = jobs.verdict_of(info, self.restarts_before, self.notices, self.job_id, self.cfg.time, self.stopping)
        if found is not None and found.cause == SchedulerCause.REQUEUED:
            self.requeued = True
            self.restarts_before = int((info or {}).get("Restarts") or 0)
        return found

    def _settled(self) -> list[dict | None] | None:
        info = self._job_info()
        return [info] if jobs.settled(info, self.restarts_before) else None

    # ---- stopping
    def _cancel(self) -> None:
        """Stop the run: its tasks get INT (KILL after stop_grace), then the job (or our step) is cancelled."""
        self.stopping = True
        if self.mode == Mode.ALLOCATION:
            for step in self._our_steps():
                jobs.slurm(["scancel", "--signal=INT", step], 10.0)
                jobs.slurm(["scancel", step], 10.0)
            if self.srun is not None and self.srun.poll() is None:
                threading.Thread(target=self._end_srun, daemon=True).start()
            return
        for job_id in dict.fromkeys([*self.job_ids, self.job_id]):
            if job_id:
                if jobs.state_of(self.job) in jobs.RUNNING:
                    jobs.slurm(["scancel", "--signal=INT", job_id], 10.0)  # quicker than Slurm's KillWait
                jobs.slurm(["scancel", job_id], 10.0)
        jobs.slurm(["scancel", f"--name={job_name(self.run_id)}"], 10.0)  # one submitted as we were interrupted

    def _our_steps(self) -> list[str]:
        res = jobs.slurm(["squeue", "-h", "-s", "-j", str(self.job_id), "-o", "%i %j"], 10.0)
        rows = [line.split() for line in res.stdout.splitlines()]
        return [r[0] for r in rows if len(r) == 2 and r[1] == job_name(self.run_id)]

    def _end_srun(self) -> None:
        try:
            self.srun.wait(self.spec.launch.stop_grace + 5.0)
        except subprocess.TimeoutExpired:
            self.srun.send_signal(signal.SIGTERM)

    def stop(self, indices: list[int]) -> None:
        self._cancel()

    def stop_from_folders(self, indices: list[int]) -> list[Result[dict]]:
        if self.mode == Mode.BATCH and not shutil.which("scancel"):
            err = RuntimeError("scancel is not on PATH: run 'mgpu-cluster down' where Slurm's commands work")
            return [Result(error=err) for _ in indices]
        self._cancel()
        if not jobs.wait_until(lambda: not self._still_there(), self.spec.launch.stop_grace + 60.0):
            err = RuntimeError(f"Slurm has not ended job {self.job_id} after 'scancel'; see "
                               f"'scontrol show job {self.job_id}'")
            return [Result(error=err) for _ in indices]
        return self.probe(indices)

    def _still_there(self) -> bool:
        if self.mode == Mode.ALLOCATION:
            return bool(self._our_steps()) or (self.srun is not None and self.srun.poll() is None)
        info = self._job_info()
        return info is not None and not jobs.gone(info)

    def close(self) -> None:
        """When `up` ends for any reason, no job of the run is left queued or running."""
        self.closed.set()
        if self.follower is not None:
            self.follower.stop()
        if not self.started:
            return
        if self.mode == Mode.BATCH and self.job_id and shutil.which("scontrol"):
            if not self.stopping:  # a job whose tasks all ended ends by itself, in a moment
                jobs.wait_until(lambda: not self._still_there(), 10.0, 0.1)
            if self._still_there() or jobs.state_of(self.job) in jobs.QUEUED:
                self._cancel()
            else:  # one sbatch may have submitted as `up` was interrupted, before its id was known
                jobs.slurm(["scancel", f"--name={job_name(self.run_id)}"], 10.0)
        if self.srun is not None and self.srun.poll() is None:  # inside an allocation: our step goes with us
            self._cancel()
            try:
                self.srun.wait(self.spec.launch.stop_grace + 5.0)
            except subprocess.TimeoutExpired:
                self.srun.kill()

    # ---- status, logs, commands on a node
    def probe(self, indices: list[int]) -> list[Result[dict]]:
        info = self._job_info() if (self.job_id and shutil.which("scontrol")) else None
        job = status.job_row(self.job_id, self.job_ids, str(self.mode), info)
        return [Result(value=status.task_row(self.root, i, job, self.stopping)) for i in indices]

    def read_log(self, index: int, offset: int, tail: int | None = None) -> tuple[str, int]:
        return status.read_log(self.root / f"task-{index}" / "worker.log", offset, tail)

    def call(self, index: int, argv: list[str], timeout: float) -> tuple[int, str, str]:
        node = self.where.get(index, ("", 0))[0]
        if not self.job_id or not node:
            return 1, "", f"task {index} has no node yet (its job is not running)"
        res = jobs.slurm(["srun", f"--jobid={self.job_id}", "--overlap", "-N1", "-n1", f"--nodelist={node}",
                          f"--chdir={self.root / f'task-{index}'}", *argv], timeout)
        return res.returncode, res.stdout, res.stderr


class _Where:
    """The sink of an attempt, noting where each task landed (Started: its node and port) on the way."""

    def __init__(self, engine: SlurmEngine, sink: Sink):
        self.engine, self.sink = engine, sink
        self.output, self.garbage = sink.output, sink.garbage

    def event(self, index: int, event: protocol.Event) -> None:
        if isinstance(event, protocol.Started) and event.host:
            self.engine.where[index] = (event.host, event.port)
        self.sink.event(index, event)

