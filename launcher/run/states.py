"""The run's lifecycle as the launcher records it: a task's state, an attempt's outcome, the run's state."""

from __future__ import annotations

import enum


class TaskState(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    PREEMPTED = "preempted"
    STOPPED = "stopped"
    LOST = "lost"

    def __str__(self) -> str:
        return self.value


class AttemptOutcome(str, enum.Enum):
    SUCCEEDED = "succeeded"
    PREEMPTED = "preempted"  # a notice (host, scheduler, or Slurm's requeue): restarts without counting
    FAILED = "failed"
    SHRUNK = "shrunk"  # a host was lost and the run went on without it (elastic)
    STOPPED = "stopped"  # Ctrl-C, TERM or `down`

    def __str__(self) -> str:
        return self.value


class RunState(str, enum.Enum):
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

    def __str__(self) -> str:
        return self.value
