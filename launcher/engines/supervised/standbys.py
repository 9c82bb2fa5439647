"""Standbys: per task, a supervisor for the next attempt, started once the task has started, holding the task's
fork server (worker.task.forkserver: Python, the framework and our runner imported). A restart begins on it,
forked in a second, instead of starting cold. One that dies is replaced (never a failure of the run); all are
stopped with the engine.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from launcher.engines.base import Sink, StandbyState
from launcher.engines.supervised.transport import Handle, Transport
from launcher.plan import TaskPlan
from worker.host import protocol
from worker.host.clock import Deadline

REPLACEMENTS = 3  # per task and run: a standby that keeps dying (a broken environment) is not started again
CLOSE_WAIT_S = 5.0  # a standby stops in well under a second (TERM, KILL after 0.5 s)


class Relay:
    """A standby's records: to its keeper until its attempt begins, then to that attempt's sink."""

    def __init__(self, on_standby: Callable[[protocol.Event], None]):
        self.on_standby = on_standby
        self.sink: Sink | None = None
        self.lock = threading.Lock()

    def begin(self, sink: Sink | None) -> None:
        with self.lock:
            self.sink = sink

    def event(self, index: int, event: protocol.Event) -> None:
        with self.lock:
            sink = self.sink
        if sink is not None:
            sink.event(index, event)
        else:
            self.on_standby(event)

    def output(self, index: int, lines: list[str], dropped: int) -> None:
        with self.lock:
            sink = self.sink
        if sink is not None:
            sink.output(index, lines, dropped)

    def garbage(self, index: int, text: str) -> None:
        with self.lock:
            sink = self.sink
        if sink is not None:
            sink.garbage(index, text)


@dataclass
class Standby:
    attempt: int
    plan: TaskPlan  # as it was started: a restart with another plan (its environment) starts cold
    relay: Relay
    handle: Handle | None = None
    gone: bool = False  # its supervisor ended, or it was stopped


class Standbys:
    """The standbys of one engine's tasks, at most one per task."""

    def __init__(self, transports: dict[int, Transport], told: Callable[[int, StandbyState | None], None],
                 said: Callable[[int, str], None]):
        self.transports, self.told, self.said = transports, told, said
        self.now: dict[int, Standby] = {}
        self.replaced: dict[int, int] = {}
        self.told_notes: set[tuple[int, str]] = set()
        self.lock = threading.Lock()
        self.closed = False
        self.starting: list[threading.Thread] = []

    def want(self, plan: TaskPlan, attempt: int) -> None:
        """Task `plan.index` trains in attempt `attempt - 1`: keep a standby for `attempt` (started in a thread:
        this runs on the task's record stream)."""
        with self.lock:
            have = self.now.get(plan.index)
            if self.closed or have is not None and have.attempt == attempt and not have.gone:
                return
            standby = self.now[plan.index] = Standby(attempt, plan, Relay(lambda e: self.heard(standby, e)))
        if have is not None:
            self._stop(have)
        starting = threading.Thread(target=self._start, args=(standby,), daemon=True)
        self.starting.append(starting)
        starting.start()

    def _start(self, standby: Standby) -> None:
        plan = standby.plan
        try:
            handle = self.transports[plan.index].start(plan, standby.attempt, standby.relay, standby=True)
        except Exception:  # noqa: BLE001 (a host that cannot start one now: a restart starts cold)
            standby.gone = True
            return
        with self.lock:
            standby.handle = handle
            late = self.closed or self.now.get(plan.index) is not standby
        if late:
            handle.stop()
            handle.wait(CLOSE_WAIT_S)

    def heard(self, standby: Standby, event: protocol.Event) -> None:
        """A standby's record before its attempt: its state, or its end (Exit, Lost): replaced, a few times."""
        index = standby.plan.index
        with self.lock:
            if self.now.get(index) is not standby:  # taken, stopped or replaced: no longer this task's
                return
        if isinstance(event, protocol.Standby):  # pid 0: none now (a program that does not start warm)
            state = StandbyState(pid=event.pid, ready=event.ready, memory=event.memory, attempt=standby.attempt)
            self.told(index, state if event.pid else None)
            return
        if isinstance(event, protocol.Note):  # its core gave up on its program (it kept dying), or cannot fork it
            with self.lock:
                told = (index, event.text) in self.told_notes  # the next attempt's standby says the same: once
                self.told_notes.add((index, event.text))
            if not told:
                self.said(index, event.text)
            return
        if not isinstance(event, (protocol.Exit, protocol.Lost)):
            return
        with self.lock:
            if self.now.get(index) is not standby or standby.gone:
                return
            standby.gone = True
            del self.now[index]
            again = not self.closed and self.replaced.get(index, 0) < REPLACEMENTS
            if again:
                self.replaced[index] = self.replaced.get(index, 0) + 1
        self.told(index, None)
        if again:
            self.want(standby.plan, standby.attempt)
        elif not self.closed:
            how = f"code {event.code}" if isinstance(event, protocol.Exit) else "its link lost"
            self.said(index, f"its standby's supervisor ended ({how}), {REPLACEMENTS + 1} times in all: none is "
                             f"started again, so attempt {standby.attempt} starts cold if the run restarts")

    def take(self, plan: TaskPlan, attempt: int, sink: Sink) -> Handle | None:
        """The standby for `attempt` of this task, begun and reporting to `sink`; None: start cold."""
        with self.lock:
            standby = self.now.pop(plan.index, None)
        if standby is None:
            return None
        self.told(plan.index, None)
        handle = standby.handle
        if handle is not None and not standby.gone and standby.attempt == attempt and standby.plan == plan:
            standby.relay.begin(sink)
            if handle.begin():
                return handle
            standby.relay.begin(None)  # its end is no task's
        self._stop(standby)
        return None

    def _stop(self, standby: Standby) -> None:
        standby.gone = True
        if standby.handle is not None:
            standby.handle.stop()

    def close(self) -> None:
        """Stop every standby and wait (a bounded while) until they are gone: when the run's launcher
        exits, none is left on any host."""
        with self.lock:
            self.closed = True
            left, self.now = list(self.now.values()), {}
        for standby in left:
            self._stop(standby)
            self.told(standby.plan.index, None)
        deadline = Deadline.after(CLOSE_WAIT_S)
        for starting in self.starting:  # one being started now stops itself once started (_start)
            starting.join(deadline.left())
        for standby in left:
            if standby.handle is not None:
                standby.handle.wait(deadline.left())


class Started:
    """An attempt's sink that says once per task when it has started: the time to start its standby (which only
    holds the task's fork server, so it costs the start nothing). Never after the task ended."""

    def __init__(self, sink: Sink, started: Callable[[int], None]):
        self.sink, self.started = sink, started
        self.done: set[int] = set()

    def event(self, index: int, event: protocol.Event) -> None:
        self.sink.event(index, event)
        if index in self.done or not isinstance(event, (protocol.Started, protocol.Exit, protocol.Lost)):
            return
        self.done.add(index)
        if isinstance(event, protocol.Started):
            self.started(index)

    def output(self, index: int, lines: list[str], dropped: int) -> None:
        self.sink.output(index, lines, dropped)

    def garbage(self, index: int, text: str) -> None:
        self.sink.garbage(index, text)
