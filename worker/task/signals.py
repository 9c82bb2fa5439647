"""An entry's signal handlers, installed first thing (standard library only): a signal that comes before
the task core exists is kept for it, and the core then starts nothing."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Callable, Protocol


class Stoppable(Protocol):
    """What the signals are handed to: the task core."""

    def stop(self, reason: str, notice: str = "") -> None: ...


class Signals:
    """INT and HUP stop the task; TERM and USR1 are a notice (a host or scheduler taking the machine), unless
    notice_ok() says otherwise (a scheduler ending a failed step). attach(core) hands them to the core."""

    def __init__(self, notice_ok: Callable[[], bool] = lambda: True):
        self.notice_ok = notice_ok
        self.core: Stoppable | None = None
        self.pending: tuple[str, str] | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.on_signal)

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        notice = name if signum in (signal.SIGTERM, signal.SIGUSR1) and self.notice_ok() else ""
        if self.core is None:
            self.pending = self.pending or (name, notice)
        else:
            threading.Thread(target=self.core.stop, args=(name, notice), daemon=True).start()

    def attach(self, core: Stoppable) -> None:
        self.core = core
        if self.pending:
            core.stop(*self.pending)
