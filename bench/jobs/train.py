#!/usr/bin/env python3
"""Bench job: a fixed number of Keras `fit` steps on random data; reads TF_CONFIG itself.

    python bench/jobs/train.py --model mnist|convnet [--batch 64] [--steps 60] [--warmup 10]
        [--threads 1] [--bytes-per-pack N] [--fp16-grads]

One task -> the default strategy; several (TF_CONFIG) -> MultiWorkerMirroredStrategy (ring
all-reduce over gRPC). Samples/s is measured inside the worker over the steady-state steps
after `--warmup` and printed, with timings, as one line `BENCH {json}` (parsed by the bench package).
`run(args)` is also what ray_peer.py (beside it) calls inside Ray Train's workers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

T_START = time.time()
MARK = "BENCH "


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("mnist", "convnet"), default="mnist")
    p.add_argument("--batch", type=int, default=64, help="per-replica batch size")
    p.add_argument("--steps", type=int, default=60, help="training steps in all (warm-up included)")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of samples/s")
    p.add_argument("--threads", type=int, default=0, help="intra- and inter-op threads (0: TensorFlow's default)")
    p.add_argument("--bytes-per-pack", type=int, default=0,
                   help="CommunicationOptions(bytes_per_pack): split the gradients into packs of this size "
                        "(0: TensorFlow's default, one all-reduce for all)")
    p.add_argument("--fp16-grads", action="store_true", help="all-reduce the gradients as float16")
    p.add_argument("--manual-reduce", action="store_true",
                   help="all-reduce the gradients in our own train_step (what --fp16-grads uses) in float32")
    p.add_argument("--no-sync", action="store_true",
                   help="ignore TF_CONFIG: train alone, no all-reduce (the ceiling of data parallelism)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        p.error("need 0 <= --warmup < --steps")
    return args


def build_model(keras, name: str):
    layers = keras.layers
    if name == "mnist":
        # The seeds' CNN: Conv2D(32, 3) -> Flatten -> Dense(64) -> Dense(10); 1.39 M parameters,
        # almost all in the Dense(64) kernel: 5.5 MB of float32 gradients per step.
        return keras.Sequential([
            keras.Input(shape=(28, 28, 1)),
            layers.Conv2D(32, 3, activation="relu"),
            layers.Flatten(),
            layers.Dense(64, activation="relu"),
            layers.Dense(10, activation="softmax"),
        ])
    # Compute-bound: three 3x3 convolutions at full resolution, global pooling; 57 k parameters.
    return keras.Sequential([
        keras.Input(shape=(32, 32, 3)),
        layers.Conv2D(32, 3, padding="same", activation="relu"),
        layers.Conv2D(64, 3, padding="same", activation="relu"),
        layers.Conv2D(64, 3, padding="same", activation="relu"),
        layers.GlobalAveragePooling2D(),
        layers.Dense(10, activation="softmax"),
    ])


def input_shape(name: str) -> tuple[int, ...]:
    return (28, 28, 1) if name == "mnist" else (32, 32, 3)


def num_workers() -> int:
    try:
        return max(1, len(json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {}).get("worker", [])))
    except ValueError:
        return 1


def write_progress(data: dict) -> None:
    """progress.json in MGPU_RUN_DIR (set by mgpu-cluster): the launcher's heartbeat."""
    folder = os.environ.get("MGPU_RUN_DIR")
    if not folder:
        return
    path = os.path.join(folder, "progress.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> dict:
    os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow: Keras 3 cannot fit under MWMS
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    import tf_keras as keras

    t_imported = time.time()
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    workers = 1 if args.no_sync else num_workers()
    comm = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=args.bytes_per_pack,
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    if workers > 1:
        from worker.tensorflow.strategy import cluster_from_env, quiet_device_datasets, wait_for_chief

        # Neither is what is measured: tf.data autotune's random ~3 s stall at the end of `fit`, and
        # TensorFlow's 1 s retry when a worker asks before the chief is up.
        quiet_device_datasets()
        wait_for_chief(cluster_from_env())
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm)
    else:
        strategy = tf.distribute.get_strategy()
    replicas = strategy.num_replicas_in_sync
    global_batch = args.batch * replicas

    rng = np.random.default_rng(args.seed)
    x = rng.random((args.batch, *input_shape(args.model)), dtype=np.float32)
    y = rng.integers(0, 10, size=(args.batch,)).astype(np.int64)

    def dataset_fn(ctx):
        # One fixed per-replica batch, repeated: the input pipeline costs nothing, only the
        # model's compute and the all-reduce are measured.
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        options = tf.data.Options()
        options.autotune.enabled = False
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        return ds.with_options(options)

    fp16 = args.fp16_grads and workers > 1
    manual = (args.fp16_grads or args.manual_reduce) and workers > 1
    grad_dtype = tf.float16 if fp16 else tf.float32

    class Model(keras.Sequential):
        def train_step(self, data):
            if not manual:
                return super().train_step(data)
            xb, yb = data
            with tf.GradientTape() as tape:
                pred = self(xb, training=True)
                loss = self.compiled_loss(yb, pred, regularization_losses=self.losses)
            grads = tape.gradient(loss, self.trainable_variables)
            # fp16: all-reduce half the bytes; the sum is cast back to the variables' float32.
            wire = [tf.cast(g, grad_dtype) for g in grads]
            summed = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, wire, options=comm)
            grads = [tf.cast(g, v.dtype) for g, v in zip(summed, self.trainable_variables)]
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables), skip_gradients_aggregation=True)
            self.compiled_metrics.update_state(yb, pred)
            return {m.name: m.result() for m in self.metrics}

    with strategy.scope():
        base = build_model(keras, args.model)
        model = Model(base.layers)
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy())
    dist = strategy.distribute_datasets_from_function(dataset_fn)

    times: list[float] = []
    task = int(os.environ.get("MGPU_TASK_INDEX", json.loads(os.environ.get("TF_CONFIG") or "{}")
                              .get("task", {}).get("index", 0)))

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            now = time.time()
            times.append(now)
            if len(times) == 1:
                print("BENCH-READY first step done", flush=True)  # bench/failure.py waits for this line
            if len(times) == 1 or len(times) % 10 == 0 or len(times) == args.steps:
                write_progress({"state": "training", "epoch": 1, "epochs": 1, "step": len(times),
                                "global_step": len(times), "steps_per_epoch": args.steps, "time": now})

    t_fit = time.time()
    model.fit(dist, epochs=1, steps_per_epoch=args.steps, verbose=0, callbacks=[Clock()])
    t_done = time.time()
    steady = times[args.warmup:] if args.warmup else [t_fit, *times]
    span = steady[-1] - steady[0]
    step_s = sorted(b - a for a, b in zip(steady, steady[1:]))
    result = {
        "task": task, "workers": workers, "replicas": replicas, "model": args.model,
        "params": int(model.count_params()), "batch": args.batch, "global_batch": global_batch,
        "steps": args.steps, "warmup": args.warmup, "threads": args.threads,
        "bytes_per_pack": args.bytes_per_pack, "fp16_grads": fp16, "manual_reduce": manual,
        "no_sync": args.no_sync,
        "samples_per_sec": round((len(steady) - 1) * global_batch / span, 2) if span > 0 else None,
        "step_ms_median": round(1000 * step_s[len(step_s) // 2], 2) if step_s else None,
        "step_ms_p10": round(1000 * step_s[len(step_s) // 10], 2) if step_s else None,
        "step_ms_p90": round(1000 * step_s[len(step_s) * 9 // 10], 2) if step_s else None,
        "import_s": round(t_imported - T_START, 3), "setup_s": round(t_fit - t_imported, 3),
        "first_step_s": round(times[0] - t_fit, 3), "fit_s": round(t_done - t_fit, 3),
        "start": T_START, "end": t_done,
    }
    write_progress({"state": "done", "epoch": 1, "epochs": 1, "step": args.steps, "global_step": args.steps,
                    "samples_per_sec": result["samples_per_sec"], "time": t_done})
    print(MARK + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    run(parse_args())
    sys.stdout.flush()
    # MWMS may keep gRPC threads (and tf.data autotune threads) alive past fit; don't wait on them.
    os._exit(0)
