"""Checkpoints of the built-in runner: BackupAndRestore that resumes mid-epoch, the notice (SIGTERM) that
makes every worker save at one agreed step and stop (`Preempted`), and the end of a run's training, told in
the checkpoint folder (both backends), so that a crash after the last step never trains the run again."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
from typing import Callable

from worker import startpoint
from worker.data import counts_over_workers
from worker.entrypoint import WorkerError
from worker.host.env import RUN_ID, SPARE_BACKUP, TASK_INDEX
from worker.startpoint import FINISHED, SPARES, Found, Refused, StartPoint
from worker.lines import say


class Preempted(Exception):
    """Every worker saved a checkpoint at the same step after a notice; exit EXIT_PREEMPTED."""


notice = threading.Event()  # set by SIGTERM


@contextlib.contextmanager
def notice_held():
    """Inside, SIGTERM waits (blocked); afterwards it is a notice (see `checkpoint_callbacks`).

    TensorFlow's coordination agent installs a SIGTERM handler that drops the signal, in place
    while the strategy waits for its peers. Blocked, a notice stays pending until our handler
    has replaced TensorFlow's; TensorFlow's threads, started inside, inherit the mask and never
    take the signal. Outside the main thread (which alone can set handlers) this does nothing.
    """
    main = threading.current_thread() is threading.main_thread()
    if main:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGTERM, lambda signum, frame: notice.set())
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


TF_BACKUP = startpoint.BACKUPS[0]  # tf_keras's backup folder in the checkpoint folder (the chief's, which all read)
NOTHING_LEFT = "this run's training finished in an earlier attempt (every task saved): nothing left to train"


def run_id() -> str:
    """The launcher's id of this run ("" for a worker started by hand): a restart keeps it, a new run has its own."""
    return os.environ.get(RUN_ID, "")


def keeps_backup() -> bool:
    """Whether the backup outlives fit: under a launcher's run, until every task has saved after the last step
    (`tell_finished`), so that a crash in fit's end, the saves or the exit resumes there instead of at epoch 1.
    A worker started by hand has no restart to resume: BackupAndRestore removes its backup at fit's end."""
    return bool(run_id())


def finished_here(checkpoint_dir: str) -> bool:
    """Whether this run's training ended in an earlier attempt (the file is untrusted: anything else is no)."""
    if not run_id():
        return False
    try:
        with open(os.path.join(checkpoint_dir, FINISHED), encoding="utf-8") as f:
            said = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(said, dict) and said.get("run") == run_id()


def finished_agreed(seen: list[int], checkpoint_dir: str) -> bool:
    """Every task's `finished_here`, in task order, as one answer: all or none (else a WorkerError, as for a
    backup only some tasks see: they would not agree on what to train)."""
    if 0 < sum(seen) < len(seen):
        raise WorkerError(f"task(s) {[i for i, flag in enumerate(seen) if flag]} found this run's training "
                          f"finished, task(s) {[i for i, flag in enumerate(seen) if not flag]} did not "
                          f"(checkpoint dir here: {checkpoint_dir}): put --checkpoint-dir on storage that every "
                          "host shares")
    return bool(seen) and all(seen)


def tell_finished(barrier: Callable[[], object], chief: bool, checkpoint_dir: str, backup_dir: str) -> None:
    """After the saves, under a launcher's run (`keeps_backup`): once every task has saved (`barrier`, a
    collective), the chief tells the run's training finished (whole, by a rename) and then removes the backup.
    A crash before the first resumes after the last step: nothing to train. A file that cannot be written (a
    full disk) leaves the backup, and the training's end stands."""
    if not keeps_backup():
        return
    barrier()
    if not chief:
        spare = spare_folder(checkpoint_dir)
        if spare:  # the training is over: nothing is left to go on from
            shutil.rmtree(spare, ignore_errors=True)
        return
    path = os.path.join(checkpoint_dir, FINISHED)
    try:
        os.makedirs(checkpoint_dir, exist_ok=True)
        with open(f"{path}.partial", "w", encoding="utf-8") as f:
            json.dump({"run": run_id()}, f)
        os.replace(f"{path}.partial", path)
    except OSError as exc:
        say(f"note: cannot write {path} ({exc.strerror or exc}): the backup stays, so a restart of this run "
             "resumes after its last step")
        return
    shutil.rmtree(backup_dir, ignore_errors=True)
    with contextlib.suppress(OSError):  # finished.json names the run now; no backup is left to own
        os.remove(os.path.join(checkpoint_dir, startpoint.OWNER))


def start_agreed(tf, strategy, checkpoint_dir: str, num_workers: int) -> bool:
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


def start_point(found: Found, epochs: int, resume_run: str | None) -> StartPoint:
    """Where this run starts from what its checkpoint folder held before the tasks agreed (`found`, read before
    the chief claims the folder): its own backup (a restart), the backup of the run it was asked to go on from
    (--resume-run), else fresh; another run's backup or finished training, or nothing left to train: refused.
    A worker started by hand (no run id) takes whatever backup is there, as BackupAndRestore does."""
    if not run_id():
        return StartPoint()
    try:
        return startpoint.decide(found, run_id(), resume_run, epochs)
    except Refused as exc:
        raise WorkerError(str(exc)) from None


