"""Waiting with a bound, on the monotonic clock (a wall-clock step never cuts or stretches a wait)."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(fn: Callable[[], T], timeout: float, step: float = 0.2) -> T | None:
    """fn() until it gives something true (returned), for at most `timeout` seconds (then None)."""
    deadline = time.monotonic() + timeout
    while True:
        found = fn()
        if found or time.monotonic() >= deadline:
            return found or None
        time.sleep(min(step, max(0.0, deadline - time.monotonic())))
