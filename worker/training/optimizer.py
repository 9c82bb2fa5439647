"""The optimizer a Task trains with, and its learning rate scaled by the replicas in sync (either backend)."""

from __future__ import annotations

from typing import Any

from worker.training.entrypoint import Task


# Any: the Keras module, its optimizers and schedules (tf_keras and keras have no types)
def build_optimizer(keras: Any, task: Task, learning_rate: float | Any) -> Any:
    if callable(task.optimizer):
        return task.optimizer(learning_rate)
    return keras.optimizers.get({"class_name": task.optimizer,
                                 "config": {"learning_rate": learning_rate}})


def learning_rate_for(keras: Any, base: float, replicas: int, scale: bool, warmup_steps: int) -> float | Any:
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
