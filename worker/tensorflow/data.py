"""The input pipelines of the built-in runner: the task's examples counted, sharded, batched to the
global batch (per-replica batch x replicas in sync over all workers), prefetched."""

from __future__ import annotations

import os
from typing import Any

from worker.host import env
from worker.training.entrypoint import DataContext, Task, WorkerError, first_set
from worker.training.lines import say


# Any (here and below): TensorFlow's module, strategy and datasets, which have no types
def _count(tf: Any, dataset: Any) -> int:
    cardinality = int(dataset.cardinality())
    if cardinality == int(tf.data.INFINITE_CARDINALITY):
        raise WorkerError("train_data is infinite: give Task.steps_per_epoch or --steps-per-epoch")
    if cardinality >= 0:
        return cardinality
    say("counting the training examples once (set steps_per_epoch to skip this)")
    return int(dataset.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))


def counts_over_workers(tf: Any, strategy: Any, value: int, num_workers: int) -> list[int]:
    """Every worker's `value`, in task order (a collective: every worker must call it)."""
    if num_workers <= 1:
        return [value]
    local_replicas = strategy.num_replicas_in_sync // num_workers

    def per_replica(ctx: Any) -> Any:
        replica = ctx.replica_id_in_sync_group
        own = tf.one_hot(replica // local_replicas, num_workers, dtype=tf.int64) * value
        return own if replica % local_replicas == 0 else tf.zeros_like(own)

    values = strategy.experimental_distribute_values_from_function(per_replica)
    return [int(v) for v in strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None)]


def input_pipelines(tf: Any, strategy: Any, task: Task, worker_index: int, num_workers: int,
                    per_replica: int, steps: int | None) -> tuple[Any, Any | None, int]:
    """(train, val, steps per epoch): the task's examples cached, shuffled, batched to the
    global batch, prefetched, with the task's shard policy and autotune off."""
    from worker.tensorflow.strategy import dataset_options

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
    autotune = os.environ.get(env.TF_DATA_AUTOTUNE, "0") == "1"
    options = dataset_options(task.shard, autotune=autotune)
    prefetch = tf.data.AUTOTUNE if autotune else task.prefetch

    train = task.train_data(context(True))
    steps = first_set(steps, task.steps_per_epoch, default=None)
    if steps is None:
        examples = _count(tf, train)
        if task.shard == "off":  # each worker holds only its own share
            counts = counts_over_workers(tf, strategy, examples, num_workers)
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
