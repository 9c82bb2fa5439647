"""A training script of your own for `command = [...]`, using worker's helpers.

Run it on every task, as the seeds do (TF_CONFIG names the cluster and this task):
    TF_CONFIG='{"cluster": {"worker": ["host1:20000", "host2:20000"]},
                "task": {"type": "worker", "index": 0}}' python custom_script.py
or in cluster.toml: command = ["python", "-m", "worker.examples.custom_script"].
Settings from the environment: EPOCHS (default 5), BATCH_SIZE_PER_REPLICA (32),
LEARNING_RATE (0.002), MODEL_DIR (default: the run folder, else ./), CHECKPOINT_DIR.
"""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # before TensorFlow: Keras 2 (tf-keras)

from worker import (ProgressCallback, dataset_options, import_keras, is_chief, save_model,
                    strategy_from_env)
from worker.examples.digits import build_model, load

keras = import_keras()
import tensorflow as tf  # noqa: E402

EPOCHS = int(os.environ.get("EPOCHS", 5))
BATCH_SIZE_PER_REPLICA = int(os.environ.get("BATCH_SIZE_PER_REPLICA", 32))
LEARNING_RATE = float(os.environ.get("LEARNING_RATE", 0.002))
RUN_FOLDER = os.path.dirname(os.environ["MGPU_RUN_DIR"]) if os.environ.get("MGPU_RUN_DIR") \
    else os.getcwd()
MODEL_DIR = os.environ.get("MODEL_DIR", RUN_FOLDER)
CHECKPOINT_DIR = os.environ.get("CHECKPOINT_DIR", os.path.join(RUN_FOLDER, "checkpoint"))

# 1. Strategy from TF_CONFIG: MultiWorkerMirroredStrategy for several workers (first, before
#    TensorFlow runs any op), MirroredStrategy over local GPUs for one, else the default.
strategy = strategy_from_env()
print(f"replicas in sync: {strategy.num_replicas_in_sync}, chief: {is_chief()}", flush=True)
GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync

# 2. Data: global batches, sharded by data across workers (same shuffle seed everywhere),
#    autotune off with a fixed prefetch so that fit returns promptly.
(x_train, y_train), (x_test, y_test) = load()
options = dataset_options("data")
ds_train = (tf.data.Dataset.from_tensor_slices((x_train, y_train)).cache()
            .shuffle(2000, seed=1).batch(GLOBAL_BATCH_SIZE, drop_remainder=True).repeat()
            .prefetch(2).with_options(options))
ds_test = (tf.data.Dataset.from_tensor_slices((x_test, y_test)).cache()
           .batch(GLOBAL_BATCH_SIZE).prefetch(2).with_options(options))
STEPS_PER_EPOCH = len(x_train) // GLOBAL_BATCH_SIZE

# 3. Model and optimizer inside the strategy's scope; learning rate scaled by the replicas.
with strategy.scope():
    model = build_model()
    model.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE * strategy.num_replicas_in_sync),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])

# 4. fit: BackupAndRestore resumes a restarted group; ProgressCallback writes progress.json
#    into MGPU_RUN_DIR (the launcher's heartbeat) and prints one line per epoch.
callbacks = [keras.callbacks.BackupAndRestore(backup_dir=CHECKPOINT_DIR),
             ProgressCallback(global_batch_size=GLOBAL_BATCH_SIZE)]
model.fit(ds_train, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH, validation_data=ds_test,
          callbacks=callbacks, verbose=0)

# 5. Every worker takes part in the save; only the chief's model.keras remains.
path = save_model(model, MODEL_DIR)
if path:
    print(f"model saved to {path}", flush=True)
