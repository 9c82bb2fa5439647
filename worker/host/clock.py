"""Waiting with a bound, on the monotonic clock (a wall-clock step never cuts or stretches a wait)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Deadline:
    """A moment on the monotonic clock: how long is left until it, whether it has passed."""

    at: float

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        """`seconds` from now (None: never)."""
        return cls(math.inf if seconds is None else time.monotonic() + seconds)

    def left(self) -> float:
        """Seconds until the deadline, 0 once it passed (inf: none)."""
        return max(0.0, self.at - time.monotonic())

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self.at


def wait_until(fn: Callable[[], T], timeout: float, step: float = 0.2) -> T | None:
    """fn() until it gives something true (returned), for at most `timeout` seconds (then None)."""
    deadline = Deadline.after(timeout)
    while True:
        found = fn()
        if found or deadline.passed:
            return found or None
        time.sleep(min(step, deadline.left()))
