"""Following a Slurm attempt: each task's events file (the task core's records) tailed into the same
Pump as every engine's records, by one thread for all tasks."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

from launcher.engines.base import Pump, Sink
from worker.host import protocol
from worker.host import layout

POLL_S = 0.2
READ_MAX = 1 << 20  # bytes of one events file per round
SETTLE_S = 1.5  # after the job (or step) ended, how long a task's last records may take to appear


class _Tail:
    """New complete lines of one events file; a file made anew (the task core makes it again when its
    folder was deleted) is read from its start."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""
        self.inode: tuple[int, int] | None = None

    def lines(self) -> list[bytes]:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if (st.st_dev, st.st_ino) != self.inode or st.st_size < self.offset:
                    self.inode, self.offset, self.partial = (st.st_dev, st.st_ino), 0, b""
                f.seek(self.offset)
                data = f.read(READ_MAX)
        except OSError:
            return []
        self.offset += len(data)
        *complete, self.partial = (self.partial + data).split(b"\n")
        return complete


def began(root: Path, indices: Iterable[int], attempt: int) -> bool:
    """Whether a task of `attempt` has begun (its task core made its events file): Slurm ran that attempt's job."""
    return any(layout.events_file(layout.task_dir(root, i), attempt).exists() for i in indices)


class Follower:
    """Tails every task's events file of one attempt until each task exited, or the job (step) is over
    and SETTLE_S passed: then a task with no exit report is Lost, for the reason `over()` gives. A job that
    Slurm requeued and runs again is over for this attempt too, though Slurm shows it running: its next run
    (the next attempt) has begun writing its own events files."""

    def __init__(self, root: Path, indices: list[int], attempt: int, sink: Sink, over: Callable[[], str | None],
                 on_exit: Callable[[protocol.Exit], None]):
        self.tails = {i: _Tail(layout.events_file(layout.task_dir(root, i), attempt)) for i in indices}
        self.root, self.indices, self.attempt = root, indices, attempt
        self.pumps = {i: Pump(i, sink, lambda: self.ended() or "its job ended with no exit report") for i in indices}
        self.over, self.on_exit = over, on_exit
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        over_since = None
        while not self.stopped.wait(POLL_S):
            exits = []
            for i, tail in self.tails.items():
                if self.pumps[i].exited:
                    continue
                for line in tail.lines():
                    try:
                        ev = protocol.decode(line)
                    except protocol.BadRecord:
                        ev = None
                    if isinstance(ev, protocol.Exit):
                        exits.append((ev.time, i, line, ev))
                    else:
                        self.pumps[i].feed(line)
            # exits seen in one round go in the order they happened: the task that failed first is named,
            # not a peer that Slurm (--kill-on-bad-exit) ended a moment later
            for _when, i, line, ev in sorted(exits, key=lambda e: e[:2]):
                self.on_exit(ev)
                self.pumps[i].feed(line)
            if all(p.exited for p in self.pumps.values()):
                return
            why = self.ended()
            over_since = (over_since or time.monotonic()) if why else None
            if over_since is not None and time.monotonic() - over_since > SETTLE_S:
                for p in self.pumps.values():
                    p.end()
                return

    def ended(self) -> str | None:
        """Why this attempt is over though tasks gave no exit report, or None. A requeued job's tasks have only
        Slurm's KillWait to save and report (a loaded node may not make it); the job may run again at once, so
        briefly out of RUNNING that no look at its state sees it."""
        why = self.over()
        if why is None and began(self.root, self.indices, self.attempt + 1):
            why = (f"Slurm requeued its job and runs it again (attempt {self.attempt + 1} started) with no exit "
                   f"report from this task of attempt {self.attempt}: Slurm ended it first (its KillWait)")
        return why

    def stop(self) -> None:
        self.stopped.set()

