"""An entrypoint's contract: `module:function` returns a `Task`; its data builders get a `DataContext`.

No TensorFlow import here (the examples import this module at no cost). `python -m worker.training.entrypoint
MODULE:FUNCTION [BACKEND]` imports an entrypoint as the runner would and says what became of it (the preflight's
check; on jax, with what its train_data returns).
"""

from __future__ import annotations

import importlib
import json
import os
import site
import sys
import sysconfig
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypedDict, TypeVar

from worker.training.errors import WorkerError
from worker.host import env
from worker.tensorflow.strategy import SHARD_POLICIES

__all__ = ["DataContext", "EntrypointError", "Task", "WorkerError", "first_set", "load_entrypoint",
           "resolve_entrypoint"]


class EntrypointError(WorkerError):
    """The entrypoint cannot be imported, called, or returned something that is not a Task; `reason`: the
    message less its "entrypoint 'x':" (the preflight names the entrypoint itself)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


@dataclass
class DataContext:
    """What a dataset builder is told about the input pipeline it feeds."""

    global_batch_size: int  # per-replica batch x replicas in sync
    per_replica_batch_size: int
    num_replicas: int  # replicas in sync over all workers
    num_workers: int  # input pipelines: one per worker
    worker_index: int  # this worker's input pipeline id (0 = chief)
    training: bool  # True for train_data, False for val_data
    input_context: Any  # the tf.distribute.InputContext of this worker

    def shard(self, dataset: Any) -> Any:  # Any: a tf.data.Dataset (TensorFlow has no types)
        """This worker's share of `dataset` (for Task(shard="off"), e.g. a list of files)."""
        return dataset.shard(self.num_workers, self.worker_index)


@dataclass
class Task:
    """What an entrypoint function returns; the runner does sharding, batching and `fit`.

    model: builds the *uncompiled* Keras model; called inside `strategy.scope()`.
    train_data / val_data: `(DataContext) -> tf.data.Dataset` of single, *unbatched*
        `(features, label)` examples; the runner caches, shuffles, batches and prefetches.
    shard: "data" (in-memory data: every worker builds it all, keeps 1/N: AutoShardPolicy.DATA),
        "file" (a file-reading pipeline such as TFRecordDataset over a file list:
        AutoShardPolicy.FILE), "off" (the builder already took `ctx.shard(...)` of its files).
    optimizer: a Keras optimizer name, or `(learning_rate) -> optimizer`.
    The remaining fields are defaults that command-line flags override.
    """

    model: Callable[[], Any]
    train_data: Callable[[DataContext], Any]
    val_data: Callable[[DataContext], Any] | None = None
    loss: Any = "sparse_categorical_crossentropy"
    metrics: Sequence[Any] = ("accuracy",)
    optimizer: str | Callable[[Any], Any] = "adam"
    epochs: int | None = None
    batch_size_per_replica: int | None = None
    learning_rate: float | None = None
    steps_per_epoch: int | None = None  # default: examples // global batch
    checkpoint_every_steps: int | None = None  # default: a checkpoint at each epoch end only
    validation_steps: int | None = None  # default: the whole validation set
    shard: str = "data"
    cache: bool = True  # cache the examples in memory before shuffling
    shuffle_buffer: int = 10_000
    prefetch: int = 2  # batches; fixed, as tf.data autotune is off (strategy.dataset_options)
    warmup_epochs: float = 1.0  # linear warm-up to the scaled learning rate
    seed: int = 1234  # shuffle and initialisation seed, the same on every worker
    callbacks: Sequence[Any] | Callable[[], Sequence[Any]] = ()  # extra Keras callbacks

    def __post_init__(self) -> None:
        if self.shard not in SHARD_POLICIES:
            raise ValueError(f"Task.shard must be one of {SHARD_POLICIES}, not {self.shard!r}")
        if self.checkpoint_every_steps is not None and self.checkpoint_every_steps < 1:
            raise ValueError("Task.checkpoint_every_steps must be at least 1 (or None)")


