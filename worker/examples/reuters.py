"""The seeds' text classifier on Reuters newswires: Embedding + Conv1D, 46 topics, maxlen 300.

Data: `task(data=PATH)` or MGPU_DATA=PATH, an .npz with x_train, y_train, x_test, y_test
where x_* hold word-index sequences (an object array of lists, or an int matrix) as
`keras.datasets.reuters.load_data()` returns them; neither given -> that loader (downloads
once into ~/.keras/datasets). The .npz is read with allow_pickle: use only files you trust.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from worker.training.entrypoint import DataContext, Task

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    Split = tuple[NDArray[np.int32], NDArray[np.int64]]  # (word-index sequences, labels)

MAX_LEN = 300


def load(data: str | None = None, maxlen: int = MAX_LEN) -> tuple[Split, Split, int, int]:
    """((x_train, y_train), (x_test, y_test), vocabulary size, number of classes)."""
    import numpy as np

    from worker.tensorflow.strategy import import_keras

    keras = import_keras()
    if data:
        with np.load(data, allow_pickle=True) as arrays:
            (x_train, y_train), (x_test, y_test) = ((arrays["x_train"], arrays["y_train"]),
                                                    (arrays["x_test"], arrays["y_test"]))
    else:
        (x_train, y_train), (x_test, y_test) = keras.datasets.reuters.load_data()
    pad = keras.preprocessing.sequence.pad_sequences
    x_train = pad(list(x_train), maxlen=maxlen).astype(np.int32)
    x_test = pad(list(x_test), maxlen=maxlen).astype(np.int32)
    y_train, y_test = y_train.astype(np.int64), y_test.astype(np.int64)
    words = int(max(x_train.max(), x_test.max())) + 1
    classes = int(max(y_train.max(), y_test.max())) + 1
    return (x_train, y_train), (x_test, y_test), words, classes


def build_model(words: int, classes: int, maxlen: int = MAX_LEN) -> Any:  # Any: a tf_keras model (no types)
    from worker.tensorflow.strategy import import_keras

    keras = import_keras()
    layers = keras.layers
    return keras.Sequential([
        keras.Input(shape=(maxlen,)),
        layers.Embedding(words, 7),
        layers.Conv1D(filters=64, kernel_size=5, activation="relu"),
        layers.MaxPooling1D(2),
        layers.Conv1D(filters=32, kernel_size=3, activation="relu"),
        layers.MaxPooling1D(2),
        layers.Flatten(),
        layers.Dense(classes, activation="softmax", dtype="float32"),
    ])


def task(data: str | None = None) -> Task:
    (x_train, y_train), (x_test, y_test), words, classes = load(
        data or os.environ.get("MGPU_DATA"))

    def train_data(ctx: DataContext) -> Any:  # Any: a tf.data.Dataset (TensorFlow has no types)
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices((x_train, y_train))

    def val_data(ctx: DataContext) -> Any:
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices((x_test, y_test))

    return Task(model=lambda: build_model(words, classes), train_data=train_data,
                val_data=val_data, epochs=10, batch_size_per_replica=32, learning_rate=0.001,
                metrics=("accuracy", "sparse_top_k_categorical_accuracy"))
