"""Checkpoints on TensorFlow: tf-keras's BackupAndRestore that resumes mid-epoch (every task restores the
chief's backup; a task that keeps a spare copy keeps the copy tf-keras would throw away), the notice (SIGTERM)
that makes every worker save at one agreed step and stop, and the start every worker agrees on."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Callable

from worker.host import startpoint
from worker.tensorflow.data import counts_over_workers
from worker.training.checkpoints import (Preempted, backed_up, finished_agreed, finished_here, keep_spare,
                                         keeps_backup, notice, owner_after, spare_folder)
from worker.training.entrypoint import WorkerError
from worker.training.lines import say

if TYPE_CHECKING:
    from worker.tensorflow.strategy import ClusterInfo

TF_BACKUP = startpoint.BACKUPS[0]  # tf_keras's backup folder in the checkpoint folder (the chief's, which all read)


# Any (here and below): TensorFlow's and tf_keras' modules and objects, which have no types
def start_agreed(tf: Any, strategy: Any, checkpoint_dir: str, num_workers: int) -> bool:
    """Whether this run's training finished in an earlier attempt: what every worker sees of the checkpoint
    folder, in one collective. Every worker restores from the chief's backup (tf_keras reads `<dir>/TF_BACKUP`);
    a worker that cannot see it would start from epoch 1 while the others resume: refused (all workers
    together) instead of training diverged replicas, as where only some see the run finished."""
    has_backup = tf.train.latest_checkpoint(os.path.join(checkpoint_dir, TF_BACKUP)) is not None
    seen = counts_over_workers(tf, strategy, int(has_backup) + 2 * int(finished_here(checkpoint_dir)), num_workers)
    backups = [v & 1 for v in seen]
    if 0 < sum(backups) < num_workers:
        have = [i for i, flag in enumerate(backups) if flag]
        missing = [i for i, flag in enumerate(backups) if not flag]
        raise WorkerError(f"task(s) {have} found a backup to resume from, task(s) {missing} did "
                          f"not (checkpoint dir here: {checkpoint_dir}): put --checkpoint-dir on "
                          "storage that every host shares, or delete the backup to start over")
    return finished_agreed([v >> 1 for v in seen], checkpoint_dir)


NOTICE_KEY = "mgpu/preempt/step"  # in TensorFlow's coordination service: insert-only
DONE = "done"
ACK_TIMEOUT_MS = 60_000


def checkpoint_callbacks(keras: Any, tf: Any, checkpoint_dir: str, steps: int, every: int | None,
                         info: ClusterInfo, on_notice: Callable[[], object] = lambda: None) -> list[Any]:
    """[backup, stopper]: the first and the last callback of `fit`.

    The backup is BackupAndRestore with save_freq an int, so that fit resumes mid-epoch. It
    saves at each epoch's last step, at every global step that `every` divides, and on notice
    (SIGTERM) at one step agreed by all workers: the worker that got the notice claims
    "my step + 1" in the coordination service and waits until every worker's watcher thread
    has read it. Workers are at most one step apart (each step all-reduces), so no worker has
    passed that step, and all save there (a save is collective: one alone would hang). The
    stopper then raises Preempted, after every other callback has seen that step.
    """
    from tensorflow.python.eager import context  # the key-value store has no public API

    spare = spare_folder(checkpoint_dir)

    class Backup(keras.callbacks.BackupAndRestore):  # type: ignore[misc]  # tf_keras has no types
        def __init__(self) -> None:
            super().__init__(backup_dir=checkpoint_dir, save_freq=every or steps,
                             delete_checkpoint=not keeps_backup())
            self.target: int | None = None  # the global step to save at and stop
            self.stopped_at: int | None = None
            self._claimed = self._noticed = False
            self._watcher: threading.Thread | None = None

        def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
            super().on_train_begin(logs)
            if info.multi_worker:
                self._watcher = threading.Thread(target=self._watch, daemon=True,
                                                 name="mgpu-notice-watcher")
                self._watcher.start()

        def _watch(self) -> None:
            try:
                value = context.context().get_config_key_value(NOTICE_KEY)  # blocks
                if value != DONE:
                    self.target = int(value)
                    context.context().set_config_key_value(f"{NOTICE_KEY}/ack/{info.task_id}",
                                                           "1")
            except Exception as exc:  # noqa: BLE001 (the cluster is going away)
                say(f"notice watcher stopped: {exc}")

        def _claim(self, step: int) -> None:
            if not info.multi_worker:
                self.target = step
                return
            ctx = context.context()
            try:
                ctx.set_config_key_value(NOTICE_KEY, str(step + 1))
            except tf.errors.AlreadyExistsError:
                return  # another worker was first: its step stands, the watcher reads it
            for i in range(info.num_workers):
                ctx.get_config_key_value(f"{NOTICE_KEY}/ack/{i}", ACK_TIMEOUT_MS)

        def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            step = int(self._current_epoch * steps + batch + 1)
            if (notice.is_set() or self.target is not None) and not self._noticed:
                self._noticed = True
                on_notice()  # progress.json says "preempting": the supervisor's preempt_grace runs
                if not notice.is_set():  # (the supervisor reads progress.json when a line comes)
                    say(f"notice from another worker: saving with every worker at global step {self.target}")
            if notice.is_set() and not self._claimed:
                self._claimed = True
                say(f"notice (SIGTERM) at global step {step}: saving with every worker")
                self._claim(step)
            if self.target is not None and step >= self.target:
                self._backup(epoch=self._current_epoch, batch=batch)
                self.stopped_at = step
            elif batch + 1 == steps or (every and step % every == 0):
                self._backup(epoch=self._current_epoch, batch=batch)

        def _backup(self, epoch: int, batch: int = 0) -> None:
            manager = self._training_state.write_checkpoint_manager
            if spare is None or info.is_chief:
                super()._backup(epoch=epoch, batch=batch)
            elif manager.save():  # collective, as tf_keras's own back_up, which removes this copy: kept instead
                keep_spare(spare, lambda stage: os.replace(manager.directory, os.path.join(stage, TF_BACKUP)),
                           owner_after(int(epoch), int(batch) + 1, steps))
            if info.is_chief:
                backed_up(checkpoint_dir, int(epoch), int(batch) + 1, steps)

        def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
            super().on_train_end(logs)
            if self._watcher is not None:
                try:
                    context.context().set_config_key_value(NOTICE_KEY, DONE)
                except tf.errors.AlreadyExistsError:
                    pass
                self._watcher.join(5)

    backup = Backup()

    def stop(batch: int, logs: dict[str, Any] | None) -> None:
        if backup.stopped_at is not None:
            raise Preempted(f"saved a checkpoint at global step {backup.stopped_at} on notice")

    return [backup, keras.callbacks.LambdaCallback(on_train_batch_end=stop)]
