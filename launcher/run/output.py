"""What the launcher prints: its own lines, and each task's lines prefixed and coloured (told once: see
screen.py; only on the printing thread, so `logs` shows every task's own lines).

Printing happens on a thread of its own from a bounded queue, so a terminal that does not drain
(`up | less`, Ctrl-S, a slow SSH session) or a closed stdout never delays the agent: task lines
beyond the bound are dropped from the screen with a note (worker.log has them all), and the
launcher's own lines go to launcher.log before they are queued.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from pathlib import Path
from typing import Literal, Union

from rich.console import Console, RenderableType
from rich.text import Text

from launcher.run.screen import Entry, Window, is_epoch_line, is_noise

COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")
MAX_PENDING_LINES = 2000
PRINTED_KEPT = 64  # each task's newest lines on screen, to tell whether a failure's tail was shown
# what the printing thread takes, in order: a renderable, a task's lines ((index, host), lines), an Event to set
# once everything before it is printed, None to end
Item = Union[RenderableType, tuple[tuple[int, str], list[str]], threading.Event, None]


class _Fd:
    """A file object over a raw fd: no Python buffer whose lock a stuck write could hold at exit."""

    encoding = "utf-8"

    def __init__(self, fd: int):
        self.fd = fd

    def write(self, text: str) -> int:
        data = memoryview(text.encode("utf-8", "replace"))
        while data:
            data = data[os.write(self.fd, data):]
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return os.isatty(self.fd)

    def fileno(self) -> int:
        return self.fd


class Output:
    def __init__(self, quiet: bool = False, log_path: Path | None = None, verbose: bool = False,
                 threaded: bool = True):
        """threaded=False: print at once, on the caller's thread (short commands)."""
        self.quiet, self.verbose, self.threaded = quiet, verbose, threaded
        fd = sys.stdout.fileno() if hasattr(sys.stdout, "fileno") else 1
        # rich takes IO[str] but uses only write, flush, isatty, fileno and encoding of it: what _Fd has
        self.console = Console(file=_Fd(fd), highlight=False, soft_wrap=True,  # type: ignore[arg-type]
                               force_terminal=None)
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)
        self.log = None
        if log_path:
            try:
                self.log = os.fdopen(os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a", buffering=1)
            except OSError:  # a full MGPU_HOME: the run goes on, said on screen (Owner.save tells it)
                pass
        self.items: collections.deque[Item] = collections.deque()
        self.pending_lines = 0
        self.dropped: dict[int, int] = {}
        self.lock = threading.Condition()
        self.broken = False  # stdout closed: keep working, print nothing
        self.screen = Window(collapse=not verbose)
        self.printed: dict[int, collections.deque[str | None]] = {}  # None stands for lines not shown
        self.thread = threading.Thread(target=self._print_loop, daemon=True)
        if threaded:
            self.thread.start()

    # ---- what callers use (never blocks on the terminal)
    def logline(self, line: str) -> None:
        if self.log:
            try:
                self.log.write(time.strftime("%H:%M:%S ") + line + "\n")
            except OSError:
                pass

    def say(self, message: str) -> None:
        self.logline(message)
        self._put(Text("mgpu-cluster | ", style="bold") + Text(message))

    def show(self, renderable: RenderableType) -> None:
        """A table or other rich renderable, in order with everything else."""
        self._put(renderable)

    def task_lines(self, index: int, host: str, lines: list[str], dropped: int = 0) -> None:
        """A task's lines, each after its prefix 'task<index> <host> | ' (coloured by task)."""
        if self.quiet:  # the epochs' lines alone
            lines = [line for line in lines if is_epoch_line(line)]
            if not lines:
                return
        if not self.verbose:
            lines = [line for line in lines if not is_noise(line)]
        if not self.threaded:
            prefix = Text(f"task{index} {host} | ", style=COLOURS[index % len(COLOURS)])
            for line in lines:
                self._print(prefix + Text(line))
            return
        with self.lock:
            room = max(0, MAX_PENDING_LINES - self.pending_lines)
            shown = lines[:room]
            lost = dropped + len(lines) - len(shown)
            if lost:
                self.dropped[index] = self.dropped.get(index, 0) + lost
            if shown:
                self.items.append(((index, host), shown))
                self.pending_lines += len(shown)
                self.lock.notify()

    def error(self, message: str) -> None:
        self.logline("error: " + message)
        try:
            self.err.print(Text("error: ", style="bold red") + Text(message))
        except OSError:
            pass

    def close(self, timeout: float = 5.0) -> bool:
        """Print what is queued (at most `timeout` s); False when the terminal did not take it."""
        if not self.threaded:
            return True
        with self.lock:
            self.items.append(None)
            self.lock.notify()
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def showed(self, index: int, lines: list[str], timeout: float = 1.0) -> bool:
        """Whether the screen showed `lines` (noise aside) as task `index`'s newest lines: a failure's tail
        that the live stream showed need not be told again. Waits up to `timeout` s for the printer."""
        want = [line for line in lines if not is_noise(line)]
        if not want or self.quiet or not self.threaded:
            return False
        done = threading.Event()
        self._put(done)
        if not done.wait(timeout) or self.broken:
            return False
        seen = [line for line in list(self.printed.get(index, ())) if line is None or not is_noise(line)]
        return seen[-len(want):] == want

    # ---- the printing thread
    def _put(self, item: RenderableType | threading.Event) -> None:
        if not self.threaded:
            assert not isinstance(item, threading.Event)  # showed() waits on the printing thread only
            return self._print(item)
        with self.lock:
            self.items.append(item)
            self.lock.notify()

    def _print_loop(self) -> None:
        while True:
            with self.lock:
                while not self.items and not self.dropped:
                    due = self.screen.next_due()
                    if due is not None and due <= time.monotonic():
                        break
                    self.lock.wait(None if due is None else due - time.monotonic())
                dropped, self.dropped = self.dropped, {}
                item: Item | Literal[False] = self.items.popleft() if self.items else False
                if isinstance(item, tuple):
                    self.pending_lines -= len(item[1])
            now = time.monotonic()
            if isinstance(item, tuple):
                (index, host), lines = item
                self.screen.add(index, host, lines, now)
            # anything but a task's lines comes after every line held so far
            held = self.screen.due(now) if item is False or isinstance(item, tuple) else self.screen.drain()
            if dropped:
                held += self.screen.drain()
            for entry in held:
                self._print_entry(entry)
            for index, n in sorted(dropped.items()):
                self._print(Text(f"task{index} | ({n} lines not shown here: the terminal could not keep up; "
                                 "every line is in the task's worker.log)", style="dim"))
                self._printed(index, None)
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
            elif item is not False and not isinstance(item, tuple):
                self._print(item)

    def _print_entry(self, entry: Entry) -> None:
        single = len(entry.printed_by) == 1
        style = COLOURS[entry.printed_by[0] % len(COLOURS)] if single else "bold"
        self._print(Text(entry.prefix, style=style) + Text(entry.text, style="dim" if entry.note else ""))
        for index in entry.printed_by:
            self._printed(index, None if entry.note or self.broken else entry.text)

    def _printed(self, index: int, line: str | None) -> None:
        self.printed.setdefault(index, collections.deque(maxlen=PRINTED_KEPT)).append(line)

    def _print(self, renderable: RenderableType) -> None:
        if self.broken:
            return
        try:
            self.console.print(renderable)
        except OSError:  # EPIPE (`up | head`), EIO (terminal closed): the run goes on, unprinted
            self.broken = True
