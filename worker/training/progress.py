"""progress.json: the task's heartbeat and training progress, rewritten atomically, and the one definition of
training throughput (`training_rate`). Plain Python: the launcher reads the file with `read_progress`; the Keras
callback that feeds it is worker.training.keras_progress."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from worker.training.errors import SettingError
from worker.host.protocol import FILE_MAX_BYTES, ProgressState, json_object
from worker.host import env, layout
from worker.host.files import write_private

FILENAME = layout.PROGRESS
STATES = tuple(str(state) for state in ProgressState)
DEFAULT_INTERVAL_S = 0.25  # a few writes per supervisor read (1 s): what it reads is recent, not the step after a pause
# progress.json keeps the summaries of this many finished epochs: the supervisor reads it about once a second, so
# an epoch shorter than that still reaches the run's history
EPOCH_ENDS_KEPT = 8


def number(value: Any) -> float | None:
    """A float fit for JSON (None for NaN/inf or anything not a number)."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _finite(value: Any) -> Any:
    """`value` with NaN/inf floats (also inside dicts and lists) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def training_rate(samples: float | None, seconds: float | None) -> float | None:
    """Training throughput, the one definition every figure named samples/s uses: samples trained / the seconds
    spent training them (each training batch from its begin to its end: no validation, no saves, not fit's first,
    traced, step). None until both are known."""
    samples, seconds = number(samples), number(seconds)
    return samples / seconds if samples and seconds and seconds > 0 else None


def read_progress(path: str) -> dict[str, Any] | None:  # Any: a file the training writes, untrusted
    """The last progress written at `path` (a progress.json or the folder that holds it); None where there
    is none, or what is there is not progress (too big, not JSON, not an object, nested too deep)."""
    if os.path.isdir(path):
        path = os.path.join(path, FILENAME)
    try:
        with open(path, "rb") as handle:
            return json_object(handle.read(FILE_MAX_BYTES + 1))
    except OSError:
        return None


def interval_from_env() -> float:
    """MGPU_PROGRESS_INTERVAL: seconds between progress.json writes on batches."""
    text = os.environ.get(env.PROGRESS_INTERVAL, "").strip() or str(DEFAULT_INTERVAL_S)
    value = number(text)
    if value is None or value < 0:
        raise SettingError(f"MGPU_PROGRESS_INTERVAL is {text!r}, not a number of seconds (0 or more): set it to the "
                           f"seconds between progress.json writes (e.g. 1), or unset it for {DEFAULT_INTERVAL_S:g}")
    return value


class ProgressWriter:
    """Holds the progress fields of one task and writes them to `<run_dir>/progress.json`.

    With `run_dir=None` nothing is written (a task started by hand); the fields are still kept.
    `update()` writes at most every `interval` seconds unless `force=True`. Only training
    code calls it, so the file's `time` goes silent when training hangs. A user's own loop may
    report its step split too: `update(compute_ms=..., wait_ms=...)` (own work and the wait for peers
    in the all-reduce, per step; `mgpu-cluster status` names a straggler from them).
    """

    def __init__(self, run_dir: str | None, task: int = 0, epochs: int = 0,
                 steps_per_epoch: int | None = None, interval: float | None = None):
        self.path = Path(run_dir, FILENAME) if run_dir else None
        self.interval = interval_from_env() if interval is None else interval
        self._warned = False
        self.fields: dict[str, Any] = {
            "task": int(task), "state": str(ProgressState.STARTING), "epoch": 0, "epochs": int(epochs),
            "step": 0, "steps_per_epoch": steps_per_epoch, "global_step": 0, "first_epoch": 1,
            "first_global_step": 0, "loss": None, "metrics": {}, "samples_per_sec": None, "epoch_samples": 0,
            "epoch_train_s": 0.0,
            "time": time.time(), "pid": os.getpid(), "epoch_ends": [],
        }
        self._last_write = 0.0
        self._epoch_ended = False  # an epoch's summary not written yet

    def epoch_end(self, epoch: int, start: float | None, loss: float | None,
                  metrics: Mapping[str, float | None]) -> None:
        """Keeps a finished epoch's training throughput (its epoch line's samples/s, from the epoch's samples and
        training seconds), loss and metrics, with when it was measured (`start` to now), among the last
        EPOCH_ENDS_KEPT; the next update writes it, due or not."""
        samples, seconds = self.fields.get("epoch_samples"), self.fields.get("epoch_train_s")
        end = {"epoch": int(epoch), "start": start, "end": time.time(), "samples": samples, "train_s": seconds,
               "samples_per_sec": training_rate(samples, seconds), "loss": loss, "metrics": dict(metrics)}
        self.fields["epoch_ends"] = [*self.fields.get("epoch_ends", []), end][-EPOCH_ENDS_KEPT:]
        self._epoch_ended = True

    def due(self) -> bool:
        """Whether an unforced `update()` would write now."""
        return time.time() - self._last_write >= self.interval

    def update(self, force: bool = False, **fields: Any) -> bool:
        """Merges `fields`; writes when forced or when the interval has passed. True if written."""
        if "state" in fields and fields["state"] not in STATES:
            raise ValueError(f"state must be one of {STATES}, not {fields['state']!r}")
        if self.fields.get("state") == ProgressState.PREEMPTING and fields.get("state") == ProgressState.TRAINING:
            fields = {**fields, "state": str(ProgressState.PREEMPTING)}  # a notice stands until the task stops
        self.fields.update(fields)
        paced = force or self.due()
        if not paced and not self._epoch_ended:
            return False
        now = time.time()
        self.fields["time"] = now
        if paced:  # an epoch's end alone is written at once without putting off the next write
            self._last_write = now
        self._epoch_ended = False
        if self.path:
            self._write(self.path, json.dumps(_finite(self.fields), indent=1, allow_nan=False) + "\n")
        return True

    def _write(self, path: Path, text: str) -> None:
        """One atomic write, in its folder made again if it was deleted; a write that fails (a full disk) never
        ends the training: it goes on without progress.json, said once on stderr."""
        try:
            if not path.parent.is_dir():
                path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_private(path, text)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                print(f"mgpu worker: cannot write {path}: {exc.strerror or exc}; training goes on without "
                      "its progress file (free space there, or check the folder)", file=sys.stderr, flush=True)


def format_epoch_line(epoch: int, epochs: int, logs: Mapping[str, object], samples_per_sec: float | None) -> str:
    """`epoch 3/5 loss=0.12 accuracy=0.97 val_accuracy=0.95 samples/s=1234` (4 digits)."""
    parts = [f"epoch {epoch}/{epochs}"]
    for name, value in logs.items():
        shown = number(value)
        parts.append(f"{name}={shown:.4g}" if shown is not None else f"{name}=nan")
    if samples_per_sec is not None:
        parts.append(f"samples/s={samples_per_sec:.0f}")
    return " ".join(parts)
