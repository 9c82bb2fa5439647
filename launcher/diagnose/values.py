"""Numbers and words read from a run's files for its pictures: untrusted, so each is taken only when it is a
finite value of its type and range (else None), and times become seconds since the run began."""

from __future__ import annotations

from typing import Any

from launcher.run.progress import real

MAX_VALUE = 1e12  # a rate, a step time, a loss or a metric beyond this is no measure
MAX_TEXT = 4000  # characters of a reason: mgpu-cluster writes far fewer
SLACK_S = 5.0  # progress a little past the run's end (another host's clock) still counts


def integer(value: Any) -> int | None:
    """A whole number that may be negative (an exit code)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**31 else None


def measure(value: Any) -> float | None:
    found = real(value)
    return found if found is not None and abs(found) <= MAX_VALUE else None


def text(value: Any) -> str | None:
    return value[:MAX_TEXT] if isinstance(value, str) and value else None


def measures(metrics: Any) -> dict[str, float]:
    found = metrics.items() if isinstance(metrics, dict) else ()
    return {str(k): v for k, v in ((k, measure(v)) for k, v in found) if v is not None}


def items(value: object) -> list[dict[str, Any]]:  # Any: JSON objects, read field by field by the caller
    """A list's dicts; nothing for anything else."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


class Clock:
    """Seconds since the run began (`t0`); None for a time that is not a number, before t0, or past
    `horizon` (the run's end, or now) by more than SLACK_S."""

    def __init__(self, t0: float, horizon: float | None):
        self.t0, self.horizon = t0, horizon

    def __call__(self, when: Any) -> float | None:
        at = real(when)
        if at is None or at < self.t0 or (self.horizon is not None and at > self.horizon + SLACK_S):
            return None
        return round(at - self.t0, 3)
