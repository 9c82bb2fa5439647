"""A task's progress record as the launcher uses it: progress.json is written by the training, so it is
untrusted input. One boundary turns it into typed, bounded fields; anything else is dropped."""

from __future__ import annotations

import math
from typing import Any

from worker.training.progress import EPOCH_ENDS_KEPT
from worker.host.protocol import ProgressState

WHOLE = ("task", "epoch", "epochs", "step", "steps_per_epoch", "global_step", "first_epoch", "first_global_step",
         "pid", "replicas")
# samples_per_sec is the training throughput (worker.training.progress.training_rate) of the epoch so far, from its
# epoch_samples and epoch_train_s; each finished epoch's summary keeps its own (samples, train_s)
REAL = ("loss", "samples_per_sec", "epoch_samples", "epoch_train_s", "time", "compute_ms", "wait_ms", "first_step_at")
EPOCH_REAL = ("start", "end", "samples", "train_s", "samples_per_sec", "loss")
MAX_METRICS, MAX_NAME = 32, 64


def whole(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53 else None


def real(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def step(progress: dict | None, key: str = "global_step") -> int:
    """A typed progress record's global step (or its `key`: first_global_step, steps_per_epoch...); 0 when it
    gives none."""
    return (progress or {}).get(key) or 0


def typed(progress: Any) -> dict:
    """The fields of a progress record that have the type the launcher expects; {} for a non-dict."""
    if not isinstance(progress, dict):
        return {}
    out: dict = {}
    for key in WHOLE:
        if whole(progress.get(key)) is not None:
            out[key] = progress[key]
    for key in REAL:
        if real(progress.get(key)) is not None:
            out[key] = real(progress[key])
    state = ProgressState.of(progress)
    if state is not None:
        out["state"] = str(state)
    if isinstance(progress.get("metrics"), dict):
        out["metrics"] = _metrics(progress["metrics"])
    ends = progress.get("epoch_ends")
    if isinstance(ends, list):
        out["epoch_ends"] = [_epoch_end(e) for e in ends[-EPOCH_ENDS_KEPT:]
                             if isinstance(e, dict) and whole(e.get("epoch")) is not None]
    return out


def _metrics(metrics: dict) -> dict:
    """Names shown on a terminal: no control characters (escape sequences)."""
    return {str(k)[:MAX_NAME]: real(v) for k, v in list(metrics.items())[:MAX_METRICS]
            if real(v) is not None and str(k).isprintable()}


def _epoch_end(end: dict) -> dict:
    """One finished epoch's summary: its number, when it was measured (start, end), its samples, training seconds
    and their rate, loss, metrics."""
    out = {"epoch": end["epoch"], **{k: real(end.get(k)) for k in EPOCH_REAL if real(end.get(k)) is not None}}
    if isinstance(end.get("metrics"), dict):
        out["metrics"] = _metrics(end["metrics"])
    return out


def without_told(progress: dict | None, told: list) -> dict | None:
    """`progress` with only the epoch summaries that `told` (the task's previous record's) did not hold: the
    run's history (progress.jsonl) gets each finished epoch once, not in every record while progress.json
    keeps it."""
    if not progress or "epoch_ends" not in progress:
        return progress
    return {**progress, "epoch_ends": [e for e in progress["epoch_ends"] if e not in told]}
