"""The Keras callback that feeds progress.json (worker.training.progress) and prints each epoch's line, created on first use
so that importing this module does not import TensorFlow (`callback_class(keras)`: the same on Keras 3)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

from worker.host import env
from worker.host.modules import remember
from worker.training.progress import ProgressWriter, number, format_epoch_line, training_rate
from worker.host.protocol import ProgressState
from worker.training.lines import say

if TYPE_CHECKING:
    from worker.tensorflow.steptime import StepClock


class ProgressCallbackLike(Protocol):
    """A ProgressCallback as the runners use it (its class is made at run time, on Keras' Callback)."""

    writer: ProgressWriter
    last_epoch_end: float | None

    def stopwatch(self) -> Any: ...  # Any: a Keras callback (tf_keras and keras have no types)

    def mark_done(self) -> None: ...

    def mark_preempted(self) -> None: ...


# Any: the Keras module (tf_keras or keras, without types), and the logs and model it hands the hooks
def callback_class(keras: Any = None) -> Callable[..., ProgressCallbackLike]:
    """A new ProgressCallback class on `keras`'s Callback: tf_keras by default (`ProgressCallback`, made once),
    Keras 3 for the jax runner."""
    if keras is None:
        from worker.tensorflow.strategy import import_keras

        keras = import_keras()

    class ProgressCallback(keras.callbacks.Callback):  # type: ignore[misc]  # Keras' Callback has no types
        """Keras callback: progress.json (throttled on batches, always on epochs) + epoch lines.

        run_dir: where progress.json goes (default MGPU_RUN_DIR; None/unset -> no file);
        or `writer`: a ProgressWriter to feed (task and interval are then the writer's).
        global_batch_size: samples per step over all replicas, for samples/s.
        mark_done_on_train_end: write state "done" at the end of fit; the runner passes False
        and calls `mark_done()` itself once the model is saved.
        clock: a worker.tensorflow.steptime.StepClock (its callback() first in fit's list): each window's
        compute_ms and wait_ms per step go out too.
        """

        def __init__(self, run_dir: str | None = "", *, writer: ProgressWriter | None = None,
                     task: int | None = None,
                     epochs: int | None = None, steps_per_epoch: int | None = None,
                     global_batch_size: int | None = None, interval: float | None = None,
                     mark_done_on_train_end: bool = True,
                     log: Callable[[str], None] | None = say, clock: StepClock | None = None) -> None:
            super().__init__()
            if writer is None:
                if run_dir == "":
                    run_dir = os.environ.get(env.RUN_DIR) or None
                if task is None:
                    from worker.tensorflow.strategy import task_id_from_env

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
            self._epoch_start: float | None = None  # when the epoch's first step ended (its summary's start)
            # this batch; fit's first (it traces) is untimed
            self._began: float | None = None
            self._ended: float | None = None
            self._traced = False
            self._workers: int | None = None  # copies of each batch log that fit adds up (_summed_over)

        # --- helpers -------------------------------------------------------------------
        def _steps(self) -> int | None:
            steps: int | None = self.writer.fields["steps_per_epoch"] or self.params.get("steps")
            return steps

        def _global_step(self) -> int:
            steps = self._steps()
            return (self._epoch - 1) * steps + self._step if steps else self._step

        def stopwatch(self) -> Any:
            """A callback to put before fit's other callbacks (a backup's save): it ends each batch's timing, so
            what they do after a step is not training time."""
            outer = self

            class Stopwatch(keras.callbacks.Callback):  # type: ignore[misc]  # Keras' Callback has no types
                def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
                    outer._ended = time.time()

            return Stopwatch()

        def _batch_logs(self, logs: dict[str, Any] | None) -> dict[str, Any]:
            """A batch's logs as the epoch's: means over every replica's batches so far (see _summed_over); the
            epoch's logs are the metrics' own results and need nothing."""
            if self._workers is None:
                self._workers = _summed_over(self.model)
            if self._workers == 1:
                return dict(logs or {})
            return {name: value if (mean := number(value)) is None else mean / self._workers
                    for name, value in (logs or {}).items()}

        @staticmethod
        def _split(logs: dict[str, Any] | None) -> tuple[float | None, dict[str, float | None]]:
            logs = dict(logs or {})
            loss = number(logs.pop("loss", None))
            return loss, {name: number(value) for name, value in logs.items()}

        def mark_done(self) -> None:
            self.writer.update(force=True, state=str(ProgressState.DONE))

        def mark_preempted(self) -> None:
            """After the checkpoint on notice: the last finished step, state "preempted"."""
            self.writer.update(force=True, state=str(ProgressState.PREEMPTED), step=self._step,
                               global_step=self._global_step())

        # --- Keras hooks ---------------------------------------------------------------
        def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
            epochs = self.writer.fields["epochs"] or self.params.get("epochs") or 0
            self.writer.update(force=True, state=str(ProgressState.TRAINING), epochs=epochs,
                               steps_per_epoch=self._steps())

        def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
            self._epoch, self._step, self._epoch_start = epoch + 1, 0, None
            first = self._first_epoch is None
            if first:
                self._first_epoch = epoch + 1
                self.writer.fields["first_global_step"] = self._global_step()
            # forced once: each write puts off the next, and a short epoch would then show step 0 most of the time;
            # samples/s stays the last epoch's until this one has a timed step
            self.writer.update(force=first, state=str(ProgressState.TRAINING), epoch=self._epoch, step=0,
                               first_epoch=self._first_epoch, global_step=self._global_step(), epoch_samples=0,
                               epoch_train_s=0.0)

        def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            self._began, self._ended = time.time(), None
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

        def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            now, done = time.time(), int(batch) + 1
            end = self._ended if self._ended is not None else now
            fields = self.writer.fields
            if "first_step_at" not in fields:  # this attempt's first step: its start-up ends here
                fields["first_step_at"] = now
                remember(str(self.writer.path.parent) if self.writer.path else None)
            if self._epoch_start is None:
                self._epoch_start = now
            if self._traced and self._began is not None and done > self._step and self.global_batch_size:
                fields["epoch_samples"] += (done - self._step) * self.global_batch_size
                fields["epoch_train_s"] += max(end - self._began, 0.0)
                fields["samples_per_sec"] = training_rate(fields["epoch_samples"], fields["epoch_train_s"])
            self._step, self._began, self._ended, self._traced = done, None, None, True
            if not self.writer.due():
                return
            loss, metrics = self._split(self._batch_logs(logs))
            metrics = {**fields["metrics"], **metrics}
            self._step_split()
            self.writer.update(step=self._step, global_step=self._global_step(), loss=loss, metrics=metrics)

        def _step_split(self) -> None:
            if self.clock is not None:
                compute_ms, wait_ms = self.clock.window()
                self.writer.fields.update(compute_ms=compute_ms, wait_ms=wait_ms)

        def on_test_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            self.writer.update()  # validation is progress too: keep the heartbeat going

        def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
            loss, metrics = self._split(logs)
            steps = self._steps()
            if steps:
                self._step = steps
            self._step_split()
            self.writer.epoch_end(epoch + 1, self._epoch_start, loss, metrics)
            rate = self.writer.fields["epoch_ends"][-1]["samples_per_sec"]
            self.writer.update(epoch=epoch + 1, step=self._step, global_step=self._global_step(), loss=loss,
                               metrics=metrics)
            if self.log:
                shown = {"loss": loss, **metrics} if loss is not None else metrics
                self.log(format_epoch_line(epoch + 1, self.writer.fields["epochs"], shown, rate))
            self.last_epoch_end = time.time()

        def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
            if self.mark_done_on_train_end:
                self.writer.update(force=True, state=str(ProgressState.DONE))
            else:
                self.writer.update(force=True)

    return ProgressCallback


def _summed_over(model: Any) -> int:
    """How many copies of each batch log fit adds up: tf_keras' metrics are all-reduced over every replica already
    (a loss or accuracy the group's mean, a count the group's count), but under MultiWorkerMirroredStrategy with
    several workers its fit reduces them once more with `distribute_reduction_method` "auto" ("sum" off TPUs),
    adding each worker's copy: the number of workers. 1 elsewhere (one worker, Keras 3 on JAX)."""
    method = getattr(model, "distribute_reduction_method", None)
    strategy: Any = getattr(model, "distribute_strategy", None)  # a tf.distribute strategy, or None
    replicas = int(getattr(strategy, "num_replicas_in_sync", 1) or 1)
    if method not in ("auto", "sum") or replicas == 1 or (method == "auto" and "TPU" in type(strategy).__name__):
        return 1
    return max(replicas // (len(strategy.extended.worker_devices) or 1), 1)


def __getattr__(name: str) -> Callable[..., ProgressCallbackLike]:
    if name == "ProgressCallback":
        cls = callback_class()
        globals()["ProgressCallback"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
