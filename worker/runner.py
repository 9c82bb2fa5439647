"""The built-in runner: entrypoint -> strategy, input pipeline, model, fit, progress, save.

`Task` is the contract of an entrypoint `module:function`; `run(RunConfig)` does the rest.
TensorFlow is imported inside `run`, never at import time.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from worker.progress import ProgressWriter
from worker.strategy import SHARD_POLICIES, cluster_from_env, task_id_from_env

DEFAULT_EPOCHS = 1
DEFAULT_BATCH_SIZE_PER_REPLICA = 64
DEFAULT_LEARNING_RATE = 0.001


class WorkerError(Exception):
    """A problem the user can fix; the message says what to do (no traceback needed)."""


class EntrypointError(WorkerError):
    """The entrypoint cannot be imported, called, or returned something that is not a Task."""


class Preempted(Exception):
    """Every worker saved a checkpoint at the same step after a notice; exit EXIT_PREEMPTED."""


_notice = threading.Event()  # set by SIGTERM


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
            signal.signal(signal.SIGTERM, lambda signum, frame: _notice.set())
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


@dataclass
class DataContext:
    """What a dataset builder is told about the input pipeline it feeds."""

    global_batch_size: int  # per-replica batch x replicas in sync
    per_replica_batch_size: int
    num_replicas: int  # replicas in sync over all workers
    num_workers: int  # input pipelines: one per worker
    worker_index: int  # this worker's input pipeline id (0 = chief)
    training: bool  # True for train_data, False for val_data
    input_context: Any  # the tf.distribute.InputContext of this worker

    def shard(self, dataset):
        """This worker's share of `dataset` (for Task(shard="off"), e.g. a list of files)."""
        return dataset.shard(self.num_workers, self.worker_index)


@dataclass
class Task:
    """What an entrypoint function returns; the runner does sharding, batching and `fit`.

    model: builds the *uncompiled* Keras model; called inside `strategy.scope()`.
    train_data / val_data: `(DataContext) -> tf.data.Dataset` of single, *unbatched*
        `(features, label)` examples; the runner caches, shuffles, batches and prefetches.
    shard: "data" (in-memory data: every worker builds it all, keeps 1/N: AutoShardPolicy.DATA),
        "file" (a file-reading pipeline such as TFRecordDataset over a file list:
        AutoShardPolicy.FILE), "off" (the builder already took `ctx.shard(...)` of its files).
    optimizer: a Keras optimizer name, or `(learning_rate) -> optimizer`.
    The remaining fields are defaults that command-line flags override.
    """

    model: Callable[[], Any]
    train_data: Callable[[DataContext], Any]
    val_data: Callable[[DataContext], Any] | None = None
    loss: Any = "sparse_categorical_crossentropy"
    metrics: Sequence[Any] = ("accuracy",)
    optimizer: str | Callable[[Any], Any] = "adam"
    epochs: int | None = None
    batch_size_per_replica: int | None = None
    learning_rate: float | None = None
    steps_per_epoch: int | None = None  # default: examples // global batch
    checkpoint_every_steps: int | None = None  # default: a checkpoint at each epoch end only
    validation_steps: int | None = None  # default: the whole validation set
    shard: str = "data"
    cache: bool = True  # cache the examples in memory before shuffling
    shuffle_buffer: int = 10_000
    prefetch: int = 2  # batches; fixed, as tf.data autotune is off (strategy.dataset_options)
    warmup_epochs: float = 1.0  # linear warm-up to the scaled learning rate
    seed: int = 1234  # shuffle and initialisation seed, the same on every worker
    callbacks: Sequence[Any] | Callable[[], Sequence[Any]] = ()  # extra Keras callbacks

    def __post_init__(self):
        if self.shard not in SHARD_POLICIES:
            raise ValueError(f"Task.shard must be one of {SHARD_POLICIES}, not {self.shard!r}")
        if self.checkpoint_every_steps is not None and self.checkpoint_every_steps < 1:
            raise ValueError("Task.checkpoint_every_steps must be at least 1 (or None)")


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
    checkpoint_every_steps: int | None = None
    tensorboard: str | None = None
    mixed_precision: bool = False
    model_dir: str | None = None
    run_dir: str | None = None
    save_weights: str | None = None
    communication: str = "auto"
    devices: Sequence[str] | None = None  # one worker: MirroredStrategy over these


