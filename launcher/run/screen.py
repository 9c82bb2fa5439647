"""What the live screen makes of the tasks' lines: TensorFlow's start-up chatter hidden, a line that several
tasks print alike within a moment shown once naming them (`task0-2 | ...`), and a task's collective-abort
error (a consequence of a peer's failure or loss) told in one line. Pure: no I/O, the caller's clock.
"""

from __future__ import annotations

import collections
import itertools
import re
from dataclasses import dataclass, field

from worker.task.lines import NOTE

WINDOW_S = 0.5  # how long a line waits for the same line from other tasks
HELD_MAX = 2000  # lines held at most: beyond, the oldest is shown at once (a flood is never held up)
JOIN_BACK = 32  # how far back a line may join the same line of other tasks, moving its own lines before it

# The C++ start-up chatter of TensorFlow and of JAX's gloo: kept in worker.log, hidden on screen unless --verbose.
NOISE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IW] \S+\.(cc|h):\d+\]"  # 2024-01-01 12:00:00.1: I tensorflow/x.cc:12]
    r"|[IW]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+\.(cc|h):\d+\]"  # absl: I0000 00:00:1795403425.1  8501 x.cc:52]
    r"|E\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ cuda\S*\.cc:\d+\] failed call to cuInit"  # CPU-only: not an error
    r"|WARNING: All log messages before absl::InitializeLog\(\) is called"
    r"|To enable the following instructions: .* rebuild TensorFlow"
    r"|This TensorFlow binary is optimized to use available CPU instructions"
    r"|\[Gloo\] Rank )"  # gloo's threads may write into one another's line: "[Gloo] Rank [Gloo] Rank 0 is ..."
)
# A collective that TensorFlow aborted: its C++ log line, or the Python error it ends in.
ABORT = re.compile(r"\] (Aborting \w+ with|BaseCollectiveExecutor::StartAbort)|Collective ops is aborted by")
# What follows an abort: more error lines, gRPC's details, the traceback (indented, headers, blank lines).
ABORT_REST = re.compile(
    r"^(E\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+\.(cc|h):\d+\]"
    r"|Additional GRPC error information from remote target"
    r"|:UNKNOWN:Error received from peer"
    r"|The error could be from a previous operation"
    r"|Traceback \(most recent call last\):"
    r"|During handling of the above exception"
    r"|The above exception was the direct cause"
    r"|\s|$)"
)
TRACEBACK = "Traceback (most recent call last):"
ABORTED = ("(collective ops aborted: a peer failed or went away; this task's error and traceback are in its "
           "worker.log, not shown here)")


def is_noise(line: str) -> bool:
    return bool(NOISE.match(line))


def tasks_label(tasks: list[int]) -> str:
    """'task0-2,5' for tasks [0, 1, 2, 5]."""
    runs: list[list[int]] = []
    for t in sorted(tasks):
        if runs and t == runs[-1][-1] + 1:
            runs[-1].append(t)
        else:
            runs.append([t])
    return "task" + ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


@dataclass(eq=False)
class Entry:
    """One line on screen: its text, the tasks that printed it and their hosts."""

    text: str
    printed_by: list[int]  # the tasks that printed this line alike
    hosts: list[str]
    at: float  # when it came (the caller's monotonic clock)
    seq: int
    note: bool = False  # the launcher's words (a collapsed abort), not the task's own

    @property
    def prefix(self) -> str:
        return f"task{self.printed_by[0]} {self.hosts[0]} | " if len(self.printed_by) == 1 else f"{tasks_label(self.printed_by)} | "


# the worker's epoch line ends with the rate that task measured; the workers' metrics are all-reduced, so their
# epoch lines differ only there (worker/progress.format_epoch_line): alike, shown once with the rate of the lowest
# task that printed it (the chief's: the one the group's figures elsewhere give, launcher.run.view.group)
OWN_RATE = re.compile(r"^(epoch \d+/\d+ .*) samples/s=\d+$")
EPOCH_LINE = re.compile(r"^epoch \d+/\d+ ")  # worker.training.progress.format_epoch_line's


def is_epoch_line(line: str) -> bool:
    """An epoch's line (what `up --quiet`, and so a detached run's launcher.out, still shows of a task)."""
    return bool(EPOCH_LINE.match(line.rsplit("\r", 1)[-1]))


def key(line: str) -> str:
    """Lines alike: the same text once the frames a carriage return overwrote and trailing blanks are gone (and,
    in an epoch line, the rate each task measured for itself)."""
    text = line.rsplit("\r", 1)[-1].rstrip()
    rate = OWN_RATE.match(text)
    return rate.group(1) if rate else text


