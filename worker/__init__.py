"""The worker side of mgpu-cluster: `python -m worker` trains one model over all tasks.

Also a small library for scripts started with `command = [...]`: `strategy_from_env`,
`dataset_options`, `ProgressCallback`, `is_chief`, `save_model`, `import_keras`.
Importing this package does not import TensorFlow (the launcher's supervisor imports it).
"""

import importlib
from typing import Any

# Where each public name lives. Resolved on first use, so that the supervisor and the
# launcher, which import only submodules, do not pay for the runner and strategy modules.
_HOME = {
    "ProgressWriter": "training.progress", "read_progress": "training.progress",
    "ProgressCallback": "training.keras_progress", "DataContext": "training.entrypoint", "RunConfig": "training.config",
    "Task": "training.entrypoint", "WorkerError": "training.entrypoint", "run": "tensorflow.runner",
    "save_model": "training.ending", "ClusterInfo": "tensorflow.strategy", "cluster_from_env": "tensorflow.strategy",
    "dataset_options": "tensorflow.strategy", "import_keras": "tensorflow.strategy",
    "import_tensorflow": "tensorflow.strategy", "is_chief": "tensorflow.strategy",
    "set_mixed_precision": "tensorflow.strategy", "strategy_from_env": "tensorflow.strategy",
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:  # Any: the object named, of its own type (importlib hands it over untyped)
    # ProgressCallback is a Keras class: built (and TensorFlow imported) on first use.
    if name in _HOME:
        return getattr(importlib.import_module(f"worker.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
