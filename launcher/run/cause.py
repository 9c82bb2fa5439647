"""What a task's log says caused its end: the exception its last traceback ends in (type, message, the user's
own innermost frame, the lines around it), and the tasks that a collective's abort names as unhealthy.
Pure functions of untrusted text: bounded, and any input gives an answer or None, never an error."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from launcher.run import fields
from launcher.run.screen import is_noise

MAX_LINES = 400  # of a log's tail, the newest read
MAX_CHARS = 1000  # of one line
MESSAGE_MAX = 300  # characters of an exception's message kept
AROUND = 12  # lines of the log around the cause, at most

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
HEADER = "Traceback (most recent call last):"
FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d{1,9})(?:, in (?P<function>.+))?$')
# "ValueError: msg", "tensorflow.python.framework.errors_impl.UnavailableError: msg", a bare "KeyboardInterrupt"
EXCEPTION = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Z]\w*)(?:: (?P<message>.*)|:?)$")
NAMED = re.compile(r"(Error|Exception|Exit|Interrupt|Iteration|Warning|Failure|Timeout)$")
# a frame that is not the user's: the interpreter's, a library's, the framework's generated code
NOT_USERS = re.compile(r"^<|/(site|dist)-packages/|/lib(64)?/python\d[\d.]*/|__autograph_generated_file")
LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d")  # absl's (TensorFlow's C++ side), from any thread
KERAS3_LEAD = "Exception encountered when calling"  # Keras 3: the message itself comes a few lines below
# TensorFlow's and XLA's coordination service (JAX too): the tasks it found unhealthy
TASK_NAME = re.compile(r"/job:[\w-]+/replica:\d+/task:(\d+)")
UNHEALTHY = "stopped sending heartbeats"
TIMED_OUT = re.compile(r"/job:[\w-]+/replica:\d+/task:(\d+)\s+(heartbeat timeout|has disconnected)")
# a task's own heartbeat to the service timed out: the task that hosts it (rank 0, the chief) stopped answering
LEADER = re.compile(r"RPC: /tensorflow\.CoordinationService/Heartbeat|Failed to send RPC to coordination service")


@dataclass(frozen=True)
class Cause:
    """The exception a task's log ends in: its type and message as printed, and the user's own innermost
    frame (not the interpreter's, a library's or the worker package's): None where the traceback has none."""

    exception: str
    message: str = ""
    file: str | None = None
    line: int | None = None
    function: str | None = None
    lines: list[str] = field(default_factory=list)  # the lines around it in the log

    @property
    def where(self) -> str | None:
        if self.file is None:
            return None
        return f"{self.file}:{self.line}" + (f", in {self.function}" if self.function else "")

    def words(self) -> str:
        """'ValueError: bad shape (at model.py:12, in call)'."""
        said = f"{self.exception}: {self.message}" if self.message else self.exception
        return f"{said} (at {self.where})" if self.where else said

    @classmethod
    def from_json(cls, data: object) -> "Cause | None":
        if data is None:
            return None
        try:
            return fields.build(cls, data)
        except (TypeError, ValueError):  # damaged: the failure stands without it
            return None


def bounded(lines: Iterable[object] | None) -> list[str]:
    """The newest MAX_LINES lines, each cut to MAX_CHARS, without terminal colours."""
    return [ANSI.sub("", str(line)[:MAX_CHARS]).rstrip("\r\n") for line in list(lines or [])[-MAX_LINES:]]


def of_log(tail: Iterable[object] | None) -> Cause | None:
    """The exception of the last traceback in a log's tail, or None where it holds none."""
    lines = bounded(tail)
    start = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].strip() == HEADER), None)
    if start is None:
        return None
    at = _exception_line(lines, start)
    if at is None:
        return None
    found = EXCEPTION.match(lines[at].strip())
    assert found is not None  # _exception_line chose the line by this match
    kind, message, said = found["type"], (found["message"] or "").strip(), at
    rest = _message_rest(lines, at + 1)
    if not message or message.endswith(":") or message.startswith(KERAS3_LEAD):
        kind, message, said = _inner(lines, rest, kind, message, said)
    frame = _users_frame(lines, start, len(lines))
    return Cause(exception=kind, message=_cut(message), file=frame[1] if frame else None,
                 line=frame[2] if frame else None, function=frame[3] if frame else None,
                 lines=_around(lines, start, frame[0] if frame else None, said))


def _exception_line(lines: list[str], start: int) -> int | None:
    """The line that names the exception: the first after the header, at the header's own indentation, that
    reads as one (a C++ log line of another thread may come in between)."""
    indent = len(lines[start]) - len(lines[start].lstrip())
    for i in range(start + 1, len(lines)):
        text = lines[i]
        if text.strip() and len(text) - len(text.lstrip()) <= indent and EXCEPTION.match(text.strip()):
            return i
    return None