def claim(checkpoint_dir: str, start: StartPoint, chief: bool) -> None:
    """The chief writes the owner file (this run, where it starts) before any backup of its own exists, so that a
    restart of this run finds its backup claimed; each backup then moves it on (`backed_up`)."""
    if chief and run_id():
        startpoint.write_owner(checkpoint_dir, StartPoint(run_id(), start.epoch, start.step, start.steps_done))


def owner_after(epochs_done: int, step_in_epoch: int, steps: int) -> StartPoint:
    """Where a backup resumes: `step_in_epoch` steps of the epoch after `epochs_done` finished epochs are done (a
    finished epoch resumes at the next one's step 1)."""
    if step_in_epoch >= steps:
        epochs_done, step_in_epoch = epochs_done + 1, 0
    return StartPoint(run_id(), epochs_done + 1, step_in_epoch + 1, epochs_done * steps + step_in_epoch)


def backed_up(checkpoint_dir: str, epochs_done: int, step_in_epoch: int, steps: int) -> None:
    """After the chief's backup: the owner file says where it resumes (`owner_after`)."""
    if run_id():
        startpoint.write_owner(checkpoint_dir, owner_after(epochs_done, step_in_epoch, steps))


def spare_folder(checkpoint_dir: str) -> str | None:
    """Where this task keeps its spare copy of each backup (the launcher asks the first task of each host other
    than the chief's: worker.host.env.keeps_spare), None where it keeps none."""
    index = os.environ.get(TASK_INDEX, "")
    if os.environ.get(SPARE_BACKUP) != "1" or not run_id() or not index.isdigit():
        return None
    return os.path.join(checkpoint_dir, SPARES, index)


_spare_failed: list[str] = []  # said once a run


def keep_spare(spare: str, fill: Callable[[str], None], point: StartPoint) -> None:
    """The spare copy replaced by the backup that `fill(folder)` puts into a new folder, with its owner file: whole
    or absent (a rename; one kept from before is removed first). It is a spare: a failure to keep it (a full disk)
    is said once and never stops the training."""
    stage, old = f"{spare}.new", f"{spare}.old"
    try:
        shutil.rmtree(stage, ignore_errors=True)
        os.makedirs(stage)
        fill(stage)
        startpoint.write_owner(stage, point)
        if not os.path.isfile(os.path.join(stage, startpoint.OWNER)):
            raise OSError("its owner file could not be written")
        shutil.rmtree(old, ignore_errors=True)
        if os.path.lexists(spare):
            os.replace(spare, old)
        os.replace(stage, spare)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(stage, ignore_errors=True)
        if not _spare_failed:
            _spare_failed.append(spare)
            say(f"note: cannot keep a spare copy of the backup in {spare} ({exc.strerror or exc}): a restart whose "
                "chief's host is gone cannot go on from this host")


NOTICE_KEY = "mgpu/preempt/step"  # in TensorFlow's coordination service: insert-only
DONE = "done"
ACK_TIMEOUT_MS = 60_000


def checkpoint_callbacks(keras, tf, checkpoint_dir: str, steps: int, every: int | None,
                         info, on_notice: Callable[[], None] = lambda: None) -> list:
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

    class Backup(keras.callbacks.BackupAndRestore):
        def __init__(self):
            super().__init__(backup_dir=checkpoint_dir, save_freq=every or steps,
                             delete_checkpoint=not keeps_backup())
            self.target: int | None = None  # the global step to save at and stop
            self.stopped_at: int | None = None
            self._claimed = self._noticed = False
            self._watcher: threading.Thread | None = None

        def on_train_begin(self, logs=None):
            super().on_train_begin(logs)
            if info.multi_worker:
                self._watcher = threading.Thread(target=self._watch, daemon=True,
                                                 name="mgpu-notice-watcher")
                self._watcher.start()

        def _watch(self):
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

        def on_train_batch_end(self, batch, logs=None):
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

        def _backup(self, epoch, batch=0):
            manager = self._training_state.write_checkpoint_manager
            if spare is None or info.is_chief:
                super()._backup(epoch=epoch, batch=batch)
            elif manager.save():  # collective, as tf_keras's own back_up, which removes this copy: kept instead
                keep_spare(spare, lambda stage: os.replace(manager.directory, os.path.join(stage, TF_BACKUP)),
                           owner_after(int(epoch), int(batch) + 1, steps))
            if info.is_chief:
                backed_up(checkpoint_dir, int(epoch), int(batch) + 1, steps)

        def on_train_end(self, logs=None):
            super().on_train_end(logs)
            if self._watcher is not None:
                try:
                    context.context().set_config_key_value(NOTICE_KEY, DONE)
                except tf.errors.AlreadyExistsError:
                    pass
                self._watcher.join(5)

    backup = Backup()

    def stop(batch, logs):
        if backup.stopped_at is not None:
            raise Preempted(f"saved a checkpoint at global step {backup.stopped_at} on notice")

    return [backup, keras.callbacks.LambdaCallback(on_train_batch_end=stop)]


