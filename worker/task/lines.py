"""A task's output on its way to the launcher: split into lines, long lines cut, a flood thinned
(worker.log keeps everything), and the last lines kept whole for the exit report."""

from __future__ import annotations

import collections
import threading

LINE_MAX = 4096  # longer lines are cut on the way to the launcher
PENDING_MAX_LINES = 2000
TAIL_LINES = 20


class Lines:
    """Splits raw output into lines for the launcher: cut at LINE_MAX, a bounded queue, a full tail."""

    def __init__(self):
        self.partial = b""
        self.cutting = False  # inside a line that was already cut: skip to its end
        self.pending: collections.deque[str] = collections.deque()
        self.dropped = 0
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.lock = threading.Lock()
        self.arrived = threading.Event()  # lines are waiting to be taken

    def feed(self, chunk: bytes) -> None:
        data = self.partial + chunk
        *complete, self.partial = data.split(b"\n")
        out = []
        for raw in complete:
            if self.cutting:
                self.cutting = False
                continue
            out.append(raw.decode("utf-8", "replace").rstrip("\r"))
        if len(self.partial) > LINE_MAX:
            if not self.cutting:
                out.append(self.partial[:LINE_MAX].decode("utf-8", "replace") + " [... line cut; whole in worker.log]")
            self.cutting, self.partial = True, b""
        self._add(out)

    def drop_pending(self) -> None:
        """Forget what was not sent yet (counted as dropped): the exit report goes first."""
        with self.lock:
            self.dropped += len(self.pending)
            self.pending.clear()
            self.arrived.clear()

    def close(self) -> None:
        if self.partial and not self.cutting:
            self._add([self.partial.decode("utf-8", "replace")])
        self.partial = b""

    def _add(self, lines: list[str]) -> None:
        with self.lock:
            self.tail.extend(lines)
            room = max(0, PENDING_MAX_LINES - len(self.pending))
            self.pending.extend(lines[:room])
            self.dropped += max(0, len(lines) - room)
            if lines:
                self.arrived.set()

    def take(self, limit: int, max_bytes: int = 1 << 62) -> tuple[list[str], int]:
        """Up to `limit` lines (and about `max_bytes`), and how many were dropped since the last take."""
        with self.lock:
            lines, size = [], 0
            while self.pending and len(lines) < limit and size < max_bytes:
                lines.append(self.pending.popleft())
                size += len(lines[-1]) + 8
            if not self.pending:
                self.arrived.clear()
            if len(self.pending) > PENDING_MAX_LINES // 2:  # still flooding: thin it, keep the newest
                self.dropped += len(self.pending) - PENDING_MAX_LINES // 2
                while len(self.pending) > PENDING_MAX_LINES // 2:
                    self.pending.popleft()
            dropped, self.dropped = self.dropped, 0
            return lines, dropped
