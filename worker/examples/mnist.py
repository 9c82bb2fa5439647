"""The seeds' CNN on MNIST (28x28 grey digits, 10 classes).

Data: `task(data=PATH)` or MGPU_DATA=PATH, an .npz with x_train, y_train, x_test, y_test in
the layout of `keras.datasets.mnist.load_data()`; neither given -> that loader (downloads
mnist.npz once into ~/.keras/datasets on each host).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from worker.training.entrypoint import DataContext, Task

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from worker.examples.digits import Split


def load(data: str | None = None) -> tuple[Split, Split]:
    """((x_train, y_train), (x_test, y_test)) with images as (N, 28, 28, 1) float32 in [0, 1]."""
    import numpy as np

    if data:
        with np.load(data) as arrays:
            (x_train, y_train), (x_test, y_test) = ((arrays["x_train"], arrays["y_train"]),
                                                    (arrays["x_test"], arrays["y_test"]))
    else:
        from worker.tensorflow.strategy import import_keras

        (x_train, y_train), (x_test, y_test) = import_keras().datasets.mnist.load_data()

    def images(x: NDArray[np.generic]) -> NDArray[np.float32]:
        return (x.astype(np.float32) / 255.0).reshape((-1, 28, 28, 1))

    return ((images(x_train), y_train.astype(np.int64)),
            (images(x_test), y_test.astype(np.int64)))


def build_model() -> Any:  # Any: a tf_keras model (tf_keras has no types)
    from worker.tensorflow.strategy import import_keras

    keras = import_keras()
    layers = keras.layers
    return keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        layers.Conv2D(32, 3, activation="relu"),
        layers.MaxPooling2D(),
        layers.Flatten(),
        layers.Dense(64, activation="relu"),
        layers.Dense(10, activation="softmax", dtype="float32"),
    ])


def task(data: str | None = None) -> Task:
    (x_train, y_train), (x_test, y_test) = load(data or os.environ.get("MGPU_DATA"))

    def train_data(ctx: DataContext) -> Any:  # Any: a tf.data.Dataset (TensorFlow has no types)
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices((x_train, y_train))

    def val_data(ctx: DataContext) -> Any:
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices((x_test, y_test))

    return Task(model=build_model, train_data=train_data, val_data=val_data,
                epochs=5, batch_size_per_replica=64, learning_rate=0.001)
