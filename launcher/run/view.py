"""A run as `status` shows it: one snapshot of its record merged with what its hosts said, the one source of
`status --json`, the table, the dashboard's page and /metrics; a task's shown state (`starting` included) is
made here alone."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, TypedDict

from launcher.engines.base import ProbeRow, Result
from launcher.run import phases, record
from launcher.run.progress import Progress, position, typed
from launcher.run.failure import FailureKind
from launcher.run.states import Figures, Listed, RunState, TaskState, end_state
from worker.host.protocol import ProgressState

if TYPE_CHECKING:
    from launcher.diagnose.straggler import StragglerJson

EXITED = (TaskState.SUCCEEDED, TaskState.FAILED, TaskState.PREEMPTED, TaskState.STOPPED)  # known from its exit
STARTING = "starting"  # shown, never recorded: a running task before its first step (shown_state)


class RecordFigures(TypedDict):
    """What one progress record says, as a view shows it: where (by progress.position's rule), loss, metrics and
    the training throughput as that record's task measured it."""

    epoch: int | None
    epochs: int | None
    step: int | None
    steps_per_epoch: int | None
    global_step: int | None
    loss: float | None
    metrics: dict[str, float]
    samples_per_sec: float | None


class TaskRow(RecordFigures):
    """A task as `status --json` shows it; pid, exit_code, cpu_percent, rss and gpus as its host's probe said them
    (worker.task.probe), else as the record has them."""

    index: int
    host: str
    port: int
    pid: object
    state: str
    exit_code: object
    attempt: int
    behind: int | None  # steps its record is behind the group's (GroupRow): records are read at their own moments
    position: list[int | None]  # [epoch, step] where the table and the page show it (shown_position)
    compute_ms: float | None
    wait_ms: float | None
    replicas: int | None
    heartbeat_age: float | None
    cpu_percent: object
    rss: object
    gpus: object
    run_dir: str
    standby: dict[str, object] | None
    warm: bool
    error: str | None


class GroupRow(RecordFigures):
    """The group at one moment: the newest record of its tasks (the most global steps; of tasks at the same step,
    the lowest's: the chief's), the one place the group's position, loss and training throughput are read."""

    task: int  # whose record
    time: float | None  # when it was written (the task's clock)
    ended_epoch: int | None  # the last epoch that ended: its metrics (validation's) are in `metrics` mid-epoch


class AttemptRow(TypedDict):
    number: int
    tasks: list[int]
    outcome: str | None
    reason: str | None
    failure: dict[str, object] | None
    started_at: float
    ended_at: float | None
    phases: Figures


class RegroupRow(TypedDict):
    """An elastic run's group changed (record.Regroup), with what the attempt it began cost until its first step."""

    attempt: int
    kind: str
    tasks: list[int]
    at: float
    took_s: float | None


class _Snapshot(TypedDict):
    run_id: str
    state: str
    attempt: int
    restarts: int
    preemptions: int
    hosts_lost: list[int]
    regroups: list[RegroupRow]
    failure: dict[str, object] | None
    start: dict[str, object] | None
    agent_pid: int | None
    launcher_alive: bool
    detached: bool
    engine: str
    attempts: list[AttemptRow]
    tasks: list[TaskRow]
    group: GroupRow | None
    straggler: StragglerJson | None
    job: object  # a scheduler's job as its engine's probe said it


class Snapshot(_Snapshot, total=False):
    """A run as `status --json` shows it (snapshot())."""

    unrecorded: str | None  # `status`'s: what the record could not be told (commands.recorded)


STATES = {s.value: s for s in TaskState}


def _task_state(row: ProbeRow) -> TaskState:
    if row.alive:
        return TaskState.RUNNING
    if row.state in STATES:  # an engine that knows better (a task whose Slurm job is still queued)
        return STATES[row.state]
    code = row.exit_code  # its host kept no exit code: its process went away unreported
    return end_state(TaskState.RUNNING, code, notice=False, lost=code is None)


def shown_state(state: TaskState, progress: Progress, tells: bool = False) -> str:
    """A task's state as `status`, `--json`, the page and /metrics show it: `starting` for a running task whose
    training says it has trained no step yet (importing, joining its group; its progress, typed), or has said
    nothing yet where it is one that tells (`tells`: the built-in runner), else the recorded state. A command
    that writes no progress.json is `running` from its start."""
    if state != TaskState.RUNNING:
        return str(state)
    if not progress:
        return STARTING if tells else str(state)
    said = ProgressState.of(progress)
    if said == ProgressState.STARTING or (said == ProgressState.TRAINING and
                                          (progress.get("global_step") or 0) <= (progress.get("first_global_step") or 0)):
        return STARTING
    return str(state)


def refused(run: record.RunRecord) -> bool:
    return run.failure is not None and run.failure.kind == FailureKind.REFUSED


def shown_run_state(run: record.RunRecord, alive: bool) -> RunState | Listed:
    """A run's state as `ls`, `status`, `--json`, the page and /metrics show it: `refused` where its preflight
    refused it (recorded as failed), `lost` where it has not ended and its launcher (`alive`) is gone."""
    if refused(run):
        return Listed.REFUSED
    return run.state if run.ended or alive else RunState.LOST


def task_now(recorded: TaskState, row: ProbeRow | None) -> TaskState:
    """A task's state from its record and what its host says now: an end the record took from the task's exit
    report stands (a preempted task killed at the end of its grace has exit code -9 on its host); the host
    moves a task not known to have exited, or one it sees running."""
    if row is None:
        return recorded
    seen = _task_state(row)
    return recorded if recorded in EXITED and seen != TaskState.RUNNING else seen


def snapshot(run: record.RunRecord, probes: list[Result[ProbeRow]] | None = None) -> Snapshot:
    """The run as `status --json` shows it: its record, merged with what each host says when probed."""
    now = time.time()
    until = (run.ended_at or now) if run.ended else now  # an ended run's heartbeat stopped at its end
    alive = record.launcher_alive(run)
    tasks: list[TaskRow] = []
    records: list[tuple[int, Progress]] = []
    for i, t in enumerate(run.tasks):
        res = probes[i] if probes else None
        row = res.value if res is not None and res.ok else None  # None: its host not asked (or not answering)
        seen = row or ProbeRow()
        progress = typed(seen.progress or t.progress)  # written by the training: untrusted
        state = shown_state(t.state if run.ended else task_now(t.state, row), progress, tells=run.start is not None)
        code = seen.exit_code
        gpus = seen.gpus or t.gpus
        beat = progress.get("time") if state != STARTING else None  # no heartbeat before the first step
        epoch, at = position(progress)
        records.append((t.index, progress))
        tasks.append({
            "index": t.index, "host": t.host, "port": t.port, "pid": seen.pid or t.pid,
            "state": state, "exit_code": t.exit_code if code is None else code,
            "attempt": t.attempt, "epoch": epoch, "epochs": progress.get("epochs"),
            "step": at, "steps_per_epoch": progress.get("steps_per_epoch"),
            "global_step": progress.get("global_step"), "loss": progress.get("loss"),
            "metrics": progress.get("metrics") or {}, "samples_per_sec": progress.get("samples_per_sec"),
            "behind": None, "position": [epoch, at],  # both set once the group is known (below)
            "compute_ms": progress.get("compute_ms"), "wait_ms": progress.get("wait_ms"),
            "replicas": progress.get("replicas"),  # in sync over all workers (workers x local replicas)
            "heartbeat_age": round(max(0.0, until - beat), 1) if beat else None,
            "cpu_percent": t.cpu_percent if row is None else row.cpu_percent,
            "rss": t.rss if row is None else row.rss,
            # its own GPUs' figures, device-wide ({index, util, memory_used, memory_total}: nvidia-smi's, MiB),
            # from its host's probe (worker.task.probe) or else as its supervisor relayed them last; else None
            "gpus": [asdict(g) for g in gpus] if gpus else None, "run_dir": t.run_dir,
            # its warm standby for the next attempt ({pid, ready, rss, attempt}), while its launcher runs
            "standby": asdict(t.standby) if t.standby and not run.ended and alive else None, "warm": t.warm,
            "error": str(res.error) if res is not None and not res.ok else None,
        })
    state = shown_run_state(run, alive)
    together = group(records)
    for shown in tasks:
        if together is not None and together["global_step"] is not None and shown["global_step"] is not None:
            shown["behind"] = together["global_step"] - shown["global_step"]
        shown["position"] = shown_position(shown, together, run.attempt)
    return {"run_id": run.run_id, "state": str(state), "attempt": run.attempt, "restarts": run.restarts,
            "preemptions": run.preemptions, "hosts_lost": run.hosts_lost,
            "regroups": [{"attempt": r.attempt, "kind": str(r.kind), "tasks": r.tasks, "at": r.regrouped_at,
                          "took_s": run.took_s(r.attempt)}
                         for r in run.regroups],
            "failure": run.failure.to_json() if run.failure else None,
            "start": run.start.to_json() if run.start else None,  # where its training starts (fresh: run null)
            "agent_pid": run.agent_pid, "launcher_alive": alive, "detached": run.detached, "engine": run.engine,
            "attempts": [{"number": a.number, "tasks": a.tasks, "outcome": a.outcome and str(a.outcome),
                          "reason": a.reason, "failure": a.failure.to_json() if a.failure else None,
                          "started_at": a.started_at, "ended_at": a.ended_at, "phases": phases.told(a)}
                         for a in run.attempts],
            "tasks": tasks, "group": together, "straggler": straggler_json(tasks),
            # a scheduler's job (Slurm: id, state such as pending/running/completed/failed/cancelled, reason)
            "job": next((r.value.job for r in probes or [] if r.value is not None and r.value.job), None)}


def group(records: list[tuple[int, Progress]]) -> GroupRow | None:
    """The group at one moment (GroupRow) from its tasks' typed records (index, progress); None before any
    task trained a step. Its tasks step together: the newest record is where the group is."""
    trained = [(i, p) for i, p in records if p.get("global_step")]
    if not trained:
        return None
    index, p = min(trained, key=lambda r: (-(r[1].get("global_step") or 0), r[0]))
    epoch, at = position(p)
    return {"task": index, "time": p.get("time"), "epoch": epoch, "epochs": p.get("epochs"), "step": at,
            "steps_per_epoch": p.get("steps_per_epoch"), "global_step": p.get("global_step"), "loss": p.get("loss"),
            "metrics": p.get("metrics") or {}, "samples_per_sec": p.get("samples_per_sec"),
            "ended_epoch": max((e["epoch"] for e in p.get("epoch_ends", [])), default=None)}


def shown_position(task: TaskRow, together: GroupRow | None, attempt: int) -> list[int | None]:
    """[epoch, step] where a view shows task `task`: a running task of the group's attempt steps with its group
    (every step is all-reduced), so it is where the group is, at the group's moment (its own record, up to a
    second older, is `behind` that many steps); any other task where its own record left it."""
    if together is not None and task["state"] == TaskState.RUNNING and task["attempt"] == attempt \
            and task["behind"] is not None:
        return [together["epoch"], together["step"]]
    return [task["epoch"], task["step"]]


def straggler_json(tasks: list[TaskRow]) -> StragglerJson | None:
    from launcher.diagnose.straggler import find

    found = find({t["index"]: t["compute_ms"] for t in tasks})
    return found.to_json() if found else None
