"""A task's progress record as the launcher uses it: progress.json is written by the training, so it is
untrusted input. One boundary turns it into typed, bounded fields; anything else is dropped."""

from __future__ import annotations

import typing
from typing import Literal, TypedDict

from worker.training.progress import EPOCH_ENDS_KEPT
from worker.host.protocol import ProgressState
from worker.host.protocol import real as real  # the one reading of an untrusted number (re-exported)

Whole = Literal["task", "epoch", "epochs", "step", "steps_per_epoch", "global_step", "first_epoch",
                "first_global_step", "pid", "replicas"]
# samples_per_sec is the training throughput (worker.training.progress.training_rate) of the epoch so far, from its
# epoch_samples and epoch_train_s; each finished epoch's summary keeps its own (samples, train_s)
Real = Literal["loss", "samples_per_sec", "epoch_samples", "epoch_train_s", "time", "compute_ms", "wait_ms",
               "first_step_at"]
EpochReal = Literal["start", "end", "samples", "train_s", "samples_per_sec", "loss"]
WHOLE: tuple[Whole, ...] = typing.get_args(Whole)
REAL: tuple[Real, ...] = typing.get_args(Real)
EPOCH_REAL: tuple[EpochReal, ...] = typing.get_args(EpochReal)
MAX_METRICS, MAX_NAME = 32, 64


class _Epoch(TypedDict):
    epoch: int


class EpochEnd(_Epoch, total=False):
    """One finished epoch's summary, as typed()."""

    start: float
    end: float
    samples: float
    train_s: float
    samples_per_sec: float
    loss: float
    metrics: dict[str, float]


class Progress(TypedDict, total=False):
    """A progress record as typed(): the fields of WHOLE and REAL that the training gave with their type, its
    state (a ProgressState's word), metrics and finished epochs."""

    task: int
    epoch: int
    epochs: int
    step: int
    steps_per_epoch: int
    global_step: int
    first_epoch: int
    first_global_step: int
    pid: int
    replicas: int
    loss: float
    samples_per_sec: float
    epoch_samples: float
    epoch_train_s: float
    time: float
    compute_ms: float
    wait_ms: float
    first_step_at: float
    state: str
    metrics: dict[str, float]
    epoch_ends: list[EpochEnd]


def whole(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53 else None


def step(progress: Progress | None, key: Whole = "global_step") -> int:
    """A typed progress record's global step (or its `key`: first_global_step, steps_per_epoch...); 0 when it
    gives none."""
    return (progress or {}).get(key) or 0


def position(progress: Progress | None) -> tuple[int | None, int | None]:
    """Where a record says its task is, as (epoch, step within it), by one rule: from its global step where it
    gives steps_per_epoch, the last step of a finished epoch being that epoch's (a record just past an epoch's end
    and one at its last step are the same moment: 6 and 102/102, never 7 and 0/102); else as the record says."""
    p = progress or {}
    g, per = p.get("global_step"), p.get("steps_per_epoch")
    if g and per:
        epoch = -(-g // per)
        return epoch, g - (epoch - 1) * per
    return p.get("epoch") or None, p.get("step") if p.get("epoch") else None


def typed(progress: object) -> Progress:
    """The fields of a progress record that have the type the launcher expects; {} for a non-dict."""
    if not isinstance(progress, dict):
        return {}
    out: Progress = {}
    for key in WHOLE:
        number = whole(progress.get(key))
        if number is not None:
            out[key] = number
    for name in REAL:
        value = real(progress.get(name))
        if value is not None:
            out[name] = value
    state = ProgressState.of(progress)
    if state is not None:
        out["state"] = str(state)
    if isinstance(progress.get("metrics"), dict):
        out["metrics"] = _metrics(progress["metrics"])
    ends = progress.get("epoch_ends")
    if isinstance(ends, list):
        out["epoch_ends"] = [_epoch_end(e, epoch) for e in ends[-EPOCH_ENDS_KEPT:]
                             if isinstance(e, dict) and (epoch := whole(e.get("epoch"))) is not None]
    return out


def _metrics(metrics: dict[object, object]) -> dict[str, float]:
    """Names shown on a terminal: no control characters (escape sequences)."""
    return {str(k)[:MAX_NAME]: value for k, v in list(metrics.items())[:MAX_METRICS]
            if (value := real(v)) is not None and str(k).isprintable()}


def _epoch_end(end: dict[object, object], epoch: int) -> EpochEnd:
    """One finished epoch's summary: its number, when it was measured (start, end), its samples, training seconds
    and their rate, loss, metrics."""
    out: EpochEnd = {"epoch": epoch}
    for key in EPOCH_REAL:
        value = real(end.get(key))
        if value is not None:
            out[key] = value
    metrics = end.get("metrics")
    if isinstance(metrics, dict):
        out["metrics"] = _metrics(metrics)
    return out


def without_told(progress: Progress | None, told: list[EpochEnd]) -> Progress | None:
    """`progress` with only the epoch summaries that `told` (the task's previous record's) did not hold: the
    run's history (progress.jsonl) gets each finished epoch once, not in every record while progress.json
    keeps it."""
    if not progress or "epoch_ends" not in progress:
        return progress
    return {**progress, "epoch_ends": [e for e in progress["epoch_ends"] if e not in told]}
