"""A run on the control machine: $MGPU_HOME/runs/<run-id>/ with spec.toml, state.json, launcher.log.

One writer per run: whoever holds the run's lock (its launcher, or `down`/`status` once the
launcher is gone). Files are readable by their owner only (the spec copy holds the spec's env).
Every file of a run is read through launcher.run.files: untrusted bytes, a failure is one paragraph.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from launcher.errors import HomeError, RunCorrupt, RunNotFound
from launcher.run import home
from launcher.run.home import RUN_ID as RUN_ID, runs_dir as runs_dir  # where runs live: home.py
from launcher.engines.base import EngineKind, JobRecord, StandbyState
from worker.host.devices import GpuFigures
from launcher.plan import TaskPlan
from launcher.run import fields, files
from launcher.run.failure import Failure
from launcher.run.fields import Count, Percent, Pid, Port, Time
from launcher.run.lock import Lock
from launcher.run.progress import Progress, typed
from launcher.run.states import AttemptOutcome, Figures, RegroupKind, RunPhase, RunState, TaskState
from worker.host import layout
from worker.host.files import write_private
from worker.host.system import free_space
from worker.host.startpoint import StartPoint

VERSION = 3
STATE = "state.json"
PROGRESS_LOG = "progress.jsonl"  # every progress record (appended by the agent), for `report`
UNSAVED = "unsaved.json"  # room reserved at the start: what the launcher knows when state.json cannot be written
new_run_id, run_path = home.new_run_id, home.run_folder  # (home.py's) by the names the launcher's modules use
# the scheduler's job of a run as its engine gives it (Slurm: id, mode, ids, name)


@dataclass
class TaskRecord:
    index: Count
    host: str
    address: str
    port: Port
    run_dir: str
    state: TaskState = TaskState.PENDING
    pid: Pid | None = None
    create_time: Time | None = None
    supervisor_pid: Pid | None = None
    exit_code: int | None = None
    attempt: Count = 0  # the attempt it last took part in (the run's failure restarts are RunRecord.restarts)
    started_at: Time | None = None
    ended_at: Time | None = None
    heartbeat: Time | None = None  # when its progress last changed (launcher's clock)
    progress: Progress | None = None  # as launcher.run.progress.typed made it of what the task wrote
    cpu_percent: Percent | None = None  # relayed by the task's supervisor
    rss: int | None = None
    gpus: list[GpuFigures] | None = None  # its own GPUs, device-wide, as its supervisor relays nvidia-smi's
    proc_status: str | None = None
    env_found: dict[str, str] = field(default_factory=dict)  # what the preflight found for its env (NCCL_SOCKET_IFNAME)
    standby: StandbyState | None = None  # its standby now (launcher.engines.supervised)
    warm: bool = False  # its attempt was forked from a fork server whose imports were done

    # ---- its transitions: the only writers of its state and of its process's identity and times
    def begin(self, attempt: int) -> None:
        """A new attempt of the group: pending, nothing of the last attempt's process or progress kept."""
        self.state, self.exit_code, self.pid, self.create_time = TaskState.PENDING, None, None, None
        self.heartbeat, self.progress, self.proc_status, self.attempt = None, None, None, attempt
        self.gpus = None

    def started(self, pid: int, create_time: float, supervisor_pid: int, warm: bool, host: str, port: int,
                now: float) -> None:
        """Its process started (host and port: where a scheduler put it, if it says); pending becomes running,
        and a late report never undoes an end."""
        self.pid, self.create_time, self.supervisor_pid, self.warm = pid, create_time, supervisor_pid, warm
        self.host, self.port = host or self.host, port or self.port
        if self.state == TaskState.PENDING:
            self.state, self.started_at = TaskState.RUNNING, now

    def ended(self, state: TaskState, now: float, code: int | None = None) -> None:
        """Its end, as `state` (launcher.run.states.end_state decides which), with its exit code where it told one."""
        self.state, self.ended_at = state, now
        if code is not None:
            self.exit_code = code

    def failed(self) -> None:
        """Its attempt failed because of it (hung, silent, not started): its end comes with the group's stop."""
        self.state = TaskState.FAILED

    def seen(self, state: TaskState, code: int | None = None) -> None:
        """What its host says of it now (`status` of a run whose launcher is gone, `down`)."""
        self.state = state
        if code is not None:
            self.exit_code = code

    def left_out(self) -> None:
        """An elastic run goes on without it: its host no longer answers."""
        self.state = TaskState.LOST

    def measured(self, status: str | None, cpu_percent: float | None, rss: int | None,
                 gpus: list[GpuFigures] | None) -> None:
        """What its supervisor measured of its process: a beat without figures keeps the last status, and an ended
        process (no figures) keeps its last ones."""
        if status is not None:
            self.proc_status = status
        if rss is not None:
            self.cpu_percent, self.rss, self.gpus = cpu_percent, rss, gpus

    def reported(self, progress: Progress | None, beat: float | None) -> None:
        """Its training's progress as read (typed, bounded: launcher.run.progress); `beat`: when it trained on
        (its heartbeat), None where it has not trained a step since it started."""
        self.progress = progress
        if beat is not None:
            self.heartbeat = beat

    def found(self, env: dict[str, str]) -> None:
        """What the preflight found for its environment (kept: a later attempt gets it, no preflight runs again)."""
        self.env_found.update(env)

    def standby_is(self, standby: StandbyState | None) -> None:
        """Its standby as its engine last heard of it."""
        self.standby = standby

    def stopped_unless_ended(self) -> None:
        """After a teardown no task is pending or running."""
        if self.state in (TaskState.PENDING, TaskState.RUNNING):
            self.state = TaskState.STOPPED


