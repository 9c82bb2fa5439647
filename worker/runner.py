"""The built-in runner: entrypoint -> strategy, input pipeline, model, fit, progress, save.

`Task` is the contract of an entrypoint `module:function`; `run(RunConfig)` does the rest.
TensorFlow is imported inside `run`, never at import time.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Sequence

from worker import checkpoints
from worker.checkpoints import (NOTHING_LEFT, TF_BACKUP, Preempted, checkpoint_callbacks, claim, notice_held,
                                start_agreed, start_point, tell_finished)
from worker.data import counts_over_workers, input_pipelines
from worker.host import env, layout
from worker.entrypoint import (DataContext, EntrypointError, Task, WorkerError, first_set,
                               load_entrypoint, resolve_entrypoint)
from worker.progress import ProgressWriter
from worker.protocol import ProgressState
from worker.startpoint import look
from worker.strategy import cluster_from_env, task_id_from_env
from worker.lines import say

__all__ = ["DataContext", "EntrypointError", "Preempted", "RunConfig", "Task", "WorkerError",
           "input_pipelines", "load_entrypoint", "resolve_entrypoint", "run", "save_model",
           "save_weights"]

DEFAULT_EPOCHS = 1
DEFAULT_BATCH_SIZE_PER_REPLICA = 64
DEFAULT_LEARNING_RATE = 0.001


@dataclass
class RunConfig:
    """The runner's settings; None means: the Task's value, else the runner's default."""

    entrypoint: str
    epochs: int | None = None
    steps_per_epoch: int | None = None
    batch_size_per_replica: int | None = None
    learning_rate: float | None = None
    scale_learning_rate: bool = True
    checkpoint_dir: str | None = None
    resume_from: str | None = None  # an earlier run's checkpoint folder, adopted when this run has none
    resume_run: str | None = None  # the run whose backup this run may start from (`up --resume RUN`)
    checkpoint_every_steps: int | None = None
    tensorboard: str | None = None
    mixed_precision: bool = False
    model_dir: str | None = None
    run_dir: str | None = None
    save_weights: str | None = None
    collective: str = "auto"
    devices: Sequence[str] | None = None  # one worker: MirroredStrategy over these
    local_replicas: int | None = None  # replicas per worker on a CPU host (logical CPU devices)


def default_dirs(run_dir: str | None) -> tuple[str, str]:
    """(model_dir, checkpoint_dir): the run folder (parent of the task folder) or ./."""
    base = os.path.dirname(os.path.abspath(run_dir)) if run_dir else os.getcwd()
    return base, layout.checkpoint_dir(base)


def folders(config: RunConfig, run_dir: str | None) -> tuple[str, str]:
    """(model_dir, checkpoint_dir): the config's, else the defaults; a checkpoint to resume from (--resume-from)
    is adopted into the checkpoint folder first."""
    model_dir, checkpoint_dir = default_dirs(run_dir)
    model_dir, checkpoint_dir = config.model_dir or model_dir, config.checkpoint_dir or checkpoint_dir
    if config.resume_from:
        say(adopt_checkpoint(config.resume_from, checkpoint_dir))
    return model_dir, checkpoint_dir


def adopt_checkpoint(source: str, target: str) -> str:
    """An earlier run's checkpoint (`source`) made this run's own (`target`): its files linked (copied where
    links cannot be made), so that each run keeps its own and the earlier one stays as it was. A target that
    holds files already is left alone (a restart of this run, or another task of this host was first).
    What was done, in words."""
    source, target = os.path.abspath(source), os.path.abspath(target)
    if source == target or os.path.isdir(target) and os.listdir(target):
        return f"resuming from the checkpoint in {target}"
    if not os.path.isdir(source) or not os.listdir(source):
        return f"no checkpoint in {source} (its run stopped before the first was saved): training starts over"

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    os.makedirs(os.path.dirname(target), exist_ok=True)
    temporary = tempfile.mkdtemp(prefix=".adopt-", dir=os.path.dirname(target))
    try:
        shutil.copytree(source, os.path.join(temporary, "c"), symlinks=True, copy_function=link)
        os.rename(os.path.join(temporary, "c"), target)  # whole or not at all; a folder there already wins
    except OSError:
        if not (os.path.isdir(target) and os.listdir(target)):
            raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return f"resuming from the checkpoint of {source} (linked into {target})"


def build_optimizer(keras, task: Task, learning_rate):
    if callable(task.optimizer):
        return task.optimizer(learning_rate)
    return keras.optimizers.get({"class_name": task.optimizer,
                                 "config": {"learning_rate": learning_rate}})


