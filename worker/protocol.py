"""The typed protocol between the launcher and each task's supervisor (both sides import it).

The supervisor's stdout carries only these records, one JSON object per line; the training's
own output reaches the launcher inside `Output` records, as data, so nothing a training prints
can pass for an event. A line that does not decode is logged by the reader and ignored.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

VERSION = 1

EXIT_PREEMPTED = 75  # a task that saved its checkpoint on notice and stopped (EX_TEMPFAIL)
EXIT_PORT_BUSY = 98  # the supervisor found the task's port taken just before the start (EADDRINUSE)
BEAT_S = 2.0  # a supervisor sends Stats at least this often, training or not: the launcher's sign of life


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


@dataclass(frozen=True)
class Event:
    """Base of every record; `kind` names it on the wire."""

    kind: ClassVar[str] = ""


@dataclass(frozen=True)
class Started(Event):
    kind: ClassVar[str] = "started"
    pid: int
    create_time: float
    supervisor_pid: int
    time: float
    host: str = ""  # where it runs, when the engine learns it only now (a scheduler's node)
    port: int = 0  # its TF port, when the engine learns it only now (derived from a scheduler's job id)


@dataclass(frozen=True)
class Output(Event):
    """Lines the training printed (already in worker.log); `dropped` lines were not forwarded."""

    kind: ClassVar[str] = "output"
    lines: list[str]
    dropped: int = 0


@dataclass(frozen=True)
class Progress(Event):
    kind: ClassVar[str] = "progress"
    progress: dict


@dataclass(frozen=True)
class Stats(Event):
    """Every BEAT_S, with or without figures (psutil may have none yet)."""

    kind: ClassVar[str] = "stats"
    cpu_percent: float | None = None
    rss: int | None = None
    status: str | None = None  # psutil's process status of the training ("stopped" after SIGSTOP)


@dataclass(frozen=True)
class Exit(Event):
    kind: ClassVar[str] = "exit"
    code: int  # negative: killed by that signal
    time: float
    tail: list[str] = field(default_factory=list)  # its last lines of output, none left out
    reason: str = ""  # what the supervisor itself found (a busy port, a program not found)


@dataclass(frozen=True)
class Lost(Event):
    """Launcher side only: the channel to a task's supervisor ended with no Exit record."""

    kind: ClassVar[str] = "lost"
    reason: str


EVENTS: dict[str, type[Event]] = {cls.kind: cls for cls in (Started, Output, Progress, Stats, Exit)}


def encode(event: Event) -> bytes:
    return (json.dumps({"v": VERSION, "event": event.kind, **asdict(event)}) + "\n").encode()


class BadRecord(ValueError):
    """A line that is not a record of this protocol."""


def decode(line: bytes | str) -> Event:
    """The record on `line`; BadRecord for anything else (the caller logs it and goes on)."""
    try:
        data: Any = json.loads(line)
        cls = EVENTS[data.pop("event")]
        data.pop("v", None)
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
        raise BadRecord(f"not a protocol record ({type(exc).__name__}): {text[:200]!r}") from None
