"""What the launcher prints: its own lines, and each task's lines prefixed and coloured."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.text import Text

COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")


class Output:
    def __init__(self, quiet: bool = False, log_path: Path | None = None):
        self.quiet = quiet
        self.console = Console(highlight=False, soft_wrap=True)
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)
        self.log = open(log_path, "a", buffering=1) if log_path else None

    def _log(self, line: str) -> None:
        if self.log:
            self.log.write(time.strftime("%H:%M:%S ") + line + "\n")

    def say(self, message: str) -> None:
        self._log(message)
        self.console.print(Text("mgpu-cluster | ", style="bold") + Text(message))

    def task_line(self, plan, line: str) -> None:
        if self.quiet:
            return
        prefix = Text(f"task{plan.index} {plan.host.label} | ", style=COLOURS[plan.index % len(COLOURS)])
        self.console.print(prefix + Text(line))

    def error(self, message: str) -> None:
        self._log("error: " + message)
        self.err.print(Text("error: ", style="bold red") + Text(message))