def learning_rate_for(keras, base: float, replicas: int, scale: bool, warmup_steps: int):
    """base x replicas when scaling, reached by a linear warm-up over `warmup_steps` steps."""
    if not scale or replicas <= 1:
        return base
    target = base * replicas
    if warmup_steps <= 0:
        return target
    # PolynomialDecay with power 1 and end > start is a linear ramp that then stays at `end`;
    # a built-in schedule keeps the saved model loadable without custom objects.
    return keras.optimizers.schedules.PolynomialDecay(
        initial_learning_rate=base, decay_steps=warmup_steps, end_learning_rate=target,
        power=1.0)


def run(config: RunConfig) -> dict:
    """Trains the entrypoint's task on this worker; returns a summary (history, paths, times)."""
    run_dir = config.run_dir or os.environ.get(env.RUN_DIR) or None
    info = cluster_from_env()
    task_id = task_id_from_env()
    writer = ProgressWriter(run_dir, task=task_id)
    writer.update(force=True, state=str(ProgressState.STARTING))

    with notice_held():
        entrypoint = resolve_entrypoint(config.entrypoint)
        if config.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise WorkerError("--tensorboard needs the tensorboard package on every host: "
                              "pip install tensorboard")

        from worker.strategy import import_keras, set_mixed_precision, strategy_from_env

        keras = import_keras()
        import tensorflow as tf

        if config.mixed_precision:
            set_mixed_precision(True)
        # MultiWorkerMirroredStrategy must exist before TensorFlow runs any op, so the
        # entrypoint (which may index files with TensorFlow) is called only afterwards.
        strategy = strategy_from_env(devices=config.devices, collective=config.collective,
                                     local_replicas=config.local_replicas)
    task = load_entrypoint(config.entrypoint, entrypoint)
    keras.utils.set_random_seed(task.seed)  # same initial weights and order from run to run
    epochs, per_replica, base_lr = settings(config, task)
    model_dir, checkpoint_dir = folders(config, run_dir)
    found = look(checkpoint_dir)
    if start_agreed(tf, strategy, checkpoint_dir, info.num_workers):
        return nothing_left(writer, task_id, epochs)
    claim(checkpoint_dir, start_point(found, epochs, config.resume_run), info.is_chief)
    replicas = strategy.num_replicas_in_sync
    global_batch = per_replica * replicas
    writer.update(force=True, epochs=epochs, replicas=replicas)
    say(f"task {task_id} of {info.num_workers} ({'chief' if info.is_chief else 'worker'}): "
         f"{type(strategy).__name__}, {replicas} replica(s) in sync, "
         f"global batch {global_batch} ({per_replica}/replica)")

    train, val, steps = input_pipelines(tf, strategy, task, info.task_id, info.num_workers,
                                        per_replica, config.steps_per_epoch)
    with strategy.scope():
        model = task.model()
        learning_rate = learning_rate_for(keras, base_lr, replicas, config.scale_learning_rate,
                                          warmup_steps=int(round(task.warmup_epochs * steps)))
        model.compile(optimizer=build_optimizer(keras, task, learning_rate), loss=task.loss,
                      metrics=list(task.metrics))

    from worker.progress_keras import ProgressCallback

    clock = _step_clock(tf, model)
    progress = ProgressCallback(writer=writer, epochs=epochs, steps_per_epoch=steps,
                                global_batch_size=global_batch, mark_done_on_train_end=False, clock=clock)
    callbacks = _callbacks(config, task, keras, tf, checkpoint_dir, steps, info, writer, clock, progress)

    started = time.time()
    history = _fit(model, dict(x=train, epochs=epochs, steps_per_epoch=steps, validation_data=val,
                               validation_steps=task.validation_steps, callbacks=callbacks, verbose=0),
                   progress)
    done = finish(config, model, task_id, progress, started, lambda: save_model(model, model_dir, info.is_chief))
    tell_finished(lambda: counts_over_workers(tf, strategy, 1, info.num_workers), info.is_chief, checkpoint_dir,
                  os.path.join(checkpoint_dir, TF_BACKUP))
    return {"history": history.history, **done, "steps_per_epoch": steps, "global_batch_size": global_batch,
            "replicas": replicas, "task": task_id}


def finish(config: RunConfig, model, task_id: int, progress, started: float, save) -> dict:
    """After fit (either backend): how long fit took past its last epoch's end, the weights where --save-weights
    says, the model by `save()` (the chief's path, or None), progress done; the summary's paths and tail."""
    returned = time.time()
    tail = returned - progress.last_epoch_end if progress.last_epoch_end else 0.0
    say(f"fit returned {tail:.2f}s after the last epoch end")
    weights_path = None
    if config.save_weights:
        weights_path = save_weights(model, config.save_weights.replace("{task}", str(task_id)))
    model_path = save()
    progress.mark_done()
    say(f"done: fit took {returned - started:.1f}s" + (f"; model saved to {model_path}" if model_path else ""))
    return {"model_path": model_path, "weights_path": weights_path, "fit_tail_s": tail}