@dataclass
class Attempt:
    number: Count
    started_at: Time
    ended_at: Time | None = None
    outcome: AttemptOutcome | None = None
    reason: str | None = None  # what ended it, in words
    failure: Failure | None = None  # the failure that ended it, as data
    tasks: list[int] = field(default_factory=list)
    # seconds: detected_s, teardown_s (of the attempt before), copy_s (and copy_bytes: the backup brought to the
    # hosts that lacked it), spawn_s, first_step_s, took_s, back_s; steps:
    # reached_step (the attempt before's), resumed_step, steps_redone; lists: estimated (the names of those that
    # are estimates), epochs_unprinted (saved before a restart, their lines never told) (launcher.run.phases)
    phases: Figures = field(default_factory=lambda: Figures())

    def end(self, outcome: AttemptOutcome, reason: str | None, failure: Failure | None) -> bool:
        """Its end, once: False where it had ended already (a later call leaves it as it was)."""
        if self.ended_at is not None:
            return False
        self.ended_at, self.outcome, self.reason, self.failure = time.time(), outcome, reason, failure
        return True

    def shrunk(self) -> None:
        """It failed by losing hosts, and the run goes on without them: its outcome says so."""
        self.outcome = AttemptOutcome.SHRUNK

    def measured(self, figures: Figures) -> None:
        """Some of its phases (launcher.run.phases computes them; this is where they are kept)."""
        self.phases.update(figures)


@dataclass
class Regroup:
    """An elastic run's group changed before attempt `attempt`: it shrank (hosts lost) or grew (hosts back)."""

    attempt: Count
    kind: RegroupKind
    tasks: list[Count]
    regrouped_at: Time = field(default_factory=time.time)