def resolve_entrypoint(spec: str) -> Callable[[], object]:
    """Imports `module:function` (the current directory importable); returns the function."""
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise EntrypointError(f"entrypoint {spec!r} must look like 'module:function'",
                              "it must look like 'module:function'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EntrypointError(f"entrypoint {spec!r}: cannot import {module_name!r}: {exc}") from exc
    func: object = getattr(module, func_name, None)
    if not callable(func):
        reason = f"module {module_name!r} has no function {func_name!r}"
        raise EntrypointError(f"entrypoint {spec!r}: {reason}", reason)
    return func


def load_entrypoint(spec: str, func: Callable[[], object] | None = None) -> Task:
    """Calls the entrypoint function; a returned dict is taken as Task(**dict)."""
    task = (func or resolve_entrypoint(spec))()
    if isinstance(task, dict):
        try:
            task = Task(**task)
        except TypeError as exc:
            raise EntrypointError(f"entrypoint {spec!r} returned a dict that is no Task: "
                                  f"{exc}") from None
    if not isinstance(task, Task):
        raise EntrypointError(f"entrypoint {spec!r} returned {type(task).__name__}, "
                              "not a worker.Task")
    return task


T = TypeVar("T")


def first_set(*values: T | None, default: T) -> T:
    """The first value that is not None, else `default`."""
    for value in values:
        if value is not None:
            return value
    return default


def not_users() -> tuple[str, ...]:
    """The folders whose files are not the user's own: the standard library, installed packages, ours."""
    paths = sysconfig.get_paths()
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)}
    found |= set(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    found |= {site.getusersitepackages(), os.path.join(ours, "worker"), os.path.join(ours, "launcher")}
    return tuple(os.path.realpath(f) + os.sep for f in found if f)


def users_frame(exc: BaseException) -> str | None:
    """`file:line` of the innermost frame in the user's own files (relative to the current folder when
    under it), not in the standard library, installed packages or ours; None when there is none."""
    skip = not_users()
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if not frame.filename or frame.filename.startswith("<") or not os.path.isabs(frame.filename):
            continue
        path = os.path.realpath(frame.filename)
        if path.startswith(skip):
            continue
        shown = os.path.relpath(path)
        return f"{path if shown.startswith('..') else shown}:{frame.lineno}"
    return None


JAX_DATA = "the jax backend needs (features, labels), two NumPy arrays of one length"


def features_labels(built: Any) -> bool:
    """What a data builder returned is what the jax backend takes: (features, labels), arrays of one length."""
    return (isinstance(built, (tuple, list)) and len(built) == 2 and all(hasattr(a, "shape") for a in built)
            and len(built[0]) == len(built[1]))


def returned(built: Any) -> str:
    """A returned value's type as a reader knows it (`tf.data.Dataset` for TensorFlow's datasets)."""
    kind = type(built)
    dataset = any(c.__module__.startswith("tensorflow") and c.__name__ == "DatasetV2" for c in kind.__mro__)
    return f"{kind.__name__}, a tf.data.Dataset" if dataset else f"{kind.__module__}.{kind.__qualname__}"


def data_problem(spec: str, func: Callable[[], object]) -> str | None:
    """On the jax backend: the entrypoint called, and its Task's train_data, as the runner will (nothing trains);
    what they returned against what the backend takes."""
    from worker.training import entrypoint as contract  # its Task, also where this module runs as __main__

    task = contract.load_entrypoint(spec, func)
    n, index = int(os.environ.get(env.NUM_WORKERS) or 1), int(os.environ.get(env.TASK_INDEX) or 0)
    built = task.train_data(contract.DataContext(global_batch_size=n, per_replica_batch_size=1, num_replicas=n,
                                                 num_workers=n, worker_index=index, training=True, input_context=None))
    if features_labels(built):
        return None
    return (f"Task.train_data returned {returned(built)}; {JAX_DATA}: return those, or set [training] "
            'backend = "tensorflow"')


class ImportReport(TypedDict, total=False):
    """`import_report`'s answer, one JSON line on stdout (the preflight reads it)."""

    ok: bool
    error: str | None
    raised: bool
    where: str | None
    during: str


def import_report(spec: str, backend: str = "tensorflow") -> ImportReport:
    """Import the entrypoint as the runner does: {"ok": true}, or what went wrong ("error"), whether the module
    raised it ("raised"), the user's own line where it did ("where", file:line) and whether it was at import or
    when called ("during"). On the jax backend, the entrypoint is also called, and its Task's train_data
    (data_problem)."""
    during = "import"
    try:
        func = resolve_entrypoint(spec)
        during = "call"
        problem = data_problem(spec, func) if backend == "jax" else None
        return {"ok": False, "error": problem, "raised": False} if problem else {"ok": True}
    except EntrypointError as exc:
        if exc.__cause__ is None:
            return {"ok": False, "error": exc.reason, "raised": False}
        raised: BaseException = exc.__cause__  # the ImportError itself: where the user's module imports it
    except BaseException as exc:  # whatever the module raised at import (SystemExit and KeyboardInterrupt too)
        raised = exc
    return {"ok": False, "error": f"{type(raised).__name__}: {raised}".strip().rstrip(":"), "raised": True,
            "where": users_frame(raised), "during": during}


def main(argv: list[str] | None = None) -> None:
    """One JSON line on stdout; what the module prints while imported goes to stderr. Ends the process (a
    module may leave threads behind)."""
    args = sys.argv[1:] if argv is None else argv
    report = os.dup(1)
    os.dup2(2, 1)
    result: ImportReport = (import_report(*args) if len(args) in (1, 2)
              else {"ok": False, "error": "give MODULE:FUNCTION [BACKEND]"})
    sys.stdout.flush()
    os.write(report, (json.dumps(result) + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main()
