"""The digits example on Keras 3 (`[training] backend = "jax"`): the same images, split and model as
worker.examples.digits, built with `keras` (Keras 3, not tf_keras) and given as NumPy arrays (the jax runner
shards them itself).

`KERAS_BACKEND=jax python -m worker --entrypoint worker.examples.digits_keras3:task`
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from worker.training.entrypoint import DataContext, Task
from worker.examples import digits
from worker.examples.digits import load

if TYPE_CHECKING:
    from worker.examples.digits import Split


def build_model() -> Any:  # Any: a Keras 3 model (keras has no types)
    import keras

    return digits.build_model(keras)


def task() -> Task:
    (x_train, y_train), (x_test, y_test) = load()

    def train_data(ctx: DataContext) -> Split:
        return x_train, y_train

    def val_data(ctx: DataContext) -> Split:
        return x_test, y_test

    return Task(model=build_model, train_data=train_data, val_data=val_data,
                epochs=5, batch_size_per_replica=32, learning_rate=0.002)