@dataclass
class RunRecord:
    run_id: str
    spec_path: str
    engine: str = "supervised"
    state: RunState = RunState.PREFLIGHT
    attempt: Count = 0
    restarts: Count = 0  # after failures (bounded by max_restarts)
    preemptions: Count = 0  # after notices (bounded by max_preemptions; not restarts)
    hosts_lost: list[Count] = field(default_factory=list)  # tasks left out now (elastic runs)
    regroups: list[Regroup] = field(default_factory=list)  # each change of an elastic run's group
    agent_pid: Pid | None = None
    agent_create_time: Time | None = None
    detached: bool = False
    created_at: Time = field(default_factory=time.time)
    ended_at: Time | None = None
    failure: Failure | None = None
    job: JobRecord | None = None  # the scheduler's job of the run (Slurm: id, mode), as the engine gave it
    phases: dict[str, float] = field(default_factory=dict)  # when each phase began, or took (preflight_s)
    start: StartPoint | None = None  # where its training starts (fresh, or another run's backup); set once
    args: list[str] = field(default_factory=list)  # the training's arguments given after `up SPEC --` (for --resume)
    attempts: list[Attempt] = field(default_factory=list)
    tasks: list[TaskRecord] = field(default_factory=list)
    version: int = VERSION

    @property
    def ended(self) -> bool:
        return self.state.ended

    def task(self, index: int) -> TaskRecord:
        """A task by its index (an elastic run's tasks keep theirs)."""
        return next(t for t in self.tasks if t.index == index)

    def host_of(self, index: int) -> tuple[str, int]:
        """Where task `index` landed, as its Started report said (a scheduler's node), else as planned."""
        t = self.task(index)
        return t.host, t.port

    def found_env(self, index: int) -> dict[str, str]:
        return dict(self.task(index).env_found)

    def set_state(self, state: RunState, failure: Failure | None = None) -> None:
        """The one place a run's state changes: an ended run keeps its end time and its failure."""
        self.state = state
        if failure is not None:
            self.failure = failure
        if state.ended and self.ended_at is None:
            self.ended_at = time.time()
        if state.ended:  # its launcher stops them as it exits (the engine's close)
            for t in self.tasks:
                t.standby = None

    def engine_is(self, kind: EngineKind) -> None:
        """The engine that runs it (engines.base.EngineKind), once chosen."""
        self.engine = str(kind)

    def job_known(self, job: JobRecord) -> None:
        """A scheduler's job for the run (its id while it waits in the queue)."""
        self.job = job

    def begin_attempt(self, tasks: list[int]) -> Attempt:
        """Attempt `self.attempt` begins with these tasks: its record."""
        self.attempts.append(Attempt(number=self.attempt, started_at=time.time(), tasks=tasks))
        return self.attempts[-1]

    def next_attempt(self) -> None:
        self.attempt += 1

    def preempted_again(self) -> None:
        self.preemptions += 1

    def restarted(self) -> None:
        self.restarts += 1

    def shrank(self, indices: list[int]) -> None:
        """An elastic run goes on without these tasks from its next attempt: their hosts no longer answer."""
        for i in indices:
            self.task(i).left_out()
            self.hosts_lost.append(i)
        self.regroups.append(Regroup(attempt=self.attempt + 1, kind=RegroupKind.SHRANK, tasks=list(indices)))

    def grew(self, indices: list[int]) -> None:
        """An elastic run takes these tasks back from its next attempt: their hosts answer and passed the
        preflight again."""
        self.hosts_lost = [i for i in self.hosts_lost if i not in indices]
        self.regroups.append(Regroup(attempt=self.attempt + 1, kind=RegroupKind.GREW, tasks=list(indices)))

    def took_s(self, attempt: int) -> float | None:
        """What attempt `attempt` took from the failure (or notice) before it to its first step (its took_s)."""
        return next((a.phases.get("took_s") for a in self.attempts if a.number == attempt), None)

    def grow_spent_s(self) -> float:
        """What taking hosts back has cost the run: the took_s of each attempt that began with a grow."""
        return sum(self.took_s(r.attempt) or 0.0 for r in self.regroups if r.kind == RegroupKind.GREW)

    def in_group_s(self, index: int) -> float:
        """How long task `index` was in the group: the attempts it took part in, start to end (or to now)."""
        now = time.time()
        return sum((a.ended_at or now) - a.started_at for a in self.attempts if index in a.tasks)

    def mark(self, phase: RunPhase, at: float | None = None) -> None:
        """When the run's phase `phase` began: its first time only."""
        self.phases.setdefault(phase.value, time.time() if at is None else at)

    def took(self, phase: RunPhase, seconds: float) -> None:
        """How long the run's phase `phase` took (the preflight)."""
        self.phases[phase.value] = round(seconds, 3)

    def set_start(self, start: StartPoint) -> None:
        """Where the run starts, as its preflight found it: set once (its restarts resume its own backup)."""
        if self.start is None:
            self.start = start

    def to_json(self) -> str:
        data = asdict(self)  # a Failure becomes a dict with its kind's value (a str enum)
        return json.dumps(data, indent=1, default=str)

    @classmethod
    def from_json(cls, text: str) -> "RunRecord":
        """A record as written; ValueError or TypeError (naming the field) for one that is damaged."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("version") != VERSION:
            raise OldVersion(f"record version {data.get('version', 1)}, this mgpu-cluster reads version {VERSION}")

        def failure(value: object) -> Failure | None:
            return Failure.from_json(value) if value is not None else None

        def attempts(items: Any) -> list[Attempt]:  # Any: the record's JSON, each item checked by fields.build
            return [fields.build(Attempt, a, {"failure": failure}) for a in items]

        def progress(value: object) -> Progress | None:
            if value is not None and not isinstance(value, dict):
                raise TypeError(f"TaskRecord.progress: {type(value).__name__} is not dict | None")
            return None if value is None else typed(value)

        def start(value: object) -> StartPoint | None:
            return None if value is None else fields.build(StartPoint, value)

        def tasks(items: Any) -> list[TaskRecord]:  # Any: as attempts
            return [fields.build(TaskRecord, t, {"progress": progress}) for t in items]

        return fields.build(cls, data, {"failure": failure, "attempts": attempts, "start": start, "tasks": tasks})


class OldVersion(ValueError):
    pass


# --------------------------------------------------------------------------- where runs live

def load(run_id: str) -> RunRecord:
    """The run `run_id` (launcher.commands.listing says which one a command means); RunCorrupt names the file when it
    cannot be read."""
    if not RUN_ID.match(run_id):
        raise RunNotFound(f"{run_id!r} is not a run id (they look like 20261125-105854-ca98); 'mgpu-cluster ls' "
                          "lists the runs.")
    path = run_path(run_id) / STATE
    try:
        raw = files.read_file(path)
    except FileNotFoundError:
        raise RunNotFound(f"Run {run_id!r} not found under {runs_dir()}; 'mgpu-cluster ls' lists "
                          "the runs.") from None
    try:
        return RunRecord.from_json(raw.decode("utf-8"))
    except OldVersion as exc:
        raise RunCorrupt(f"run {run_id}: {path} was written by another version of mgpu-cluster ({exc}). Its "
                         f"tasks' files are still on their hosts; remove {path.parent} when you no longer need "
                         "it. Other runs are not affected.") from None
    except (ValueError, KeyError, TypeError, RecursionError, MemoryError) as exc:  # not UTF-8 is a ValueError too
        raise RunCorrupt(f"run {run_id}: {path} is corrupt ({type(exc).__name__}: {str(exc)[:120]}), so its state "
                         f"is unknown. If its tasks may still run, stop them on their hosts (their folders are "
                         f"under {layout.run_root('', run_id)}/); remove {path.parent} when done. Other runs are not "
                         "affected.") from None


def unsaved(run_id: str) -> dict[str, object] | None:
    """What the run's launcher noted while state.json could not be written (Owner.save), or None."""
    return files.read_note(run_path(run_id) / UNSAVED)


