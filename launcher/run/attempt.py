"""One attempt while it runs: which of its tasks started and which ended (facts that only move forward,
taken from events), when each was last heard from, their output tails, and the Sink its engine reports to."""

from __future__ import annotations

import collections
import queue
import time
from dataclasses import dataclass, field

from launcher.run.output import Output
from launcher.run.record import RunRecord
from worker.host import protocol

TAIL_LINES = 15


@dataclass
class LiveAttempt:
    """The live state of attempt `number`; clocks are monotonic (the record keeps wall times)."""

    number: int
    tasks: list[int]
    spawned_at: float = field(default_factory=time.monotonic)  # when start() returned (a job left the queue)
    started: set[int] = field(default_factory=set)  # a Started report, or any end: a task that ended has started
    ended: set[int] = field(default_factory=set)  # an Exit or Lost, or given up (not started, stopped unconfirmed)
    heard: dict[int, float] = field(default_factory=dict)  # any record: the sign of life
    progressed: dict[int, float] = field(default_factory=dict)  # progress past its first step: the heartbeat
    preempted_at: float | None = None  # the first notice of the attempt
    events: queue.Queue[tuple[int, protocol.Event]] = field(default_factory=queue.Queue)  # from this attempt's sink
    tails: dict[int, collections.deque[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tails = {i: collections.deque(maxlen=TAIL_LINES) for i in self.tasks}

    @property
    def live(self) -> list[int]:
        """The tasks whose end is not known yet: the ones a teardown stops."""
        return [i for i in self.tasks if i not in self.ended]

    @property
    def all_started(self) -> bool:
        return all(i in self.started for i in self.tasks)

    def saw_start(self, index: int) -> None:
        self.started.add(index)

    def saw_end(self, index: int) -> None:
        self.started.add(index)
        self.ended.add(index)

    def give_up(self, index: int) -> None:
        """No report will be waited for: it could not be started, or its stop went unconfirmed."""
        self.ended.add(index)


class AttemptSink:
    """What one attempt's tasks report: events into that attempt's queue (a late report of an earlier
    attempt lands in its own, which no one reads any more); output to the display and the tails."""

    def __init__(self, live: LiveAttempt, run: RunRecord, out: Output):
        self.live, self.run, self.out = live, run, out

    def event(self, index: int, event: protocol.Event) -> None:
        self.live.events.put((index, event))

    def output(self, index: int, lines: list[str], dropped: int) -> None:
        self.live.tails[index].extend(lines)
        self.out.task_lines(index, self.run.host_of(index)[0], lines, dropped)

    def garbage(self, index: int, text: str) -> None:
        self.out.logline(f"task {index}: a line from its supervisor that is not a record (ignored): {text}")
        self.output(index, [text], 0)
