"""MobileNetV2 fine-tuning on an image folder (`<data>/<class name>/<image>`), as in the seeds.

The folder is indexed with `keras.utils.image_dataset_from_directory` (its formats, class
order and validation split); each worker then reads and decodes only its own share of the
files (file-level sharding, Task(shard="off")). Settings, each a `task()` argument or an
environment variable:
  data          MGPU_DATA         the folder (required)
  image_size    MGPU_IMAGE_SIZE   square input size in pixels (default 160)
  alpha         MGPU_ALPHA        MobileNetV2 width multiplier (default 1.0)
  weights       MGPU_WEIGHTS      "imagenet" (default; downloaded once per host) or "none"
  val_fraction  MGPU_VAL_FRACTION share of the files kept for validation (default 0.2)
"""

from __future__ import annotations

import os
from typing import Any

from worker.training.entrypoint import DataContext, Task, WorkerError

SEED = 1234


def index(folder: str, val_fraction: float, subset: str | None) -> tuple[list[str], list[int], list[str]]:
    """(file paths, labels, class names) of a folder split, without decoding any image."""
    from worker.tensorflow.strategy import import_keras

    keras = import_keras()
    split = {"validation_split": val_fraction, "subset": subset} if subset else {}
    listing = keras.utils.image_dataset_from_directory(
        folder, batch_size=None, shuffle=True, seed=SEED, **split)
    classes = list(listing.class_names)
    paths = list(listing.file_paths)
    labels = [classes.index(os.path.basename(os.path.dirname(p))) for p in paths]
    return paths, labels, classes


# Any (here and below): TensorFlow's datasets and tensors and a tf_keras model, which have no types
def files_dataset(ctx: DataContext, paths: list[str], labels: list[int], image_size: int) -> Any:
    """This worker's share of the files, decoded to (image_size, image_size, 3) float32."""
    import tensorflow as tf

    def load(path: Any, label: Any) -> tuple[Any, Any]:
        image = tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False)
        image = tf.image.resize(image, (image_size, image_size))
        return image, label

    files = ctx.shard(tf.data.Dataset.from_tensor_slices((paths, labels)))
    return files.map(load, num_parallel_calls=4)


def build_model(classes: int, image_size: int, alpha: float, weights: str | None) -> Any:
    from worker.tensorflow.strategy import import_keras

    keras = import_keras()
    layers = keras.layers
    base = keras.applications.MobileNetV2(
        input_shape=(image_size, image_size, 3), alpha=alpha, include_top=False,
        weights=weights)
    base.trainable = True  # fine-tuning, not only the head
    inputs = keras.Input(shape=(image_size, image_size, 3))
    x = layers.Rescaling(1 / 127.5, offset=-1)(inputs)  # MobileNetV2's [-1, 1] input
    x = base(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(0.2)(x)
    outputs = layers.Dense(classes, activation="softmax", dtype="float32")(x)
    return keras.Model(inputs, outputs)


def task(data: str | None = None, image_size: int | None = None, alpha: float | None = None,
         weights: str | None = None, val_fraction: float | None = None) -> Task:
    env = os.environ
    data = data or env.get("MGPU_DATA")
    if not data:
        raise WorkerError("images: give the image folder as MGPU_DATA (or task(data=...))")
    image_size = int(image_size or env.get("MGPU_IMAGE_SIZE", "160"))
    alpha = float(alpha or env.get("MGPU_ALPHA", "1.0"))
    weights = weights or env.get("MGPU_WEIGHTS", "imagenet")
    weights = None if weights.lower() == "none" else weights
    if val_fraction is None:
        val_fraction = float(env.get("MGPU_VAL_FRACTION", 0.2))

    if val_fraction > 0:
        train_files = index(data, val_fraction, "training")
        val_files = index(data, val_fraction, "validation")
    else:
        train_files, val_files = index(data, 0, None), None
    classes = len(train_files[2])

    def train_data(ctx: DataContext) -> Any:
        return files_dataset(ctx, train_files[0], train_files[1], image_size)

    def val_data(ctx: DataContext) -> Any:
        assert val_files is not None  # given to the Task only where there are validation files
        return files_dataset(ctx, val_files[0], val_files[1], image_size)

    return Task(model=lambda: build_model(classes, image_size, alpha, weights),
                train_data=train_data, val_data=val_data if val_files else None,
                shard="off", cache=False, shuffle_buffer=1024, epochs=5,
                batch_size_per_replica=16, learning_rate=0.0001)
