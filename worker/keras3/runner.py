"""The built-in runner on Keras 3 with JAX: entrypoint -> group, data shares, model, fit, progress, save.

The same `RunConfig` and `Task` as the TensorFlow runner (worker.training.config); what differs: the Task's data builders
return NumPy arrays, checkpoints are per epoch, and TensorFlow-only settings are said and left out.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import time
from typing import Any, Iterator

from worker.training import checkpoints
from worker.training.checkpoints import (Preempted, claim, finished_agreed, finished_here, notice_held, start_point,
                                tell_finished)
from worker.host import env
from worker.training.entrypoint import Task, WorkerError, first_set, load_entrypoint, resolve_entrypoint
from worker.keras3.checkpoints import BACKUP, checkpoint_callbacks
from worker.keras3.data import Feed, feeds
from worker.keras3.group import Group, alone, join, split_host, task_index
from worker.training.progress import ProgressWriter
from worker.training.keras_progress import ProgressCallbackLike, callback_class
from worker.host.protocol import ProgressState
from worker.host.startpoint import look
from worker.training.config import RunConfig, folders, settings
from worker.training.ending import Summary, finish, nothing_left, save_model
from worker.training.optimizer import build_optimizer, learning_rate_for
from worker.training.lines import say


def import_keras3() -> Any:
    """Keras 3 on the jax backend, or an ImportError/WorkerError that says how to get it."""
    try:
        import keras
    except ImportError as exc:
        raise ImportError(f"cannot import keras ({exc}): pip install 'mgpu-cluster[jax]'") from exc
    if not hasattr(keras, "distribution") or keras.backend.backend() != "jax":
        raise WorkerError(f"keras {keras.__version__} on the {keras.backend.backend()} backend: the jax runner "
                          "needs Keras 3 with KERAS_BACKEND=jax (pip install 'mgpu-cluster[jax]')")
    return keras


@contextlib.contextmanager
def tensorflow_hidden() -> Iterator[None]:
    """Keras' seeding (`set_random_seed`, and `distribution.initialize` through it) seeds TensorFlow too where it
    is installed, importing it: seconds and hundreds of MB for nothing, as the data are NumPy arrays. Inside, an
    import of tensorflow fails and Keras takes it as missing (for the process); not where it is imported already."""
    if "tensorflow" in sys.modules:
        yield
        return
    sys.modules["tensorflow"] = None  # type: ignore[assignment]  # (Python's own way to make an import fail)
    try:
        yield
    finally:
        if "tensorflow" in sys.modules and sys.modules["tensorflow"] is None:
            del sys.modules["tensorflow"]


def _not_here(config: RunConfig, every: int | None) -> None:
    """Says which TensorFlow-only settings this runner leaves out (they do not fail a run)."""
    if every:
        say(f"note: checkpoints every {every} steps are for the tensorflow backend; on jax a backup is "
             "taken at each epoch end only")
    if config.collective != "auto":
        say(f"note: --collective {config.collective} is for the tensorflow backend; JAX chooses its own")


def run(config: RunConfig) -> Summary:
    """Trains the entrypoint's task on this process, with every process of the group; returns a summary."""
    run_dir = config.run_dir or os.environ.get(env.RUN_DIR) or None
    writer = ProgressWriter(run_dir, task=task_index())
    writer.update(force=True, state=str(ProgressState.STARTING))
    split_host(config.local_replicas)  # before JAX is imported

    with notice_held():  # a notice while the group forms waits for our handler
        entrypoint = resolve_entrypoint(config.entrypoint)
        if config.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise WorkerError("--tensorboard needs the tensorboard package on every host: pip install tensorboard")
        keras = import_keras3()
        with tensorflow_hidden():
            group = join(keras, config.local_replicas)
    task = load_entrypoint(config.entrypoint, entrypoint)
    with tensorflow_hidden():
        keras.utils.set_random_seed(task.seed)  # the same initial weights on every process
    if config.mixed_precision:
        keras.mixed_precision.set_global_policy("mixed_float16")
    epochs, per_replica, base_lr = settings(config, task)
    model_dir, checkpoint_dir = folders(config, run_dir)
    found = look(checkpoint_dir, claims=True)
    if finished_agreed(group.gather(int(finished_here(checkpoint_dir))), checkpoint_dir):
        return nothing_left(writer, group.index, epochs)
    claim(checkpoint_dir, start_point(found, epochs, config.resume_run), group.chief)
    _not_here(config, first_set(config.checkpoint_every_steps, task.checkpoint_every_steps, default=None))
    global_batch = per_replica * group.devices
    writer.update(force=True, epochs=epochs, replicas=group.devices)
    say(f"task {group.index} of {group.size} ({'chief' if group.chief else 'worker'}): DataParallel (jax), "
         f"{group.devices} replica(s) in sync, global batch {global_batch} ({per_replica}/replica)")

    train, val = feeds(task, group, per_replica, config.steps_per_epoch)
    model = task.model()
    if not isinstance(model, keras.Model):
        raise WorkerError(f"Task.model returned {type(model).__module__}.{type(model).__name__}, not a Keras 3 "
                          "model: build it with `import keras` (not tf_keras) for the jax backend")
    learning_rate = learning_rate_for(keras, base_lr, group.devices, config.scale_learning_rate,
                                      warmup_steps=int(round(task.warmup_epochs * train.steps)))
    model.compile(optimizer=build_optimizer(keras, task, learning_rate), loss=task.loss, metrics=list(task.metrics))

    progress = callback_class(keras)(writer=writer, epochs=epochs, steps_per_epoch=train.steps,
                                     global_batch_size=global_batch, mark_done_on_train_end=False)
    started = time.time()
    history = _fit(model, train, val, epochs, _callbacks(config, task, keras, group, checkpoint_dir, epochs,
                                                          writer, progress), progress)
    done = finish(config, model, group.index, progress, started, lambda: _save_model(keras, model, model_dir, group))
    tell_finished(lambda: group.gather(1), group.chief, checkpoint_dir, os.path.join(checkpoint_dir, BACKUP))
    return {"history": history.history, **done, "steps_per_epoch": train.steps, "global_batch_size": global_batch,
            "replicas": group.devices, "task": group.index}