def _message_rest(lines: list[str], begin: int) -> list[int]:
    """The lines that continue an exception's message: up to the next traceback or chained exception."""
    rest = []
    for i in range(begin, len(lines)):
        if lines[i].strip() in (HEADER, "During handling of the above exception, another exception occurred:",
                                "The above exception was the direct cause of the following exception:"):
            break
        rest.append(i)
    return rest


def _inner(lines: list[str], rest: list[int], kind: str, message: str, said: int) -> tuple[str, str, int]:
    """A message that only leads in ("in user code:", Keras 3's "Exception encountered when calling ..."): the
    innermost exception printed inside it (TensorFlow's traced code), else its first line of its own words."""
    nested = [(i, m) for i in rest if lines[i][:1].isspace() and (m := EXCEPTION.match(lines[i].strip()))
              and m["message"] and NAMED.search(m["type"])]
    if nested:
        at, m = nested[-1]
        if m["message"].strip() and not m["message"].strip().endswith(":"):
            return m["type"], m["message"].strip(), at
    for i in rest:
        text = lines[i].strip()
        if text and not lines[i][:1].isspace() and not LOG_LINE.match(text) and not text.startswith("Detected at node"):
            return kind, (f"{message} {text}" if message and not message.startswith(KERAS3_LEAD) else text), i
    return kind, message, said


def _users_frame(lines: list[str], begin: int, end: int) -> tuple[int, str, int, str | None] | None:
    """The innermost frame (the last printed, nested tracebacks of traced code included) in a file of the
    user's own: (its index, file, line, function)."""
    for i in range(end - 1, begin - 1, -1):
        m = FRAME.match(lines[i])
        if m and not NOT_USERS.search(m["file"]) and not _ours(m["file"]):
            return i, m["file"], int(m["line"]), (m["function"] or "").rstrip(" *") or None  # traced code: " *"
    return None


@lru_cache(maxsize=1)
def _worker_files() -> frozenset[str]:
    """The worker package's own modules (its examples are the user's kind of code), as 'worker/tensorflow/runner.py'."""
    import worker

    root = Path(worker.__file__).parent
    return frozenset(f"worker/{p.relative_to(root).as_posix()}" for p in root.rglob("*.py")
                     if "examples" not in p.relative_to(root).parts)


def _ours(file: str) -> bool:
    """A frame of the worker package, wherever it is installed on the task's host."""
    parts = file.replace("\\", "/").split("/")
    return any("/".join(parts[-n:]) in _worker_files() for n in (2, 3, 4) if len(parts) >= n)


def _around(lines: list[str], start: int, frame: int | None, said: int) -> list[str]:
    """The log's lines from the user's frame (and its caller's) to the exception's words, at most AROUND."""
    first = frame if frame is not None and frame < said else said
    caller = next((i for i in range(first - 1, max(start, first - 5) - 1, -1) if FRAME.match(lines[i])), None)
    first = caller if caller is not None else max(start, first - 2)
    shown = [x for x in lines[first:said + 1] if not is_noise(x)]  # TensorFlow's chatter from other threads
    while shown and not shown[0].strip():
        shown.pop(0)
    if len(shown) > AROUND:
        shown = [*shown[:3], "...", *shown[-(AROUND - 4):]]
    indent = min((len(x) - len(x.lstrip()) for x in shown if x.strip() and x != "..."), default=0)
    return [x[indent:] if x != "..." else x for x in shown]


def _cut(text: str) -> str:
    return text if len(text) <= MESSAGE_MAX else text[:MESSAGE_MAX - 1] + "…"


def unhealthy(tail: Iterable[object] | None) -> list[int]:
    """The tasks (their ranks in the cluster, as TF_CONFIG numbers them) that a collective's abort in this log
    blames: TensorFlow's (and XLA's, for JAX) coordination service names the tasks that stopped sending
    heartbeats (each on a line of its own after the words) or that timed out; a heartbeat to the service that
    timed out blames the task that hosts it, rank 0."""
    lines, found = bounded(tail), []
    for i, text in enumerate(lines):
        if UNHEALTHY in text:
            found += [int(r) for r in TASK_NAME.findall(text.split(UNHEALTHY, 1)[1])]
            for name in lines[i + 1:i + 1 + 64]:
                ranks = TASK_NAME.findall(name)
                if not ranks or TASK_NAME.sub("", name).strip(" ,;[]") != "":
                    break
                found += [int(r) for r in ranks]
        found += [int(m[1]) for m in TIMED_OUT.finditer(text)]
        found += [0] if LEADER.search(text) else []
    return sorted(set(found))
