"""Ctrl-C, TERM and HUP: every command turns them into KeyboardInterrupt (exit 130), except
inside `shield()`, where teardown and the final record are finished first."""

from __future__ import annotations

import contextlib
import signal
from dataclasses import dataclass
from types import FrameType
from typing import Callable, Iterator


@dataclass
class _State:
    signal: str | None = None  # the last signal raised as KeyboardInterrupt
    shielded: int = 0  # shield() blocks entered and not left
    pending: str | None = None  # a signal that came while shielded
    say: Callable[[str], None] | None = None


_state = _State()


def _handler(signum: int, _frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    if _state.shielded:
        first = _state.pending is None
        _state.pending = _state.pending or name
        if first and _state.say:
            _state.say(f"{name}: already stopping every task; this ends by itself in a few seconds")
        return
    _state.signal = name
    raise KeyboardInterrupt(name)


def install() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _handler)


def reason() -> str:
    name = _state.signal or "SIGINT"
    return f"interrupted by {name}" + (" (Ctrl-C)" if name == "SIGINT" else "")


def pending() -> str | None:
    """A signal that came while shielded (it is acted on once the shield ends)."""
    return _state.pending


def raise_pending() -> None:
    """Act now on a signal that came while shielded: what was shielded is done, and nothing new may
    start (a restart after a Ctrl-C or a `down` that came during the teardown)."""
    name = _state.pending
    if name:
        _state.pending, _state.signal = None, name
        raise KeyboardInterrupt(name)


@contextlib.contextmanager
def shield(say: Callable[[str], None] | None = None) -> Iterator[None]:
    """Signals that come inside are noted, not raised: what is inside always finishes."""
    _state.shielded += 1
    _state.say = say or _state.say
    try:
        yield
    finally:
        _state.shielded -= 1