# Any (here and below): Keras 3's module and objects, which have no types
def _save_model(keras: Any, model: Any, model_dir: str, group: Group) -> str | None:
    """The chief alone writes the model (the weights are the same on every process), outside the distribution."""
    if not group.chief:
        return None
    with alone(keras):
        return save_model(model, model_dir, chief=True)


def _callbacks(config: RunConfig, task: Task, keras: Any, group: Group, checkpoint_dir: str, epochs: int,
               writer: ProgressWriter, progress: ProgressCallbackLike) -> list[Any]:
    """fit's callbacks: progress's stopwatch first (a step's training time ends there), the backup (an epoch is
    backed up before anyone reports it finished), the chief's TensorBoard, progress, the Task's own, and the
    notice's stopper last."""
    backup, stopper = checkpoint_callbacks(keras, group, checkpoint_dir, epochs,
                                           lambda: writer.update(force=True, state=str(ProgressState.PREEMPTING)))
    callbacks = [progress.stopwatch(), backup]
    if config.tensorboard and group.chief:
        callbacks.append(keras.callbacks.TensorBoard(log_dir=config.tensorboard))
    extra = task.callbacks() if callable(task.callbacks) else task.callbacks
    return [*callbacks, progress, *extra, stopper]


def _fit(model: Any, train: Feed, val: Feed | None, epochs: int, callbacks: list[Any],
         progress: ProgressCallbackLike) -> Any:
    """model.fit on this process's share; a notice during it is said with where it stopped (Preempted goes on
    up), one after the last epoch is said too."""
    started = time.time()
    try:
        history = model.fit(train.x, train.y, batch_size=train.batch, epochs=epochs, steps_per_epoch=train.steps,
                            validation_data=(val.x, val.y) if val else None,
                            validation_batch_size=val.batch if val else None,
                            validation_steps=val.steps if val else None, shuffle=True, callbacks=callbacks,
                            verbose=0)
    except Preempted as exc:
        progress.mark_preempted()
        say(f"preempted: {exc} (epoch {progress.writer.fields['epoch']}), {time.time() - started:.1f}s in fit")
        raise
    if checkpoints.notice.is_set():
        say("notice (SIGTERM) after the last epoch: finishing")
    return history