def default_dirs(run_dir: str | None) -> tuple[str, str]:
    """(model_dir, checkpoint_dir): the run folder (parent of the task folder) or ./."""
    base = os.path.dirname(os.path.abspath(run_dir)) if run_dir else os.getcwd()
    return base, os.path.join(base, "checkpoint")


def resolve_entrypoint(spec: str) -> Callable[[], Any]:
    """Imports `module:function` (the current directory importable); returns the function."""
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise EntrypointError(f"entrypoint {spec!r} must look like 'module:function'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EntrypointError(f"entrypoint {spec!r}: cannot import {module_name!r}: {exc}") from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise EntrypointError(f"entrypoint {spec!r}: {module_name!r} has no function "
                              f"{func_name!r}")
    return func


def load_entrypoint(spec: str, func: Callable[[], Any] | None = None) -> Task:
    """Calls the entrypoint function; a returned dict is taken as Task(**dict)."""
    task = (func or resolve_entrypoint(spec))()
    if isinstance(task, dict):
        try:
            task = Task(**task)
        except TypeError as exc:
            raise EntrypointError(f"entrypoint {spec!r} returned a dict that is no Task: "
                                  f"{exc}") from None
    if not isinstance(task, Task):
        raise EntrypointError(f"entrypoint {spec!r} returned {type(task).__name__}, "
                              "not a worker.Task")
    return task


def _count(tf, dataset) -> int:
    cardinality = int(dataset.cardinality())
    if cardinality == int(tf.data.INFINITE_CARDINALITY):
        raise WorkerError("train_data is infinite: give Task.steps_per_epoch or --steps-per-epoch")
    if cardinality >= 0:
        return cardinality
    print("counting the training examples once (set steps_per_epoch to skip this)", flush=True)
    return int(dataset.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))


def _counts_over_workers(tf, strategy, value: int, num_workers: int) -> list[int]:
    """Every worker's `value`, in task order (a collective: every worker must call it)."""
    if num_workers <= 1:
        return [value]
    local_replicas = strategy.num_replicas_in_sync // num_workers

    def per_replica(ctx):
        replica = ctx.replica_id_in_sync_group
        own = tf.one_hot(replica // local_replicas, num_workers, dtype=tf.int64) * value
        return own if replica % local_replicas == 0 else tf.zeros_like(own)

    values = strategy.experimental_distribute_values_from_function(per_replica)
    return [int(v) for v in strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None)]


def _check_backup_visible(tf, strategy, checkpoint_dir: str, num_workers: int) -> None:
    """Every worker restores from the chief's backup in `checkpoint_dir` (tf_keras reads
    `<dir>/chief`); a worker that cannot see it would start from epoch 1 while the others
    resume. Refuse that (all workers together) instead of training diverged replicas."""
    if num_workers <= 1:
        return
    has_backup = tf.train.latest_checkpoint(os.path.join(checkpoint_dir, "chief")) is not None
    seen = _counts_over_workers(tf, strategy, int(has_backup), num_workers)
    if 0 < sum(seen) < num_workers:
        have = [i for i, flag in enumerate(seen) if flag]
        missing = [i for i, flag in enumerate(seen) if not flag]
        raise WorkerError(f"task(s) {have} found a backup to resume from, task(s) {missing} did "
                          f"not (checkpoint dir here: {checkpoint_dir}): put --checkpoint-dir on "
                          "storage that every host shares, or delete the backup to start over")


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

    class Backup(keras.callbacks.BackupAndRestore):
        def __init__(self):
            super().__init__(backup_dir=checkpoint_dir, save_freq=every or steps)
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
                _say(f"notice watcher stopped: {exc}")

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
            if (_notice.is_set() or self.target is not None) and not self._noticed:
                self._noticed = True
                on_notice()  # progress.json says "preempting": the supervisor's preempt_grace runs
                if not _notice.is_set():  # (the supervisor reads progress.json when a line comes)
                    _say(f"notice from another worker: saving with every worker at global step {self.target}")
            if _notice.is_set() and not self._claimed:
                self._claimed = True
                _say(f"notice (SIGTERM) at global step {step}: saving with every worker")
                self._claim(step)
            if self.target is not None and step >= self.target:
                self._backup(epoch=self._current_epoch, batch=batch)
                self.stopped_at = step
            elif batch + 1 == steps or (every and step % every == 0):
                self._backup(epoch=self._current_epoch, batch=batch)

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


