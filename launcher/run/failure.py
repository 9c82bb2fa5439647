"""A run's failure as data: which task, on which host, what kind, its code or signal, its cause (the exception
its log ends in), its log; shown as one paragraph, given as an object in `status --json` (and kept per attempt)."""

from __future__ import annotations

import dataclasses
import enum
import signal
from dataclasses import asdict, dataclass, field
from typing import Protocol

from launcher.run import fields
from launcher.run.cause import Cause, of_log
from launcher.run.screen import is_noise
from worker.host import protocol


class FailureKind(str, enum.Enum):
    """The documented kinds of failure (README, `status --json`)."""

    EXITED = "exited"  # the training exited with a non-zero code
    KILLED = "killed"  # the training was killed by a signal
    LOST = "lost"  # its host or supervisor went away or fell silent
    HUNG = "hung"  # no progress past heartbeat_timeout
    NOT_STARTED = "not_started"  # it could not be started (or did not start within start_timeout)
    PORT_TAKEN = "port_taken"  # its port was taken between the preflight and the start
    SCHEDULER = "scheduler"  # the scheduler ended it: time limit, node failure, cancelled from outside
    REFUSED = "refused"  # the preflight refused the cluster: nothing was started
    STOPPED = "stopped"  # Ctrl-C, TERM or `mgpu-cluster down`

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    message: str  # the paragraph shown to the user
    task: int | None = None
    host: str | None = None
    exit_code: int | None = None
    signal: str | None = None  # "SIGKILL"
    log: str | None = None  # host:path of the task's worker.log
    tail: list[str] = field(default_factory=list)  # the last lines of its log
    cause: Cause | None = None  # the exception its log ends in (an exit's only)

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["kind"] = str(self.kind)
        return data

    @classmethod
    def from_json(cls, data: object) -> "Failure | None":
        if isinstance(data, str):  # a record written before failures were data
            return cls(kind=FailureKind.EXITED, message=data)
        try:
            return fields.build(cls, data, {"kind": FailureKind, "cause": Cause.from_json})
        except (TypeError, ValueError):  # damaged: the run's record stands without it
            return None


def signal_name(code: int | None) -> str | None:
    """SIGKILL for an exit code of -9 (killed by that signal); None for an exit."""
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def describe_exit(code: int) -> str:
    name = signal_name(code)
    if name:
        hint = "; SIGKILL often means out of memory, or a kill -9" if name == "SIGKILL" else ""
        return f"was killed by {name} (exit code {code}{hint})"
    return f"exited with code {code}"


def of_exit(ev: protocol.Exit) -> tuple[FailureKind, str]:
    """The kind and the words of a task's non-zero exit."""
    if ev.code == protocol.EXIT_PORT_BUSY and ev.reason:
        return FailureKind.PORT_TAKEN, ev.reason
    if ev.reason:
        return FailureKind.NOT_STARTED, ev.reason
    return (FailureKind.KILLED if ev.code < 0 else FailureKind.EXITED), describe_exit(ev.code)


def of_task(kind: FailureKind, what: str, index: int, label: str, host: str, log: str, tail: list[str],
            run_id: str, code: int | None = None, said: list[str] | None = None) -> Failure:
    """A task's failure, with the paragraph: the task, what happened and, for an exit, the exception it ended
    in (`said`: the log's tail it is read from, else `tail`), then the lines around that exception, else its
    log's last lines (without the start-up chatter the screen hides, unless that is all there is), what next."""
    cause = of_log(tail if said is None else said) if kind == FailureKind.EXITED else None
    tail = [line for line in tail if not is_noise(line)] or list(tail)
    what = f"{what}: {cause.words()}" if cause else what
    message = (f"{label} {what.rstrip('.')}. Every other task was stopped. {log_block(log, tail, cause)}\n"
               f"Read the whole log with 'mgpu-cluster logs {run_id} --task {index}'.")
    return Failure(kind=kind, message=message, task=index, host=host, exit_code=code, signal=signal_name(code),
                   log=log, tail=tail, cause=cause)


def log_block(log: str | None, tail: list[str], cause: Cause | None = None) -> str:
    """The lines around the cause in the log, else its last lines."""
    if cause is not None and cause.lines:
        return "Around it in its log ({}):\n{}".format(log, "\n".join(f"    {line}" for line in cause.lines))
    shown = "\n".join(f"    {line}" for line in tail) or "    (no output)"
    return f"Last lines of its log ({log}):\n{shown}"


class Screen(Protocol):
    def showed(self, index: int, lines: list[str]) -> bool: ...


def told_once(failure: Failure, screen: Screen) -> str:
    """The paragraph for a screen that may have shown the failed task's last lines live already: then they
    are not told again, only pointed to (the cause is told in its first words), else with the last of them."""
    block = log_block(failure.log, failure.tail, failure.cause)
    if failure.task is None or not failure.tail or block not in failure.message \
            or not screen.showed(failure.task, failure.tail):
        return failure.message
    pointer = f"Its log ({failure.log}) ends with the lines shown above (task{failure.task})"
    pointer += "." if failure.cause else f"; the last:\n    {failure.tail[-1]}"
    return failure.message.replace(block, pointer, 1)


def with_stacks(failure: Failure, frames: list[str]) -> Failure:
    """A hang's failure with the innermost frames of the hung task's training process in its paragraph."""
    if not frames:
        return failure
    shown = "\n".join(f"    {f}" for f in frames)
    return dataclasses.replace(failure, message=f"{failure.message}\nWhere its training was (innermost frame last; "
                                                f"every task's stacks are in launcher.log):\n{shown}")


def stop_words(stopped: list[str], unreached: list[str], lifeline: float) -> str:
    """What a stop achieved, truthfully: which tasks stopped, which could not be reached."""
    if not unreached:
        return "every task was stopped"
    return (f"{'task(s) ' + ', '.join(stopped) + ' were stopped; ' if stopped else ''}{', '.join(unreached)} could "
            f"not be reached: they stop by themselves when they hear nothing from their launcher for {lifeline:g} s "
            "(lifeline)")
