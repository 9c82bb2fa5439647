"""A task's progress record as the launcher uses it: progress.json is written by the training, so it is
untrusted input. One boundary turns it into typed, bounded fields; anything else is dropped."""

from __future__ import annotations

import math
from typing import Any

from worker.protocol import ProgressState

WHOLE = ("task", "epoch", "epochs", "step", "steps_per_epoch", "global_step", "first_epoch", "first_global_step",
         "pid", "replicas")
REAL = ("loss", "samples_per_sec", "time", "compute_ms", "wait_ms")
MAX_METRICS, MAX_NAME = 32, 64


def _whole(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53 else None


def _real(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def typed(progress: Any) -> dict:
    """The fields of a progress record that have the type the launcher expects; {} for a non-dict."""
    if not isinstance(progress, dict):
        return {}
    out: dict = {}
    for key in WHOLE:
        if _whole(progress.get(key)) is not None:
            out[key] = progress[key]
    for key in REAL:
        if _real(progress.get(key)) is not None:
            out[key] = _real(progress[key])
    state = ProgressState.of(progress)
    if state is not None:
        out["state"] = str(state)
    metrics = progress.get("metrics")
    if isinstance(metrics, dict):  # names shown on a terminal: no control characters (escape sequences)
        out["metrics"] = {str(k)[:MAX_NAME]: _real(v) for k, v in list(metrics.items())[:MAX_METRICS]
                          if _real(v) is not None and str(k).isprintable()}
    return out
