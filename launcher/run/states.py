"""The run's lifecycle as the launcher records it: a task's state, an attempt's outcome, the run's state."""

from __future__ import annotations

import enum
from typing import TypedDict

from worker.host.protocol import EXIT_PREEMPTED


class Word(str, enum.Enum):
    """An enum whose members read as their words (in the record, on screen)."""

    _value_: str

    def __str__(self) -> str:
        return self.value


class RunPhase(Word):
    """The run's phases in its record (`phases`): when each began (the preflight's, how long it took)."""

    PREFLIGHT_S = "preflight_s"
    SPAWN_STARTED = "spawn_started"
    ALL_STARTED = "all_started"
    FIRST_STEP = "first_step"
    END = "end"


class Listed(Word):
    """What `ls`, `status` and the page show of a run beyond its recorded state (RunState)."""

    REFUSED = "refused"  # the preflight refused it: nothing was started (recorded: failed, kind refused)
    DAMAGED = "damaged"  # its record cannot be read (`ls`)


class AttemptPhase(Word):
    """An attempt's phases in its record (`attempts[].phases`; launcher.run.phases computes them)."""

    FAILED_AT = "failed_at"
    DETECTED_S = "detected_s"
    TEARDOWN_S = "teardown_s"
    COPY_S = "copy_s"
    COPY_BYTES = "copy_bytes"
    SPAWN_S = "spawn_s"
    WARM_TASKS = "warm_tasks"
    FIRST_STEP_S = "first_step_s"
    TOOK_S = "took_s"
    RESUMED_STEP = "resumed_step"
    REACHED_STEP = "reached_step"
    STEPS_REDONE = "steps_redone"
    BACK_S = "back_s"
    EPOCH_TOLD = "epoch_told"
    ESTIMATED = "estimated"  # the names of its figures that are estimates, not measured
    UNPRINTED = "epochs_unprinted"  # a restart's: epochs saved before it whose lines never reached the launcher


class Figures(TypedDict, total=False):
    """An attempt's phases as its record keeps them, one key per AttemptPhase (launcher.run.phases computes them;
    epoch_told only travels from an attempt's end to the next one's phases, it is not recorded)."""

    failed_at: float  # a unix time: when the failure that ended the attempt before happened
    detected_s: float
    teardown_s: float
    copy_s: float
    copy_bytes: int
    spawn_s: float
    warm_tasks: int
    first_step_s: float
    took_s: float
    resumed_step: int
    reached_step: int
    steps_redone: int
    back_s: float
    epoch_told: int
    estimated: list[str]
    epochs_unprinted: list[int]


class TaskState(Word):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    PREEMPTED = "preempted"
    STOPPED = "stopped"
    LOST = "lost"


class AttemptOutcome(Word):
    SUCCEEDED = "succeeded"
    PREEMPTED = "preempted"  # a notice (host, scheduler, or Slurm's requeue): restarts without counting
    FAILED = "failed"
    SHRUNK = "shrunk"  # a host was lost and the run went on without it (elastic)
    REGROUPED = "regrouped"  # a lost host came back: the group saved on notice and goes on with it (elastic)
    STOPPED = "stopped"  # Ctrl-C, TERM or `down`


class RegroupKind(Word):
    """How an elastic run's group changed: hosts lost, or hosts taken back."""

    SHRANK = "shrank"
    GREW = "grew"


class RunState(Word):
    PREFLIGHT = "preflight"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"  # its launcher ended without recording how the run ended

    @property
    def ended(self) -> bool:
        return self in (RunState.SUCCEEDED, RunState.FAILED, RunState.STOPPED, RunState.LOST)




def end_state(current: TaskState, code: int | None, notice: bool, lost: bool = False,
              stopping: bool = False) -> TaskState:
    """The one rule for how a task ended: its exit `code` (None: its supervisor was lost), whether it had notice
    (a host or scheduler taking the machine, or a peer's: preempted, saved or not), and whether the launcher was
    stopping it (then a pending or running task is stopped, or lost where its supervisor went away; a failed or
    preempted one stays so). The built-in runner saves on any TERM and exits EXIT_PREEMPTED: on the launcher's
    own stop (`down`, Ctrl-C, a failure's teardown) that is a stop that saved, not a preemption."""
    if not lost and notice:
        return TaskState.PREEMPTED
    if stopping:
        if current in (TaskState.PENDING, TaskState.RUNNING):
            return TaskState.LOST if lost and current == TaskState.RUNNING else TaskState.STOPPED
        return current
    if lost:
        return TaskState.LOST
    if code == EXIT_PREEMPTED:  # a notice the task took itself (a TERM to its process)
        return TaskState.PREEMPTED
    return TaskState.SUCCEEDED if code == 0 else TaskState.FAILED
