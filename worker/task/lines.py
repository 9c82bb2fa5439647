"""A task's output on its way to the launcher: split into lines, long lines cut, a flood thinned
(worker.log keeps everything), and the last lines kept for the exit report. Sizes are counted as the
protocol encodes them (JSON with ensure_ascii: a non-ASCII character takes 6 or 12 bytes)."""

from __future__ import annotations

import collections
import json
import threading

LINE_MAX = 4096  # encoded bytes; longer lines are cut on the way to the launcher
PENDING_MAX_LINES = 2000
TAIL_LINES = 200  # the exit report's most: a whole traceback, for its cause (TAIL_BYTES bounds it)
TAIL_BYTES = 8192  # the exit report's tail, encoded: it must not hold up fail-fast on a slow link
CUT = " [... line cut; whole in worker.log]"
NOTE = "[mgpu task] "  # a line of the supervisor's own among its task's output (a stop, a kill, a refusal)


def printable(text: str, limit: int = 300) -> str:
    """Untrusted text for a one-line message: control characters replaced, cut to `limit` characters."""
    text = "".join(c if c.isprintable() else "?" for c in " ".join(text.split()))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def encoded(line: str) -> int:
    """Bytes `line` takes in a record."""
    return len(json.dumps(line))


def clip(line: str, limit: int = LINE_MAX, cut: bool = False) -> str:
    """`line` within about `limit` encoded bytes, marked when cut (or when `cut` says it was cut already)."""
    if len(line) * 12 + 2 <= limit:  # no character takes more than 12 bytes (a surrogate pair): no need to encode
        return line + CUT if cut else line
    size = encoded(line)
    while size > limit:
        line = line[:len(line) * limit // size]  # shorter each round: a few rounds at most
        size, cut = encoded(line), True
    return line + CUT if cut else line


class Lines:
    """Splits raw output into lines for the launcher: cut at LINE_MAX, a bounded queue, the last lines."""

    def __init__(self) -> None:
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
            out.append(clip(raw.decode("utf-8", "replace").rstrip("\r")))
        if len(self.partial) > LINE_MAX:
            if not self.cutting:
                out.append(clip(self.partial[:LINE_MAX].decode("utf-8", "replace"), cut=True))
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
            self._add([clip(self.partial.decode("utf-8", "replace"))])
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
        """Up to `limit` lines (and about `max_bytes` encoded), and how many were dropped since the last take."""
        with self.lock:
            lines: list[str] = []
            size = 0
            while self.pending and len(lines) < limit and size < max_bytes:
                lines.append(self.pending.popleft())
                size += encoded(lines[-1]) + 2
            if not self.pending:
                self.arrived.clear()
            if len(self.pending) > PENDING_MAX_LINES // 2:  # still flooding: thin it, keep the newest
                self.dropped += len(self.pending) - PENDING_MAX_LINES // 2
                while len(self.pending) > PENDING_MAX_LINES // 2:
                    self.pending.popleft()
            dropped, self.dropped = self.dropped, 0
            return lines, dropped

    def tail_lines(self, max_bytes: int = TAIL_BYTES) -> list[str]:
        """The last lines for the exit report, the newest kept: each cut to a quarter of `max_bytes`, all
        within it."""
        with self.lock:
            newest_first = [clip(line, max_bytes // 4) for line in reversed(self.tail)]
        kept, size = [], 0
        for line in newest_first:
            size += encoded(line) + 2
            if size > max_bytes:
                break
            kept.append(line)
        return kept[::-1]