@dataclass
class Window:
    """Lines held for `window` s in the order they came; one that another task printed alike meanwhile joins
    it, as long as that task's own lines stay in order. `collapse`: a task's collective-abort error becomes
    one line (off with --verbose)."""

    window: float = WINDOW_S
    held_max: int = HELD_MAX
    collapse: bool = True
    held: collections.deque[Entry] = field(default_factory=collections.deque)
    latest: dict[str, Entry] = field(default_factory=dict)  # the newest held entry of each text
    last_seq: dict[int, int] = field(default_factory=dict)  # each task's newest held entry
    aborting: set[int] = field(default_factory=set)  # tasks inside a collapsed abort
    hidden: collections.Counter[int] = field(default_factory=collections.Counter)  # lines collapsed, per task
    seq: int = 0

    def add(self, index: int, host: str, lines: list[str], now: float) -> None:
        for line in lines:
            if self.collapse and self._collapsed(index, host, line, now):
                continue
            self._hold(index, host, line, now)

    def due(self, now: float) -> list[Entry]:
        """The entries whose moment is over (or beyond the bound), oldest first."""
        out = []
        while self.held and (now - self.held[0].at >= self.window or len(self.held) > self.held_max):
            out.append(self._release())
        return out

    def drain(self) -> list[Entry]:
        return [self._release() for _ in range(len(self.held))]

    def next_due(self) -> float | None:
        return self.held[0].at + self.window if self.held else None

    def _hold(self, index: int, host: str, text: str, now: float, note: bool = False) -> None:
        k = key(text)
        entry = self.latest.get(k)
        if entry is None or entry.note != note or not self._join(entry, index):
            self.seq += 1
            entry = self.latest[k] = Entry(text, [index], [host], now, self.seq, note)
            self.held.append(entry)
            self.last_seq[index] = entry.seq
            return
        if index < min(entry.printed_by):  # its own rate is the one shown (OWN_RATE)
            entry.text = text
        entry.printed_by.append(index)
        entry.hosts.append(host)

    def _join(self, entry: Entry, index: int) -> bool:
        """Whether task `index` can join `entry` with its own lines kept in order: the entry comes after
        its newest line, or the few lines it holds after the entry (its alone) can go before it."""
        if entry.seq > self.last_seq.get(index, -1):
            self.last_seq[index] = entry.seq
            return True
        if index in entry.printed_by:
            return False
        tail = list(itertools.islice(reversed(self.held), JOIN_BACK))
        if entry not in tail:
            return False
        tail = tail[:tail.index(entry) + 1][::-1]  # from the entry to the newest
        own = [e for e in tail[1:] if index in e.printed_by]
        if any(len(e.printed_by) > 1 for e in own):
            return False
        for e in own:  # shown with the entry, never later than their own moment
            e.at = entry.at
        moved = own + [entry] + [e for e in tail[1:] if index not in e.printed_by]
        for _ in tail:
            self.held.pop()
        first = entry.seq
        for n, e in enumerate(moved):
            e.seq = first + n
            self.held.append(e)
            for t in e.printed_by:
                self.last_seq[t] = e.seq
        self.last_seq[index] = entry.seq
        return True

    def _release(self) -> Entry:
        entry = self.held.popleft()
        if self.latest.get(key(entry.text)) is entry:
            del self.latest[key(entry.text)]
        return entry

    def _collapsed(self, index: int, host: str, line: str, now: float) -> bool:
        """True when `line` belongs to a collective abort of task `index` (and is not shown)."""
        if index in self.aborting:
            if ABORT_REST.match(line) or ABORT.search(line):
                self.hidden[index] += 1
                return True
            if line.startswith(NOTE):  # its supervisor's stop, told while the task still prints the abort
                return False
            self.aborting.discard(index)  # a line of its own again: the abort is over
            return False
        if not ABORT.search(line):
            return False
        self.aborting.add(index)
        self.hidden[index] += 1 + self._take_back(index)
        self._hold(index, host, ABORTED, now, note=True)
        return True

    def _take_back(self, index: int) -> int:
        """The task's traceback held so far (an abort seen only at its end): taken off the screen; how many."""
        taken: list[Entry] = []
        for entry in reversed(self.held):
            if index not in entry.printed_by or entry.text.startswith(NOTE):
                continue
            if entry.note or not ABORT_REST.match(entry.text):
                break
            taken.append(entry)
            if entry.text == TRACEBACK:
                break
        for entry in taken:
            at = entry.printed_by.index(index)
            del entry.printed_by[at], entry.hosts[at]
        if taken:
            self.held = collections.deque(e for e in self.held if e.printed_by)
            self.latest = {k: e for k, e in self.latest.items() if e.printed_by}
            self.last_seq[index] = max((e.seq for e in self.held if index in e.printed_by), default=-1)
        return len(taken)
