"""The built-in runner on TensorFlow: entrypoint -> MultiWorkerMirroredStrategy, input pipeline, model, fit,
progress, save. `run(RunConfig)` trains the Task of an entrypoint `module:function` (worker.training.entrypoint);
TensorFlow is imported inside `run`, never at import time.
"""

from __future__ import annotations

import importlib.util
import os
import time
from typing import TYPE_CHECKING, Any

from worker.host import env
from worker.host.protocol import ProgressState
from worker.host.startpoint import look
from worker.tensorflow.checkpoints import TF_BACKUP, checkpoint_callbacks, start_agreed
from worker.tensorflow.data import counts_over_workers, input_pipelines
from worker.tensorflow.strategy import ClusterInfo, cluster_from_env, task_id_from_env
from worker.training import checkpoints
from worker.training.checkpoints import Preempted, claim, notice_held, start_point, tell_finished
from worker.training.config import RunConfig, folders, settings
from worker.training.ending import Summary, finish, nothing_left, save_model
from worker.training.entrypoint import Task, WorkerError, first_set, load_entrypoint, resolve_entrypoint
from worker.training.lines import say
from worker.training.optimizer import build_optimizer, learning_rate_for
from worker.training.progress import ProgressWriter

if TYPE_CHECKING:
    from worker.tensorflow.steptime import StepClock
    from worker.training.keras_progress import ProgressCallbackLike


def run(config: RunConfig) -> Summary:
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

        from worker.tensorflow.strategy import import_keras, set_mixed_precision, strategy_from_env

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
    found = look(checkpoint_dir, claims=True)
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

    from worker.training.keras_progress import ProgressCallback

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


# Any (here and below): TensorFlow's and tf_keras' modules and objects, which have no types
def _step_clock(tf: Any, model: Any) -> StepClock | None:
    """Times each step's own work apart from the wait for peers (stragglers); None when MGPU_STEP_CLOCK=0
    or the optimizer is one it cannot wrap."""
    from worker.tensorflow.steptime import StepClock

    if os.environ.get(env.STEP_CLOCK, "1") == "0":
        return None
    clock = StepClock(tf)
    try:
        clock.install(model.optimizer)
    except ValueError as exc:  # an optimizer of the user's own: trains the same, without the split
        say(f"note: {exc}; training goes on without it")
        return None
    return clock


def _callbacks(config: RunConfig, task: Task, keras: Any, tf: Any, checkpoint_dir: str, steps: int, info: ClusterInfo,
               writer: ProgressWriter, clock: StepClock | None, progress: ProgressCallbackLike) -> list[Any]:
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


def _fit(model: Any, fit_args: dict[str, Any], progress: ProgressCallbackLike) -> Any:
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


