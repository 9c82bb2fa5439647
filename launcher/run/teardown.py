"""An attempt's end: stop its live tasks and take their exit reports (bounded), stop from their folders the
ones that did not confirm, or wait for the ones that something else (a scheduler) is ending."""

from __future__ import annotations

import queue
import time
from typing import Callable

from launcher.engines.base import Inspecting, Launching, ProbeRow, Result
from launcher.run import watch
from launcher.run.attempt import LiveAttempt
from launcher.run.record import RunRecord
from launcher.run.states import TaskState, end_state
from worker.host import protocol
from worker.host.clock import Deadline

SLACK_S = 8.0  # beyond stop_grace, how long to wait for exit reports before acting alone
TICK_S = 0.5

Say = Callable[[str], None]


def collect(run: RunRecord, live: LiveAttempt, seconds: float, say: Say) -> None:
    """Take the exit reports of the attempt's live tasks for up to `seconds`; a task stopped on the way
    is recorded stopped (preempted when it had notice); one that failed or was preempted stays so."""
    deadline = Deadline.after(seconds)
    while live.live and not deadline.passed:
        try:
            index, ev = live.events.get(timeout=min(TICK_S, deadline.left()))
        except queue.Empty:
            continue
        if index not in live.live:
            continue
        task = run.task(index)
        if isinstance(ev, protocol.Exit):
            live.saw_end(index)
            notice = bool(ev.notice) or live.preempted_at is not None  # a teardown of a preempted group saves
            task.ended(end_state(task.state, ev.code, notice, stopping=True), time.time(), ev.code)
        elif isinstance(ev, protocol.Lost):
            live.saw_end(index)
            task.ended(end_state(task.state, None, False, lost=True, stopping=True), time.time())
        elif isinstance(ev, protocol.Started):
            watch.apply(run, live, index, ev)
        elif isinstance(ev, protocol.Note):
            say(f"{watch.label(run, index)}: {ev.text}")


def teardown(engine: Launching, run: RunRecord, live: LiveAttempt, reason: str, grace: float, say: Say,
             broken: bool = False) -> list[int]:
    """Stop every live task of the attempt, then wait (bounded) for each one's exit report; past that,
    stop the rest from their folders. Returns the tasks that could not be reached to stop them. `broken`:
    a task failed, so the rest cannot save with it (Launching.stop)."""
    if not live.live:
        return []
    say(f"stopping {len(live.live)} task(s): {reason}")
    engine.stop(live.live, broken)
    collect(run, live, grace + SLACK_S, say)
    unreached = []
    stuck = live.live
    if stuck:
        say(f"tasks {stuck} did not confirm their stop; stopping them from their folders")
        for index, res in zip(stuck, from_folders(engine, stuck)):
            live.give_up(index)
            run.task(index).ended(TaskState.STOPPED if res.ok else TaskState.LOST, time.time())
            if not res.ok:  # an unreachable host must not end the teardown
                unreached.append(index)
                say(f"{watch.label(run, index)} could not be stopped: {res.error}")
    stopped_the_rest(run, live)
    return unreached


def from_folders(engine: Launching, indices: list[int]) -> list[Result[ProbeRow]]:
    """The Inspecting role stops tasks with no live handle; an engine without it reaches none."""
    if isinstance(engine, Inspecting):
        return engine.stop_from_folders(indices)
    return [Result(error=RuntimeError("this engine cannot stop a task from its folder")) for _ in indices]


def settle(run: RunRecord, live: LiveAttempt, reason: str, grace: float, say: Say) -> None:
    """Wait (bounded) for the exit reports of tasks that something else is ending, stopping nothing."""
    collect(run, live, grace + SLACK_S, say)
    for index in live.live:
        live.give_up(index)
        run.task(index).ended(TaskState.STOPPED, time.time())
        say(f"{watch.label(run, index)} sent no exit report ({reason})")
    stopped_the_rest(run, live)


def stopped_the_rest(run: RunRecord, live: LiveAttempt) -> None:
    """After a teardown no task of the attempt is pending or running."""
    for index in live.tasks:
        run.task(index).stopped_unless_ended()