def nothing_left(writer, task_id: int, epochs: int) -> dict:
    """A restart of a run whose training ended (a crash after every task saved): done, with nothing trained."""
    say(NOTHING_LEFT)
    writer.update(force=True, state=str(ProgressState.DONE), epochs=epochs, epoch=epochs)
    return {"history": {}, "model_path": None, "weights_path": None, "fit_tail_s": 0.0, "task": task_id}


def settings(config: RunConfig, task: Task) -> tuple[int, int, float]:
    """Epochs, batch size per replica and base learning rate: the config's, else the Task's, else ours."""
    epochs = int(first_set(config.epochs, task.epochs, default=DEFAULT_EPOCHS))
    per_replica = int(first_set(config.batch_size_per_replica, task.batch_size_per_replica,
                               default=DEFAULT_BATCH_SIZE_PER_REPLICA))
    base_lr = float(first_set(config.learning_rate, task.learning_rate, default=DEFAULT_LEARNING_RATE))
    return epochs, per_replica, base_lr


def _step_clock(tf, model):
    """Times each step's own work apart from the wait for peers (stragglers); None when MGPU_STEP_CLOCK=0
    or the optimizer is one it cannot wrap."""
    from worker.steptime import StepClock

    if os.environ.get(env.STEP_CLOCK, "1") == "0":
        return None
    clock = StepClock(tf)
    try:
        clock.install(model.optimizer)
    except ValueError as exc:  # an optimizer of the user's own: trains the same, without the split
        say(f"note: {exc}; training goes on without it")
        return None
    return clock


def _callbacks(config: RunConfig, task: Task, keras, tf, checkpoint_dir: str, steps: int, info, writer, clock,
               progress) -> list:
    """fit's callbacks in their order: the step clock first (its step ends before any other callback's work),
    progress's stopwatch (a step's training time ends there), then the backup (a step is backed up before anyone reports it finished), TensorBoard, progress, the
    Task's own, and the notice's stopper last."""
    every = first_set(config.checkpoint_every_steps, task.checkpoint_every_steps, default=None)
    backup, stopper = checkpoint_callbacks(keras, tf, checkpoint_dir, steps, every, info,
                                           lambda: writer.update(force=True, state=str(ProgressState.PREEMPTING)))
    callbacks = [*([clock.callback()] if clock is not None else []), progress.stopwatch(), backup]
    if config.tensorboard:
        # tf_keras sends non-chief workers' logs to a temporary folder and removes it
        callbacks.append(keras.callbacks.TensorBoard(log_dir=config.tensorboard))
    extra = task.callbacks() if callable(task.callbacks) else task.callbacks
    return [*callbacks, progress, *extra, stopper]


def _fit(model, fit_args: dict, progress):
    """model.fit; a notice during it is said with where it stopped (Preempted goes on up), one after the last
    step is said too."""
    started = time.time()
    try:
        history = model.fit(**fit_args)
    except Preempted as exc:
        progress.mark_preempted()
        say(f"preempted: {exc} (epoch {progress.writer.fields['epoch']} step "
             f"{progress.writer.fields['step']}), {time.time() - started:.1f}s in fit")
        raise
    if checkpoints.notice.is_set():
        say("notice (SIGTERM) after the last step: finishing")
    return history


def save_weights(model, path: str) -> str:
    """The model's weights as an .npz (arr_0, arr_1, ... in `model.get_weights()` order)."""
    import numpy as np

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.savez(path, *model.get_weights())
    return path


def save_model(model, model_dir: str, chief: bool | None = None) -> str | None:
    """The chief writes `<model_dir>/model.keras` (atomically); other workers must take part
    in the save too (TensorFlow reads distributed variables collectively), so they write to a
    temporary folder that is deleted at once. Returns the chief's path, else None.
    `chief` defaults to what TF_CONFIG says."""
    if chief is None:
        chief = cluster_from_env().is_chief
    if not chief:
        scratch = tempfile.mkdtemp(prefix="mgpu-model-")
        try:
            model.save(os.path.join(scratch, layout.MODEL))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return None
    os.makedirs(model_dir, exist_ok=True)
    final = os.path.join(model_dir, layout.MODEL)
    partial = os.path.join(model_dir, f".model-{os.getpid()}.partial.keras")
    model.save(partial)
    os.replace(partial, final)
    return final
