"""The Python stacks of every live task of a run, taken on each task's host (`python -m worker.host.stacks`
through the engine's `call`), in parallel; each task's answer or why there is none."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from launcher.engines.base import parallel
from launcher.plan import TaskPlan
from worker.host.stacks import Stacks
from worker.host.spawn import module_argv

CALL_TIMEOUT_S = 40.0  # `mgpu-cluster stacks`: someone waits for them
HANG_TIMEOUT_S = 6.0  # at a hang, before the peers are stopped: they must not delay fail-fast much

TaskAt = tuple[int, str, int | None] | tuple[int, str, int | None, float | None]


class StacksEngine(Protocol):
    """What taking stacks needs of an engine (an Engine that is Inspecting): its tasks' plans, a command on a
    task's host."""

    @property
    def plan(self) -> Mapping[int, TaskPlan]: ...

    def call(self, index: int, argv: list[str], timeout: float) -> tuple[int, str, str]: ...


class Log(Protocol):
    """Where at_hang tells what it took (launcher.run.output.Output)."""

    def logline(self, line: str) -> None: ...

    def say(self, message: str) -> None: ...


@dataclass(frozen=True)
class TaskStacks:
    index: int
    host: str
    pid: int | None
    stacks: Stacks | None
    error: str | None = None  # why there are no stacks

    @property
    def header(self) -> str:
        return f"task {self.index} ({self.host}) pid {self.pid if self.pid is not None else '?'}"

    def text(self) -> str:
        body = self.stacks.text() if self.stacks is not None and self.stacks.ok else f"no stacks: {self.why}"
        return f"{self.header}\n{body}"

    @property
    def why(self) -> str:
        return self.error or (self.stacks.error if self.stacks is not None else None) or "no answer"

    @property
    def ok(self) -> bool:
        return self.error is None and self.stacks is not None and self.stacks.ok


def _one(engine: StacksEngine, task: TaskAt, out: str | None, timeout: float) -> TaskStacks:
    """`task`: (index, host, pid, create time), or (index, host, pid) where its live launcher just heard from it."""
    index, host, pid = task[:3]
    if pid is None:
        return TaskStacks(index, host, pid, None, "its training process is not known (not started?)")
    plan = engine.plan[index]
    # py-spy gets half the time: one that does not answer is told by worker.host.stacks, not by a cut call
    argv = [*module_argv(plan.python, "worker.host.stacks"), "--pid", str(pid), "--json", "--timeout", f"{timeout / 2:g}"]
    if len(task) > 3:  # only the process started then is read: by now the pid may name another one
        if task[3] is None:
            return TaskStacks(index, host, pid, None, "the start time of its training process is not recorded, so "
                                                      "its pid may name another process now")
        argv += ["--create-time", repr(task[3])]
    if out:
        argv += ["--out", f"{plan.run_dir}/{out}"]
    try:
        code, stdout, stderr = engine.call(index, argv, timeout)
    except Exception as exc:  # noqa: BLE001 (an unreachable host is an answer too)
        return TaskStacks(index, host, pid, None, f"its host did not answer: {exc}")
    try:
        stacks = Stacks.from_json(json.loads(stdout.strip().splitlines()[-1]))
    except (ValueError, KeyError, TypeError, IndexError):
        err = (stderr.strip().splitlines() or [f"exit code {code}"])[-1]
        return TaskStacks(index, host, pid, None, f"python -m worker.host.stacks failed on its host: {err}")
    return TaskStacks(index, host, pid, stacks)


def take(engine: StacksEngine, tasks: Sequence[TaskAt], out: str | None = None,
         timeout: float = CALL_TIMEOUT_S) -> list[TaskStacks]:
    """Stacks of (index, host, pid, create time) tasks, in order, each within `timeout` seconds (a task given
    as (index, host, pid) is read by its pid alone); `out`: also appended to that file in each task's folder."""
    return [r.value if r.value is not None else TaskStacks(t[0], t[1], t[2], None, str(r.error))
            for t, r in zip(tasks, parallel(lambda t: _one(engine, t, out, timeout), list(tasks)))]


def file_name() -> str:
    return time.strftime("stacks-%Y%m%d-%H%M%S.txt")


def at_hang(engine: StacksEngine, tasks: Sequence[TaskAt], hung: int, out: Log) -> list[str]:
    """Before anything is stopped: every task's stacks into launcher.log (out.logline) and into a file in
    each task's folder; says where they went; returns the hung task's innermost frames (innermost last)."""
    name = file_name()
    found = take(engine, tasks, out=name, timeout=HANG_TIMEOUT_S)
    for ts in found:
        out.logline(f"stacks at the hang: {ts.text()}")
    answered = [ts.index for ts in found if ts.ok]
    out.say(f"stacks of task(s) {', '.join(map(str, answered)) or 'none'} taken before stopping anything: in "
            f"launcher.log and in {name} in each task's folder"
            + "".join(f"; task {ts.index}: {ts.why}" for ts in found if not ts.ok))
    mine = next((ts for ts in found if ts.index == hung and ts.ok), None)
    return mine.stacks.innermost(5) if mine and mine.stacks is not None else []
