"""The built-in runner's settings on either backend: its options (RunConfig, from `python -m worker`), the values
it trains with (the options', else the Task's, else ours), and its folders (the model's, the checkpoint's, with
an earlier run's checkpoint adopted for --resume)."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Sequence

from worker.host import layout
from worker.training.entrypoint import Task, first_set
from worker.training.lines import say

DEFAULT_EPOCHS = 1
DEFAULT_BATCH_SIZE_PER_REPLICA = 64
DEFAULT_LEARNING_RATE = 0.001


@dataclass
class RunConfig:
    """The runner's settings; None means: the Task's value, else the runner's default."""

    entrypoint: str
    epochs: int | None = None
    steps_per_epoch: int | None = None
    batch_size_per_replica: int | None = None
    learning_rate: float | None = None
    scale_learning_rate: bool = True
    checkpoint_dir: str | None = None
    resume_from: str | None = None  # an earlier run's checkpoint folder, adopted when this run has none
    resume_run: str | None = None  # the run whose backup this run may start from (`up --resume RUN`)
    checkpoint_every_steps: int | None = None
    tensorboard: str | None = None
    mixed_precision: bool = False
    model_dir: str | None = None
    run_dir: str | None = None
    save_weights: str | None = None
    collective: str = "auto"
    devices: Sequence[str] | None = None  # one worker: MirroredStrategy over these
    local_replicas: int | None = None  # replicas per worker on a CPU host (logical CPU devices)


def settings(config: RunConfig, task: Task) -> tuple[int, int, float]:
    """Epochs, batch size per replica and base learning rate: the config's, else the Task's, else ours."""
    epochs = int(first_set(config.epochs, task.epochs, default=DEFAULT_EPOCHS))
    per_replica = int(first_set(config.batch_size_per_replica, task.batch_size_per_replica,
                               default=DEFAULT_BATCH_SIZE_PER_REPLICA))
    base_lr = float(first_set(config.learning_rate, task.learning_rate, default=DEFAULT_LEARNING_RATE))
    return epochs, per_replica, base_lr


def default_dirs(run_dir: str | None) -> tuple[str, str]:
    """(model_dir, checkpoint_dir): the run folder (parent of the task folder) or ./."""
    base = os.path.dirname(os.path.abspath(run_dir)) if run_dir else os.getcwd()
    return base, layout.checkpoint_dir(base)


def folders(config: RunConfig, run_dir: str | None) -> tuple[str, str]:
    """(model_dir, checkpoint_dir): the config's, else the defaults; a checkpoint to resume from (--resume-from)
    is adopted into the checkpoint folder first."""
    model_dir, checkpoint_dir = default_dirs(run_dir)
    model_dir, checkpoint_dir = config.model_dir or model_dir, config.checkpoint_dir or checkpoint_dir
    if config.resume_from:
        say(adopt_checkpoint(config.resume_from, checkpoint_dir))
    return model_dir, checkpoint_dir


def adopt_checkpoint(source: str, target: str) -> str:
    """An earlier run's checkpoint (`source`) made this run's own (`target`): its files linked (copied where
    links cannot be made), so that each run keeps its own and the earlier one stays as it was. A target that
    holds files already is left alone (a restart of this run, or another task of this host was first).
    What was done, in words."""
    source, target = os.path.abspath(source), os.path.abspath(target)
    if source == target or os.path.isdir(target) and os.listdir(target):
        return f"resuming from the checkpoint in {target}"
    if not os.path.isdir(source) or not os.listdir(source):
        return f"no checkpoint in {source} (its run stopped before the first was saved): training starts over"

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    os.makedirs(os.path.dirname(target), exist_ok=True)
    temporary = tempfile.mkdtemp(prefix=".adopt-", dir=os.path.dirname(target))
    try:
        shutil.copytree(source, os.path.join(temporary, "c"), symlinks=True, copy_function=link)
        os.rename(os.path.join(temporary, "c"), target)  # whole or not at all; a folder there already wins
    except OSError:
        if not (os.path.isdir(target) and os.listdir(target)):
            raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return f"resuming from the checkpoint of {source} (linked into {target})"
