"""The typed protocol between the launcher and each task's supervisor (both sides import it).

The supervisor's stdout carries only these records, one JSON object per line; the training's
own output reaches the launcher inside `Output` records, as data, so nothing a training prints
can pass for an event. A line that does not decode is logged by the reader and ignored.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

VERSION = 1

EXIT_PREEMPTED = 75  # a task that saved its checkpoint on notice and stopped (EX_TEMPFAIL)
EXIT_PORT_BUSY = 98  # the supervisor found the task's port taken just before the start (EADDRINUSE)
BEAT_S = 2.0  # a supervisor sends Stats at least this often, training or not: the launcher's sign of life
FILE_MAX_BYTES = 65536  # a file the training can write (progress.json, task.json) larger than this is not read
MAX_DEPTH = 16  # a record's dicts and lists nested deeper are refused (recursion in json and asdict)
# The launcher's words on a supervisor's stdin (its own records go the other way): a standby's attempt starts;
# just before the EOF of a failure's teardown, a peer failed, so no save with the group can land (KILL at once); and
# the group regroups (a lost host is back): a notice, as a preemption's, the group saves and ends (exit 75)
GO, BROKEN, REGROUP = b"go\n", b"broken\n", b"regroup\n"
REGROUP_NOTICE = "regroup"  # the notice a task got (its Exit's `notice`) when the launcher regroups its group


def real(value: object) -> float | None:
    """A finite number that untrusted JSON holds (not a bool; an int too large for a float is none), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


class ProgressState(str, enum.Enum):
    """The `state` a task writes in progress.json (worker.training.progress)."""

    STARTING = "starting"
    TRAINING = "training"
    DONE = "done"
    PREEMPTING = "preempting"  # took a notice: saving with its group, at one agreed step
    PREEMPTED = "preempted"  # saved on notice

    @classmethod
    def of(cls, progress: Any) -> "ProgressState | None":
        """The state a progress dict says, or None (none given, or not one of ours: untrusted input)."""
        try:
            return cls(progress.get("state"))
        except (AttributeError, ValueError, TypeError):
            return None

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
    warm: bool = False  # forked from a fork server that had its imports done (worker.task.forkserver)


@dataclass(frozen=True)
class Output(Event):
    """Lines the training printed (already in worker.log); `dropped` lines were not forwarded."""

    kind: ClassVar[str] = "output"
    lines: list[str]
    dropped: int = 0


@dataclass(frozen=True)
class Progress(Event):
    kind: ClassVar[str] = "progress"
    progress: dict[str, Any]


@dataclass(frozen=True)
class Stats(Event):
    """Every BEAT_S, with or without figures (psutil may have none yet)."""

    kind: ClassVar[str] = "stats"
    cpu_percent: float | None = None
    rss: int | None = None
    status: str | None = None  # psutil's process status of the training ("stopped" after SIGSTOP)
    # its own GPUs, device-wide, as nvidia-smi told them last (worker.host.devices.GpuFigures as dicts); None: none known
    gpus: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Exit(Event):
    kind: ClassVar[str] = "exit"
    code: int  # negative: killed by that signal
    time: float
    tail: list[str] = field(default_factory=list)  # its last lines of output (about 8 KB, the newest kept)
    reason: str = ""  # what the supervisor itself found (a busy port, a program not found)
    notice: str = ""  # the signal that gave the task notice ("SIGTERM", "SIGUSR1"): a preemption, saved or not


@dataclass(frozen=True)
class Note(Event):
    """Something the task core found that the user should know, the task going on (a write that failed)."""

    kind: ClassVar[str] = "note"
    text: str


@dataclass(frozen=True)
class Standby(Event):
    """A standby's supervisor, every BEAT_S until its attempt begins: the task's fork server it holds (pid 0: none
    now; `ended`: how the last one ended), whether it has imported what it imports, and the memory holding it adds
    (worker.host.system.private_memory of the server and of the standby's supervisor), in bytes."""

    kind: ClassVar[str] = "standby"
    pid: int
    create_time: float
    ready: bool = False
    memory: int | None = None
    ended: str = ""


@dataclass(frozen=True)
class Lost(Event):
    """Launcher side only: the channel to a task's supervisor ended with no Exit record."""

    kind: ClassVar[str] = "lost"
    reason: str


EVENTS: dict[str, type[Event]] = {cls.kind: cls for cls in (Started, Output, Progress, Stats, Exit, Note, Standby)}


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether dicts and lists in `value` nest deeper than `limit` (looked at level by level, no recursion)."""
    level = [value]
    for _ in range(limit):
        level = [v for x in level if isinstance(x, (dict, list)) for v in (x.values() if isinstance(x, dict) else x)]
    return any(isinstance(x, (dict, list)) for x in level)


def json_object(raw: bytes) -> dict[str, Any] | None:
    """The JSON object in a file the training can write (progress.json, task.json), or None: it is untrusted
    input (too big, not JSON, not an object, nested too deep)."""
    if len(raw) > FILE_MAX_BYTES:
        return None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError, MemoryError):
        return None
    return data if isinstance(data, dict) and not too_deep(data) else None


def encode(event: Event) -> bytes:
    return (json.dumps({"v": VERSION, "event": event.kind, **asdict(event)}) + "\n").encode()


class BadRecord(ValueError):
    """A line that is not a record of this protocol."""


# each field's declared type, as written in the records above, and the JSON values that are one
_SIMPLE: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "str": str, "bool": bool,
                                              "dict[str, Any]": dict, "list[str]": list, "list[dict[str, Any]]": list,
                                              "None": type(None)}
_ITEMS: dict[str, type] = {"list[str]": str, "list[dict[str, Any]]": dict}  # what each of a list's items must be


def _typed(cls: type[Event], data: dict[str, Any]) -> dict[str, Any]:
    """The fields of `cls` in `data`, each of its declared type (a record is untrusted input: a file
    channel lies in a folder the training can write to); TypeError for any other."""
    out: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        value, kinds = data[f.name], [_SIMPLE[k.strip()] for k in str(f.type).split("|")]
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, tuple(
                t for k in kinds for t in (k if isinstance(k, tuple) else (k,)))):
            raise TypeError(f"{f.name} is {type(value).__name__}")
        item = next((_ITEMS[k.strip()] for k in str(f.type).split("|") if k.strip() in _ITEMS), None)
        if isinstance(value, list) and item is not None and not all(isinstance(x, item) for x in value):
            raise TypeError(f"{f.name} holds a value of another type")
        if isinstance(value, (dict, list)) and too_deep(value):
            raise TypeError(f"{f.name} is nested too deep")
        out[f.name] = value
    return out


def decode(line: bytes | str) -> Event:
    """The record on `line`; BadRecord for anything else (the caller logs it and goes on)."""
    try:
        data: Any = json.loads(line)
        cls = EVENTS[data.pop("event")]
        return cls(**_typed(cls, data))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, MemoryError) as exc:
        text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
        raise BadRecord(f"not a protocol record ({type(exc).__name__}): {text[:200]!r}") from None
