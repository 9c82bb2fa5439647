"""progress.json: the task's heartbeat and training progress, rewritten atomically.

`ProgressWriter` is plain Python (the launcher's side may read the file with
`read_progress`); `ProgressCallback` is the Keras callback that feeds it, created on first
use so that importing this module does not import TensorFlow (`callback_class(keras)`: the same on Keras 3).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

from worker.errors import SettingError
from worker.protocol import FILE_MAX_BYTES, ProgressState, json_object
from worker.host import layout
from worker.host.files import write_private
from worker.host.modules import remember

FILENAME = layout.PROGRESS
STATES = tuple(str(state) for state in ProgressState)
DEFAULT_INTERVAL_S = 0.25  # a few writes per supervisor read (1 s): what it reads is recent, not the step after a pause
RATE_STEPS = 16  # samples/s is over the last this many timed steps, across epoch ends (validation not counted)
# progress.json keeps the summaries of this many finished epochs: the supervisor reads it about once a second, so
# an epoch shorter than that still reaches the run's history
EPOCH_ENDS_KEPT = 8


def _number(value: Any) -> float | None:
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


def read_progress(path: str) -> dict | None:
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
    text = os.environ.get("MGPU_PROGRESS_INTERVAL", "").strip() or str(DEFAULT_INTERVAL_S)
    value = _number(text)
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
            "first_global_step": 0, "loss": None, "metrics": {}, "samples_per_sec": None,
            "time": time.time(), "pid": os.getpid(), "epoch_ends": [],
        }
        self._last_write = 0.0
        self._epoch_ended = False  # an epoch's summary not written yet

    def epoch_end(self, epoch: int, start: float | None, samples_per_sec: float | None, loss: float | None,
                  metrics: dict) -> None:
        """Keeps a finished epoch's own rate (its epoch line's samples/s), loss and metrics, with when it was
        measured (`start` to now), among the last EPOCH_ENDS_KEPT; the next update writes it, due or not."""
        end = {"epoch": int(epoch), "start": start, "end": time.time(), "samples_per_sec": samples_per_sec,
               "loss": loss, "metrics": dict(metrics)}
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
            self._write(json.dumps(_finite(self.fields), indent=1, allow_nan=False) + "\n")
        return True

    def _write(self, text: str) -> None:
        """One atomic write, in its folder made again if it was deleted; a write that fails (a full disk) never
        ends the training: it goes on without progress.json, said once on stderr."""
        try:
            if not self.path.parent.is_dir():
                self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_private(self.path, text)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                print(f"mgpu worker: cannot write {self.path}: {exc.strerror or exc}; training goes on without "
                      "its progress file (free space there, or check the folder)", file=sys.stderr, flush=True)


def format_epoch_line(epoch: int, epochs: int, logs: dict, samples_per_sec: float | None) -> str:
    """`epoch 3/5 loss=0.12 accuracy=0.97 val_accuracy=0.95 samples/s=1234` (4 digits)."""
    parts = [f"epoch {epoch}/{epochs}"]
    for name, value in logs.items():
        number = _number(value)
        parts.append(f"{name}={number:.4g}" if number is not None else f"{name}=nan")
    if samples_per_sec is not None:
        parts.append(f"samples/s={samples_per_sec:.0f}")
    return " ".join(parts)


def _say(line: str) -> None:
    print(line, file=sys.stdout, flush=True)


def callback_class(keras=None):
    """A new ProgressCallback class on `keras`'s Callback: tf_keras by default (`ProgressCallback`, made once),
    Keras 3 for the jax runner."""
    if keras is None:
        from worker.strategy import import_keras

        keras = import_keras()

    class ProgressCallback(keras.callbacks.Callback):
        """Keras callback: progress.json (throttled on batches, always on epochs) + epoch lines.

        run_dir: where progress.json goes (default MGPU_RUN_DIR; None/unset -> no file);
        or `writer`: a ProgressWriter to feed (task and interval are then the writer's).
        global_batch_size: samples per step over all replicas, for samples/s.
        mark_done_on_train_end: write state "done" at the end of fit; the runner passes False
        and calls `mark_done()` itself once the model is saved.
        clock: a worker.steptime.StepClock (its callback() first in fit's list): each window's
        compute_ms and wait_ms per step go out too.
        """

        def __init__(self, run_dir: str | None = "", *, writer: ProgressWriter | None = None,
                     task: int | None = None,
                     epochs: int | None = None, steps_per_epoch: int | None = None,
                     global_batch_size: int | None = None, interval: float | None = None,
                     mark_done_on_train_end: bool = True,
                     log: Callable[[str], None] | None = _say, clock=None):
            super().__init__()
            if writer is None:
                if run_dir == "":
                    run_dir = os.environ.get("MGPU_RUN_DIR") or None
                if task is None:
                    from worker.strategy import task_id_from_env

                    task = task_id_from_env()
                writer = ProgressWriter(run_dir, task=task, interval=interval)
            self.writer = writer
            if epochs:
                writer.fields["epochs"] = int(epochs)
            if steps_per_epoch:
                writer.fields["steps_per_epoch"] = int(steps_per_epoch)
            self.last_epoch_end: float | None = None  # time.time() of the last epoch end
            self.global_batch_size = global_batch_size
            self.mark_done_on_train_end = mark_done_on_train_end
            self.log = log
            self.clock = clock
            self._supports_tf_logs = True  # logs stay tensors; converted only when written
            self._first_epoch: int | None = None
            self._first_batch_seen = False
            self._epoch = 0
            self._step = 0
            self._rate_start: tuple[float, int] | None = None  # the epoch's first finished step: its epoch line
            self._began, self._traced = None, False  # when this batch began; fit's first (it traces) is not timed
            self._recent: deque[tuple[float, int]] = deque(maxlen=RATE_STEPS)  # (seconds, steps) of recent batches

        # --- helpers -------------------------------------------------------------------
        def _steps(self) -> int | None:
            return self.writer.fields["steps_per_epoch"] or self.params.get("steps")

        def _global_step(self) -> int:
            steps = self._steps()
            return (self._epoch - 1) * steps + self._step if steps else self._step

        def _recent_rate(self) -> float | None:
            """Samples/s over the last RATE_STEPS batches, each begin to end (not blank at an epoch's start)."""
            seconds = sum(s for s, _ in self._recent)
            if not self.global_batch_size or seconds <= 0:
                return None
            return sum(n for _, n in self._recent) * self.global_batch_size / seconds

        def _samples_per_sec(self) -> float | None:
            """Samples/s since the epoch's first finished step (the epoch line)."""
            if not self.global_batch_size or self._rate_start is None:
                return None
            start, step0 = self._rate_start
            elapsed = time.time() - start
            if self._step <= step0 or elapsed <= 0:
                return None
            return (self._step - step0) * self.global_batch_size / elapsed

        @staticmethod
        def _split(logs: dict | None) -> tuple[float | None, dict]:
            logs = dict(logs or {})
            loss = _number(logs.pop("loss", None))
            return loss, {name: _number(value) for name, value in logs.items()}

        def mark_done(self) -> None:
            self.writer.update(force=True, state=str(ProgressState.DONE))

        def mark_preempted(self) -> None:
            """After the checkpoint on notice: the last finished step, state "preempted"."""
            self.writer.update(force=True, state=str(ProgressState.PREEMPTED), step=self._step,
                               global_step=self._global_step())

        # --- Keras hooks ---------------------------------------------------------------
        def on_train_begin(self, logs=None):
            epochs = self.writer.fields["epochs"] or self.params.get("epochs") or 0
            self.writer.update(force=True, state=str(ProgressState.TRAINING), epochs=epochs,
                               steps_per_epoch=self._steps())

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch, self._step, self._rate_start = epoch + 1, 0, None
            first = self._first_epoch is None
            if first:
                self._first_epoch = epoch + 1
                self.writer.fields["first_global_step"] = self._global_step()
            # forced once: each write puts off the next, and a short epoch would then show step 0 most of the time
            self.writer.update(force=first, state=str(ProgressState.TRAINING), epoch=self._epoch, step=0,
                               first_epoch=self._first_epoch, global_step=self._global_step())

        def on_train_batch_begin(self, batch, logs=None):
            self._began = time.time()
            if self._first_batch_seen:
                return
            # fit resumes a backup mid-epoch (BackupAndRestore with save_freq=N) by starting
            # the epoch at this batch; only here does a callback learn where.
            batch = int(batch)  # a numpy integer when fit resumed mid-epoch
            self._first_batch_seen, self._step = True, batch
            if self._epoch > 1 or batch > 0:
                if self.log:
                    self.log(f"resuming at epoch {self._epoch}"
                             + (f" step {batch + 1}" if batch else ""))
                self.writer.update(force=True, step=batch, global_step=self._global_step(),
                                   first_global_step=self._global_step())

        def on_train_batch_end(self, batch, logs=None):
            now, done = time.time(), int(batch) + 1
            if "first_step_at" not in self.writer.fields:  # this attempt's first step: its start-up ends here
                self.writer.fields["first_step_at"] = now
                remember(self.writer.path and str(self.writer.path.parent))
            if self._rate_start is None:  # rate from the first finished step (no tracing time)
                self._rate_start = (now, done)
            if self._traced and self._began is not None and done > self._step:
                self._recent.append((now - self._began, done - self._step))
            self._step, self._began, self._traced = done, None, True
            if not self.writer.due():
                return
            loss, metrics = self._split(logs)
            metrics = {**self.writer.fields["metrics"], **metrics}
            self._step_split()
            self.writer.update(step=self._step, global_step=self._global_step(), loss=loss,
                               metrics=metrics, samples_per_sec=self._recent_rate())

        def _step_split(self) -> None:
            if self.clock is not None:
                compute_ms, wait_ms = self.clock.window()
                self.writer.fields.update(compute_ms=compute_ms, wait_ms=wait_ms)

        def on_test_batch_end(self, batch, logs=None):
            self.writer.update()  # validation is progress too: keep the heartbeat going

        def on_epoch_end(self, epoch, logs=None):
            rate = self._samples_per_sec()
            loss, metrics = self._split(logs)
            steps = self._steps()
            if steps:
                self._step = steps
            self._step_split()
            self.writer.epoch_end(epoch + 1, self._rate_start[0] if self._rate_start else None, rate, loss, metrics)
            self.writer.update(epoch=epoch + 1, step=self._step, global_step=self._global_step(), loss=loss,
                               metrics=metrics, samples_per_sec=self._recent_rate())
            if self.log:
                shown = {"loss": loss, **metrics} if loss is not None else metrics
                self.log(format_epoch_line(epoch + 1, self.writer.fields["epochs"], shown, rate))
            self.last_epoch_end = time.time()

        def on_train_end(self, logs=None):
            if self.mark_done_on_train_end:
                self.writer.update(force=True, state=str(ProgressState.DONE))
            else:
                self.writer.update(force=True)

    return ProgressCallback


def __getattr__(name: str):
    if name == "ProgressCallback":
        cls = callback_class()
        globals()["ProgressCallback"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
