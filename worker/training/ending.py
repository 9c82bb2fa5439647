"""The end of the built-in runner's training on either backend: the weights and the model saved (the chief's
model whole, by a rename), and the summary the task reports."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Any, Callable, TypedDict

from worker.host import layout
from worker.host.protocol import ProgressState
from worker.training.checkpoints import NOTHING_LEFT
from worker.training.config import RunConfig
from worker.training.lines import say
from worker.training.progress import ProgressWriter

if TYPE_CHECKING:
    from worker.training.keras_progress import ProgressCallbackLike


class Saved(TypedDict):
    """What `finish` saved: the model's path (the chief's, else None), the weights' (--save-weights, else None),
    and how long fit took past its last epoch's end."""

    model_path: str | None
    weights_path: str | None
    fit_tail_s: float


class Trained(TypedDict, total=False):
    """What only a run that trained reports."""

    steps_per_epoch: int
    global_batch_size: int
    replicas: int


class Summary(Saved, Trained):
    """What a runner's `run` returns."""

    history: dict[str, list[float]]  # Keras' History.history: each metric's value per epoch
    task: int


# Any (here and below): a Keras model (tf_keras and keras have no types)
def finish(config: RunConfig, model: Any, task_id: int, progress: ProgressCallbackLike, started: float,
           save: Callable[[], str | None]) -> Saved:
    """After fit (either backend): how long fit took past its last epoch's end, the weights where --save-weights
    says, the model by `save()` (the chief's path, or None), progress done; the summary's paths and tail."""
    returned = time.time()
    tail = returned - progress.last_epoch_end if progress.last_epoch_end else 0.0
    say(f"fit returned {tail:.2f}s after the last epoch end")
    weights_path = None
    if config.save_weights:
        weights_path = save_weights(model, config.save_weights.replace("{task}", str(task_id)))
    model_path = save()
    progress.mark_done()
    say(f"done: fit took {returned - started:.1f}s" + (f"; model saved to {model_path}" if model_path else ""))
    return {"model_path": model_path, "weights_path": weights_path, "fit_tail_s": tail}


def nothing_left(writer: ProgressWriter, task_id: int, epochs: int) -> Summary:
    """A restart of a run whose training ended (a crash after every task saved): done, with nothing trained."""
    say(NOTHING_LEFT)
    writer.update(force=True, state=str(ProgressState.DONE), epochs=epochs, epoch=epochs)
    return {"history": {}, "model_path": None, "weights_path": None, "fit_tail_s": 0.0, "task": task_id}


def save_weights(model: Any, path: str) -> str:
    """The model's weights as an .npz (arr_0, arr_1, ... in `model.get_weights()` order)."""
    import numpy as np

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.savez(path, *model.get_weights())
    return path


def save_model(model: Any, model_dir: str, chief: bool | None = None) -> str | None:
    """The chief writes `<model_dir>/model.keras` (atomically); other workers must take part
    in the save too (TensorFlow reads distributed variables collectively), so they write to a
    temporary folder that is deleted at once. Returns the chief's path, else None.
    `chief` defaults to what TF_CONFIG says."""
    if chief is None:
        from worker.tensorflow.strategy import cluster_from_env

        chief = cluster_from_env().is_chief
    if not chief:
        scratch = tempfile.mkdtemp(prefix="mgpu-model-")
        try:
            model.save(os.path.join(scratch, layout.MODEL))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return None
    os.makedirs(model_dir, exist_ok=True)
    final = os.path.join(model_dir, layout.MODEL)
    partial = os.path.join(model_dir, f".model-{os.getpid()}.partial.keras")
    model.save(partial)
    os.replace(partial, final)
    return final
