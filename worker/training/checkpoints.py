"""The checkpoint folder's rules on either backend (each backend's own backup is worker.tensorflow.checkpoints or
worker.keras3.checkpoints): where a run starts and who owns the folder, the notice (SIGTERM) that stops every
task after one save (`Preempted`), the spare copy a task keeps on a host other than the chief's, and the end of a
run's training, told in the folder, so that a crash after the last step never trains the run again."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
from typing import Callable, Iterator

from worker.host import startpoint
from worker.training.entrypoint import WorkerError
from worker.host.env import RUN_ID, SPARE_BACKUP, TASK_INDEX
from worker.host.startpoint import FINISHED, SPARES, Found, Refused, StartPoint
from worker.training.lines import say


class Preempted(Exception):
    """Every worker saved a checkpoint at the same step after a notice; exit EXIT_PREEMPTED."""


notice = threading.Event()  # set by SIGTERM


@contextlib.contextmanager
def notice_held() -> Iterator[None]:
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
