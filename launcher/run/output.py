"""What the launcher prints: its own lines, and each task's lines prefixed and coloured.

Printing happens on a thread of its own from a bounded queue, so a terminal that does not drain
(`up | less`, Ctrl-S, a slow SSH session) or a closed stdout never delays the agent: task lines
beyond the bound are dropped from the screen with a note (worker.log has them all), and the
launcher's own lines go to launcher.log before they are queued.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.text import Text

COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")
MAX_PENDING_LINES = 2000

# TensorFlow's C++ start-up chatter: kept in worker.log, hidden on screen unless --verbose.
NOISE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IW] \S+\.(cc|h):\d+\]"  # 2024-01-01 12:00:00.1: I tensorflow/x.cc:12]
    r"|[IW]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+\.(cc|h):\d+\]"  # absl: I0000 00:00:1795403425.1  8501 x.cc:52]
    r"|E\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ cuda\S*\.cc:\d+\] failed call to cuInit"  # CPU-only: not an error
    r"|WARNING: All log messages before absl::InitializeLog\(\) is called"
    r"|To enable the following instructions: .* rebuild TensorFlow"
    r"|This TensorFlow binary is optimized to use available CPU instructions)"
)


def is_noise(line: str) -> bool:
    return bool(NOISE.match(line))


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
        self.console = Console(file=_Fd(fd), highlight=False, soft_wrap=True, force_terminal=None)
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)
        self.log = None
        if log_path:
            try:
                self.log = os.fdopen(os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a", buffering=1)
            except OSError:  # a full MGPU_HOME: the run goes on, said on screen (Owner.save tells it)
                pass
        self.items: collections.deque = collections.deque()
        self.pending_lines = 0
        self.dropped: dict[int, int] = {}
        self.lock = threading.Condition()
        self.broken = False  # stdout closed: keep working, print nothing
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

    def show(self, renderable) -> None:
        """A table or other rich renderable, in order with everything else."""
        self._put(renderable)

    def task_lines(self, index: int, host: str, lines: list[str], dropped: int = 0) -> None:
        """A task's lines, each after its prefix 'task<index> <host> | ' (coloured by task)."""
        if self.quiet:
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

    # ---- the printing thread
    def _put(self, item) -> None:
        if not self.threaded:
            return self._print(item)
        with self.lock:
            self.items.append(item)
            self.lock.notify()

    def _print_loop(self) -> None:
        while True:
            with self.lock:
                while not self.items and not self.dropped:
                    self.lock.wait()
                dropped, self.dropped = self.dropped, {}
                item = self.items.popleft() if self.items else False
                if isinstance(item, tuple):
                    self.pending_lines -= len(item[1])
            for index, n in sorted(dropped.items()):
                self._print(Text(f"task{index} | ({n} lines not shown here: the terminal could not keep up; "
                                 "every line is in the task's worker.log)", style="dim"))
            if item is None:
                return
            if isinstance(item, tuple):
                (index, host), lines = item
                prefix = Text(f"task{index} {host} | ", style=COLOURS[index % len(COLOURS)])
                for line in lines:
                    self._print(prefix + Text(line))
            elif item is not False:
                self._print(item)

    def _print(self, renderable) -> None:
        if self.broken:
            return
        try:
            self.console.print(renderable)
        except OSError:  # EPIPE (`up | head`), EIO (terminal closed): the run goes on, unprinted
            self.broken = True