def _resolve(*values, default):
    for value in values:
        if value is not None:
            return value
    return default


def _say(line: str) -> None:
    print(line, flush=True)


def run(config: RunConfig) -> dict:
    """Trains the entrypoint's task on this worker; returns a summary (history, paths, times)."""
    run_dir = config.run_dir or os.environ.get("MGPU_RUN_DIR") or None
    info = cluster_from_env()
    task_id = task_id_from_env()
    writer = ProgressWriter(run_dir, task=task_id)
    writer.update(force=True, state="starting")

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
        strategy = strategy_from_env(devices=config.devices,
                                     communication=config.communication)
    task = load_entrypoint(config.entrypoint, entrypoint)
    keras.utils.set_random_seed(task.seed)  # same initial weights and order from run to run
    epochs = int(_resolve(config.epochs, task.epochs, default=DEFAULT_EPOCHS))
    per_replica = int(_resolve(config.batch_size_per_replica, task.batch_size_per_replica,
                               default=DEFAULT_BATCH_SIZE_PER_REPLICA))
    base_lr = float(_resolve(config.learning_rate, task.learning_rate,
                             default=DEFAULT_LEARNING_RATE))
    model_dir, checkpoint_dir = default_dirs(run_dir)
    model_dir = config.model_dir or model_dir
    checkpoint_dir = config.checkpoint_dir or checkpoint_dir
    replicas = strategy.num_replicas_in_sync
    global_batch = per_replica * replicas
    writer.update(force=True, epochs=epochs)
    _say(f"task {task_id} of {info.num_workers} ({'chief' if info.is_chief else 'worker'}): "
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

    from worker.progress import ProgressCallback
    from worker.steptime import StepClock

    clock = StepClock(tf)  # each step's own work apart from the wait for peers (stragglers)
    clock.install(model.optimizer)
    progress = ProgressCallback(writer=writer, epochs=epochs, steps_per_epoch=steps,
                                global_batch_size=global_batch, mark_done_on_train_end=False, clock=clock)
    _check_backup_visible(tf, strategy, checkpoint_dir, info.num_workers)
    every = _resolve(config.checkpoint_every_steps, task.checkpoint_every_steps, default=None)
    backup, stopper = checkpoint_callbacks(keras, tf, checkpoint_dir, steps, every, info,
                                           lambda: writer.update(force=True, state="preempting"))
    # the clock first (its step ends before any other callback's work), then the backup (a step is
    # backed up before anyone reports it finished)
    callbacks = [clock.callback(), backup]
    if config.tensorboard:
        # tf_keras sends non-chief workers' logs to a temporary folder and removes it
        callbacks.append(keras.callbacks.TensorBoard(log_dir=config.tensorboard))
    extra = task.callbacks() if callable(task.callbacks) else task.callbacks
    callbacks += [progress, *extra, stopper]

    started = time.time()
    try:
        history = model.fit(train, epochs=epochs, steps_per_epoch=steps, validation_data=val,
                            validation_steps=task.validation_steps, callbacks=callbacks,
                            verbose=0)
    except Preempted as exc:
        progress.mark_preempted()
        _say(f"preempted: {exc} (epoch {progress.writer.fields['epoch']} step "
             f"{progress.writer.fields['step']}), {time.time() - started:.1f}s in fit")
        raise
    returned = time.time()
    if _notice.is_set():
        _say("notice (SIGTERM) after the last step: finishing")
    tail = returned - progress.last_epoch_end if progress.last_epoch_end else 0.0
    _say(f"fit returned {tail:.2f}s after the last epoch end")

    weights_path = None
    if config.save_weights:
        weights_path = save_weights(model, config.save_weights.replace("{task}", str(task_id)))
    model_path = save_model(model, model_dir, info.is_chief)
    progress.mark_done()
    _say(f"done: fit took {returned - started:.1f}s"
         + (f"; model saved to {model_path}" if model_path else ""))
    return {"history": history.history, "model_path": model_path, "weights_path": weights_path,
            "fit_tail_s": tail, "steps_per_epoch": steps, "global_batch_size": global_batch,
            "replicas": replicas, "task": task_id}


def input_pipelines(tf, strategy, task: Task, worker_index: int, num_workers: int,
                    per_replica: int, steps: int | None):
    """(train, val, steps per epoch): the task's examples cached, shuffled, batched to the
    global batch, prefetched, with the task's shard policy and autotune off."""
    from worker.strategy import dataset_options

    replicas = strategy.num_replicas_in_sync
    global_batch = per_replica * replicas

    def context(training: bool) -> DataContext:
        input_context = tf.distribute.InputContext(
            num_input_pipelines=num_workers, input_pipeline_id=worker_index,
            num_replicas_in_sync=replicas)
        return DataContext(global_batch_size=global_batch, per_replica_batch_size=per_replica,
                           num_replicas=replicas, num_workers=num_workers,
                           worker_index=worker_index, training=training,
                           input_context=input_context)

    # autotune off with a fixed prefetch: see strategy.quiet_device_datasets
    autotune = os.environ.get("MGPU_TF_DATA_AUTOTUNE", "0") == "1"
    options = dataset_options(task.shard, autotune=autotune)
    prefetch = tf.data.AUTOTUNE if autotune else task.prefetch

    train = task.train_data(context(True))
    steps = _resolve(steps, task.steps_per_epoch, default=None)
    if steps is None:
        examples = _count(tf, train)
        if task.shard == "off":  # each worker holds only its own share
            counts = _counts_over_workers(tf, strategy, examples, num_workers)
            if min(counts) == 0:
                raise WorkerError(f"training examples per worker: {counts}; every worker "
                                  "needs some (fewer files than workers?)")
            examples = sum(counts)
        steps = examples // global_batch
        if steps < 1:
            raise WorkerError(f"{examples} training examples do not fill one global batch of "
                              f"{global_batch}; lower --batch-size-per-replica")
    if task.cache:
        train = train.cache()
    train = (train.shuffle(task.shuffle_buffer, seed=task.seed, reshuffle_each_iteration=True)
             .batch(global_batch, drop_remainder=True)
             .repeat()  # one iterator for the whole fit; every epoch is `steps` batches
             .prefetch(prefetch)
             .with_options(options))

    val = None
    if task.val_data is not None:
        val = task.val_data(context(False))
        if task.cache:
            val = val.cache()
        val = val.batch(global_batch).prefetch(prefetch).with_options(options)
    return train, val, int(steps)


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
            model.save(os.path.join(scratch, "model.keras"))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return None
    os.makedirs(model_dir, exist_ok=True)
    final = os.path.join(model_dir, "model.keras")
    partial = os.path.join(model_dir, f".model-{os.getpid()}.partial.keras")
    model.save(partial)
    os.replace(partial, final)
    return final
