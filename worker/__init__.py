"""The worker side of mgpu-cluster: `python -m worker` trains one model over all tasks.

Also a small library for scripts started with `command = [...]`: `strategy_from_env`,
`dataset_options`, `ProgressCallback`, `is_chief`, `save_model`, `import_keras`.
Importing this package does not import TensorFlow (the launcher's supervisor imports it).
"""

from worker.progress import ProgressWriter, read_progress
from worker.runner import DataContext, RunConfig, Task, WorkerError, run, save_model
from worker.strategy import (
    ClusterInfo,
    cluster_from_env,
    dataset_options,
    import_keras,
    import_tensorflow,
    is_chief,
    set_mixed_precision,
    strategy_from_env,
)

__all__ = [
    "ClusterInfo", "DataContext", "ProgressCallback", "ProgressWriter", "RunConfig", "Task",
    "WorkerError", "cluster_from_env", "dataset_options", "import_keras", "import_tensorflow",
    "is_chief", "read_progress", "run", "save_model", "set_mixed_precision", "strategy_from_env",
]


def __getattr__(name: str):
    if name == "ProgressCallback":  # a Keras class: built (and TensorFlow imported) on first use
        from worker import progress

        return progress.ProgressCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
