"""An entrypoint for tests: the digits example (tf_keras, or Keras 3 under KERAS_BACKEND=jax) with a callback,
after the progress callback, that copies the loss and metrics progress.json holds after each batch to
within.jsonl in the task's folder (with MGPU_PROGRESS_INTERVAL=0 every batch is written)."""

import json
import os


def task():
    if os.environ.get("KERAS_BACKEND") == "jax":
        import keras

        from worker.examples.digits_keras3 import task as digits
    else:
        from worker.examples.digits import task as digits
        from worker.tensorflow.strategy import import_keras

        keras = import_keras()
    folder = os.environ["MGPU_RUN_DIR"]

    class Copy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            with open(os.path.join(folder, "progress.json")) as f:
                p = json.load(f)
            with open(os.path.join(folder, "within.jsonl"), "a") as f:
                f.write(json.dumps({k: p.get(k) for k in ("epoch", "step", "loss", "metrics")}) + "\n")

    found = digits()
    found.callbacks = [Copy()]
    return found


def copied_to(folder) -> "Path":
    """Puts this module in `folder` (a local task's workdir) as `within_probe`, for entrypoint within_probe:task."""
    import shutil
    from pathlib import Path

    return Path(shutil.copy(__file__, Path(folder) / "within_probe.py"))


def assert_within_epochs_are_means(task_dir, epochs: int) -> None:
    """Every value a task wrote within an epoch is a mean (accuracy <= 1, the first loss <= ln 10 + a margin), and
    at an epoch's last step it equals the epoch's own (progress.json's epoch_ends)."""
    import math
    from pathlib import Path

    task_dir = Path(task_dir)
    rows = [json.loads(line) for line in (task_dir / "within.jsonl").read_text().splitlines()]
    final = json.loads((task_dir / "progress.json").read_text())
    steps = final["steps_per_epoch"]
    assert rows and rows[0]["loss"] <= math.log(10) + 0.3, rows[0]
    assert all(0 <= r["metrics"]["accuracy"] <= 1 and 0 < r["loss"] < 2 * math.log(10) for r in rows), rows
    ends = {e["epoch"]: e for e in final["epoch_ends"]}
    for epoch in range(1, epochs + 1):
        last = [r for r in rows if r["epoch"] == epoch and r["step"] == steps]
        assert last, (epoch, rows[-3:])
        end = ends[epoch]
        assert math.isclose(last[-1]["loss"], end["loss"], rel_tol=1e-4), (last[-1], end)
        assert math.isclose(last[-1]["metrics"]["accuracy"], end["metrics"]["accuracy"], abs_tol=1e-4), (last[-1], end)