# --------------------------------------------------------------------------- the one writer

def run_lock(run_id: str) -> Lock:
    """The lock of a run's record: held by its one writer."""
    return Lock(run_path(run_id) / "run.lock")


class Owner:
    """The writer of one run's record: holds its lock and saves it when it changed (at most every `every` s)."""

    def __init__(self, record: RunRecord, lock: Lock):
        self.record, self.lock = record, lock
        self.saved_at = 0.0
        self.written = record.to_json()  # what state.json holds
        # told once when the record cannot be written (a full disk)
        self.warn: Callable[[str], None] = lambda _text: None
        self.failing: str | None = None
        self.error: OSError | None = None  # why the last save failed
        self.notes = False  # the launcher keeps UNSAVED (a `status` or `down` that takes the run over does not)

    @classmethod
    def create(cls, run_id: str, spec_path: Path, plans: list[TaskPlan], detached: bool,
               args: list[str] | None = None) -> "Owner":
        """A new run, recorded (state preflight) before anything else happens; a run that cannot be
        recorded (a full or read-only MGPU_HOME) is not started."""
        import psutil

        folder = runs_dir(create=True) / run_id
        record = RunRecord(
            run_id=run_id, spec_path=str(Path(spec_path).resolve()), agent_pid=os.getpid(),
            agent_create_time=psutil.Process().create_time(), detached=detached, args=list(args or []),
            tasks=[TaskRecord(index=p.index, host=p.host.label, address=p.host.address, port=p.host.port,
                              run_dir=p.run_dir) for p in plans])
        lock = Lock(folder / "run.lock")
        try:
            folder.mkdir(mode=0o700)
            lock.acquire()
            fd = os.open(folder / "spec.toml", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with open(spec_path, "rb") as src, os.fdopen(fd, "wb") as dst:
                shutil.copyfileobj(src, dst)
            write_private(folder / STATE, record.to_json())
            files.reserve(folder / UNSAVED)
        except OSError as exc:
            lock.release()
            shutil.rmtree(folder, ignore_errors=True)
            raise HomeError(f"cannot record run {run_id} in {folder}: {exc.strerror or exc} ({free_space(folder)} "
                            "there), so nothing was started. Free space there, or set MGPU_HOME to a folder with room "
                            "(e.g. 'export MGPU_HOME=$HOME/.mgpu'), then run again.") from None
        owner = cls(record, lock)
        owner.saved_at, owner.notes = time.time(), True
        return owner

    @classmethod
    def take(cls, run_id: str, timeout: float) -> "Owner | None":
        """Become the writer of an existing run (its launcher is gone); None if it stays held."""
        lock = run_lock(run_id)
        try:
            if not lock.acquire(timeout):
                return None
        except OSError as exc:
            raise HomeError(f"run {run_id}: cannot open its lock {lock.path}: {exc.strerror or exc}, so nothing "
                            f"could be recorded; check {lock.path.parent} (its permissions, or a read-only MGPU_HOME)."
                            ) from None
        try:
            return cls(load(run_id), lock)
        except BaseException:
            lock.release()
            raise

    def save(self, every: float = 0.0) -> bool:
        """Write the record if it changed; False when it could not be (said once through `warn`; meanwhile what
        the launcher knows goes into the room reserved in UNSAVED, which a full disk still takes)."""
        if every and time.time() - self.saved_at < every:
            return self.error is None
        text, path = self.record.to_json(), run_path(self.record.run_id) / STATE
        if text == self.written and self.failing is None:
            return True  # nothing to write (`down` of an ended run): a read-only MGPU_HOME is no failure
        try:
            write_private(path, text)
        except OSError as exc:  # the run goes on; its record catches up when the disk has room again
            self.saved_at, self.error = time.time(), exc  # tried again after `every`, not on each event
            self._note(exc)
            if self.failing is None:
                self.failing = (f"cannot write the run record {path}: {exc.strerror or exc} ({free_space(path)} "
                                f"there). The run goes on; 'mgpu-cluster status' shows the last record written "
                                f"until there is room again: free space under {path.parent.parent} (MGPU_HOME).")
                self.warn(self.failing)
            return False
        self.written, self.saved_at, self.error = text, time.time(), None
        if self.failing is not None:
            self.failing = None
            self._note(None)
            self.warn(f"the run record {path} is written again")
        return True

    def _note(self, exc: OSError | None) -> None:
        """What the launcher knows, kept in UNSAVED while state.json cannot be written (blank again once it can)."""
        run, failure = self.record, self.record.failure
        if not self.notes:
            return
        note = None if exc is None else {
            "error": exc.strerror or str(exc), "at": time.time(), "state": str(run.state), "ended_at": run.ended_at,
            **({"kind": str(failure.kind), "task": failure.task, "failure": failure.message} if failure else {})}
        files.write_note(run_path(run.run_id) / UNSAVED, note)

    def release(self) -> None:
        self.lock.release()


def launcher_alive(record: RunRecord) -> bool:
    """The run's launcher is still there: its pid, started at its recorded time, lives. (Not the run's
    lock: a `status` that settles a dead launcher's run holds it for a moment too.)"""
    from worker.host.procs import same

    return same(record.agent_pid, record.agent_create_time) is not None
