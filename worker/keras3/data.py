"""This task's share of the Task's examples under Keras 3: NumPy arrays, one equal slice per process, cut to
whole batches so that every process takes the same number of steps (a step is a collective)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.training.entrypoint import DataContext, Task, WorkerError, first_set
from worker.keras3.group import Group


@dataclass
class Feed:
    """What `fit` gets from this process: its examples and labels, its batch (its part of the global batch)
    and the steps they fill."""

    x: Any
    y: Any
    batch: int
    steps: int


def _arrays(built: Any, what: str) -> tuple[Any, Any]:
    """(features, labels) from what a data builder returned, or a WorkerError that says what it must return."""
    if isinstance(built, (tuple, list)) and len(built) == 2 and all(hasattr(a, "shape") for a in built) \
            and len(built[0]) == len(built[1]):
        return built[0], built[1]
    raise WorkerError(f"Task.{what} returned {type(built).__name__}; on the jax backend it must return "
                      "(features, labels), two NumPy arrays of the same length (the runner shards them), not a "
                      "tf.data.Dataset: see docs/worker.md, Keras 3 on JAX")


def _share(task: Task, pair: tuple[Any, Any], group: Group) -> tuple[Any, Any]:
    """Shard "off": the builder took its share already; else this process's contiguous slice, all equal."""
    x, y = pair
    if task.shard == "off":
        return x, y
    each = len(x) // group.size
    part = slice(group.index * each, (group.index + 1) * each)
    return x[part], y[part]


def feeds(task: Task, group: Group, per_replica: int, steps: int | None) -> tuple[Feed, Feed | None]:
    """(train, val): this process's examples and the steps every process takes. Builds each set once."""
    batch = per_replica * group.local_devices

    def context(training: bool) -> DataContext:
        return DataContext(global_batch_size=per_replica * group.devices, per_replica_batch_size=per_replica,
                           num_replicas=group.devices, num_workers=group.size, worker_index=group.index,
                           training=training, input_context=None)

    def feed(what: str, want: int | None) -> Feed:
        x, y = _share(task, _arrays(getattr(task, what)(context(what == "train_data")), what), group)
        counts = group.gather(len(x)) if task.shard == "off" else [len(x)] * group.size
        have = min(counts) // batch
        if have < 1:
            raise WorkerError(f"{what}: {counts} examples per task do not fill one batch of {batch} "
                              f"({per_replica}/replica x {group.local_devices} devices); lower "
                              "--batch-size-per-replica" + (" (fewer files than tasks?)" if min(counts) == 0 else ""))
        taken = min(have, want) if want else have
        return Feed(x=x[:taken * batch], y=y[:taken * batch], batch=batch, steps=taken)

    train = feed("train_data", first_set(steps, task.steps_per_epoch, default=None))
    val = feed("val_data", task.validation_steps) if task.val_data is not None else None
    return train, val
