"""Cluster facts from TF_CONFIG / MGPU_* and the distribution strategy they call for.

Nothing here imports TensorFlow at import time; `import_tensorflow()` does, after setting
TF_USE_LEGACY_KERAS=1 so that `tf_keras` (Keras 2) is the Keras in use.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from worker.training.errors import SettingError
from worker.training.groupsize import check_workers
from worker.host.clock import wait_until
from worker.host.env import GPU_ALLOCATOR, TASK_INDEX, TF_CONFIG, TF_DATA_AUTOTUNE, tf_defaults

COLLECTIVES = ("auto", "ring", "nccl")
FIX_TF_CONFIG = ("mgpu-cluster sets it for each task; when you set it yourself, give every task the same cluster "
                 "and its own index (or unset it to train in one process)")


@dataclass(frozen=True)
class ClusterInfo:
    """Where this process sits in its cluster (pure data, read from the environment)."""

    workers: tuple[str, ...]  # every task's address, chief first when there is a chief job
    task_type: str  # "worker" or "chief"; "worker" when there is no TF_CONFIG
    task_index: int  # index within its job, as in TF_CONFIG
    task_id: int  # position in `workers`: 0 is the chief

    @property
    def num_workers(self) -> int:
        return max(1, len(self.workers))

    @property
    def is_chief(self) -> bool:
        return self.task_id == 0

    @property
    def multi_worker(self) -> bool:
        return len(self.workers) > 1


def cluster_from_env(environ: Mapping[str, str] | None = None) -> ClusterInfo:
    """Reads TF_CONFIG (the chief is the `chief` job, else worker 0); no TF_CONFIG -> one task."""
    env = os.environ if environ is None else environ
    raw = env.get(TF_CONFIG, "").strip()
    if not raw:
        return ClusterInfo(workers=(), task_type="worker", task_index=0, task_id=0)
    try:
        config = json.loads(raw)
        cluster = config.get("cluster", {})
        task = config.get("task", {})
        chiefs = list(cluster.get("chief", []))
        workers = list(cluster.get("worker", []))
        task_type = task.get("type", "worker")
        task_index = int(task.get("index", 0))
    except (ValueError, AttributeError, TypeError, RecursionError) as exc:
        raise SettingError(f"TF_CONFIG is not valid JSON of the form "
                           f'{{"cluster": {{"worker": [...]}}, "task": {{...}}}} ({exc}): {FIX_TF_CONFIG}') from None
    if task_type not in ("worker", "chief"):
        raise SettingError(f"TF_CONFIG task type {task_type!r} is not supported "
                           f"(only 'worker' and 'chief'): {FIX_TF_CONFIG}")
    members = chiefs + workers
    task_id = task_index if task_type == "chief" else len(chiefs) + task_index
    if not 0 <= task_id < max(1, len(members)):
        raise SettingError(f"TF_CONFIG task {task_type}:{task_index} is not in the cluster "
                           f"({len(members)} tasks): {FIX_TF_CONFIG}")
    return ClusterInfo(workers=tuple(members), task_type=task_type,
                       task_index=task_index, task_id=task_id)


def task_id_from_env(environ: Mapping[str, str] | None = None) -> int:
    """MGPU_TASK_INDEX when the launcher set it, else the position in TF_CONFIG."""
    env = os.environ if environ is None else environ
    text = env.get(TASK_INDEX, "").strip()
    if text:
        if not text.isdigit():
            raise SettingError(f"MGPU_TASK_INDEX is {text!r}, not a task number (0, 1, ...): set it to this task's "
                               "index, or unset it to take the index from TF_CONFIG")
        return int(text)
    return cluster_from_env(env).task_id


def is_chief(environ: Mapping[str, str] | None = None) -> bool:
    """True for the task that writes the final model and the real TensorBoard logs."""
    return cluster_from_env(environ).is_chief


# Any (here and below): TensorFlow's and tf_keras' modules and objects, which have no types
def import_tensorflow() -> Any:
    """Imports TensorFlow with Keras 2 (tf_keras) selected; returns the `tf` module."""
    tf_defaults()
    _require_tf_keras()
    import tensorflow as tf

    _log_once()
    return tf


def _log_once() -> None:
    """TensorFlow's warnings printed once: its logger has its own handler (where the root logger had none at
    its import) and also passes each record to the root logger, which absl configures at its first log
    call (the first checkpoint's save). Where TensorFlow left its logging to the root logger, it stays so."""
    import logging

    tf_logger = logging.getLogger("tensorflow")
    if tf_logger.handlers:
        tf_logger.propagate = False


def _require_tf_keras() -> None:
    import importlib.util

    if importlib.util.find_spec("tf_keras") is None:
        raise ImportError("the worker needs Keras 2 for TensorFlow (tf-keras): "
                          "pip install tf-keras  (use the version that matches tensorflow, "
                          "e.g. tensorflow 2.21 -> tf-keras 2.21)")


def import_keras() -> Any:
    """Returns the `tf_keras` module (Keras 3 cannot `fit` under MultiWorkerMirroredStrategy)."""
    import_tensorflow()
    try:
        import tf_keras
    except ImportError as exc:
        raise ImportError(f"cannot import tf_keras ({exc}): pip install tf-keras") from exc
    return tf_keras


_gpus_configured = False


def configure_gpus() -> list[Any]:
    """Turns on memory growth for every visible GPU (once; not where TF_GPU_ALLOCATOR chooses an
    allocator); returns the physical GPUs."""
    global _gpus_configured
    tf = import_tensorflow()
    gpus: list[Any] = tf.config.list_physical_devices("GPU")
    if not _gpus_configured and GPU_ALLOCATOR not in os.environ:
        for gpu in gpus:
            try:
                tf.config.experimental.set_memory_growth(gpu, True)
            except RuntimeError:  # GPUs already initialised by the caller: keep their setting
                pass
        _gpus_configured = True
    return gpus


def set_mixed_precision(enabled: bool) -> None:
    """Sets the global Keras policy to mixed_float16 (or back to float32)."""
    keras = import_keras()
    keras.mixed_precision.set_global_policy("mixed_float16" if enabled else "float32")


SHARD_POLICIES = ("data", "file", "off")


def dataset_options(shard: str = "data", autotune: bool = False) -> Any:
    """tf.data options for an input pipeline: auto-shard policy and autotune (off by default).

    shard: "data" (every worker reads all, keeps 1/N: in-memory data), "file" (each worker
    reads 1/N of the files of a file-reading pipeline), "off" (already sharded by hand).
    With autotune off, give the pipeline a fixed `.prefetch(2)`: see `quiet_device_datasets`.
    """
    tf = import_tensorflow()
    policy = tf.data.experimental.AutoShardPolicy
    if shard not in SHARD_POLICIES:
        raise ValueError(f"shard must be one of {SHARD_POLICIES}, not {shard!r}")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = {
        "data": policy.DATA, "file": policy.FILE, "off": policy.OFF}[shard]
    if not autotune:
        options.autotune.enabled = False
    return options


def quiet_device_datasets() -> bool:
    """Turns tf.data autotune off in the per-device datasets of distributed iterators.

    Under MultiWorkerMirroredStrategy, `fit` sometimes stalls for seconds before it returns
    while autotune threads of the per-device datasets (built inside TensorFlow's
    MultiDeviceIterator) shut down. Options set on the input dataset do not reach those
    datasets and tf.distribute.InputOptions has no such setting, so this wraps the one
    private function that builds them. Idempotent; False (and nothing changed) when the
    function is not there (another TensorFlow version).
    """
    tf = import_tensorflow()
    try:
        from tensorflow.python.data.ops import multi_device_iterator_ops as mdi

        original = mdi._create_device_dataset
    except (ImportError, AttributeError):
        return False
    if getattr(original, "_mgpu_quiet", False):
        return True

    def create_device_dataset(*args: Any, **kwargs: Any) -> Any:
        options = tf.data.Options()
        options.autotune.enabled = False
        return original(*args, **kwargs).with_options(options)

    setattr(create_device_dataset, "_mgpu_quiet", True)
    mdi._create_device_dataset = create_device_dataset
    return True


def wait_for_chief(info: ClusterInfo, timeout: float = 60.0) -> bool:
    """On a non-chief task, wait until the chief's port accepts a connection (True), at most
    `timeout` s (False: TensorFlow's own retries take over).

    The chief hosts TensorFlow's coordination service. A worker that asks before that service is
    up is refused and retries only a second later (gRPC's reconnect backoff), so a group whose
    workers start together loses a second at random, in about half of all starts. Polling the
    port every 20 ms costs nothing and removes that second.
    """
    if info.is_chief or not info.multi_worker:
        return True
    host, _, port = info.workers[0].rpartition(":")
    if not port.isdigit():  # not host:port: nothing to wait for, TensorFlow will say what is wrong
        return False
    def listening() -> bool:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return True
        except OSError:
            return False

    return bool(wait_until(listening, timeout, 0.02))


def strategy_from_env(devices: Sequence[str] | None = None, collective: str = "auto",
                      environ: Mapping[str, str] | None = None, local_replicas: int | None = None) -> Any:
    """The strategy this task should use, from TF_CONFIG and the visible GPUs.

    More than one task in TF_CONFIG -> MultiWorkerMirroredStrategy (NCCL when GPUs are
    visible, RING otherwise, or `collective`); one task -> MirroredStrategy over the local
    GPUs (or `devices`, e.g. ["/gpu:0", "/gpu:1"]); the default strategy on a CPU-only host.
    `local_replicas` > 1 on a host without GPUs splits the CPU into that many logical devices,
    one replica each (MirroredStrategy alone, else that many per worker); with GPUs it must
    equal their number. With several workers it also calls `quiet_device_datasets()` (unless
    MGPU_TF_DATA_AUTOTUNE=1), so that `fit` returns promptly.
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {', '.join(COLLECTIVES)}, "
                         f"not {collective!r}")
    info = cluster_from_env(environ)
    check_workers(info.num_workers, TF_CONFIG if info.workers else "no TF_CONFIG", environ)
    from worker.tensorflow import replicas as local

    tf = import_tensorflow()
    gpus = configure_gpus()
    local.check_gpu_count(local_replicas, gpus)
    cpu_replicas = local_replicas if local_replicas and local_replicas > 1 and not gpus else None
    if devices and cpu_replicas:
        raise ValueError("give devices= or local_replicas=, not both")
    if info.multi_worker:
        if devices:
            raise ValueError("devices= only applies to a single worker; under "
                             "MultiWorkerMirroredStrategy pick GPUs with CUDA_VISIBLE_DEVICES")
        impl = tf.distribute.experimental.CommunicationImplementation
        if collective == "auto":
            chosen = impl.NCCL if gpus else impl.RING
        else:
            chosen = impl.NCCL if collective == "nccl" else impl.RING
        options = tf.distribute.experimental.CommunicationOptions(implementation=chosen)
        if os.environ.get(TF_DATA_AUTOTUNE, "0") != "1":
            quiet_device_datasets()
        wait_for_chief(info)
        if cpu_replicas:
            return local.multi_worker_strategy(tf, cpu_replicas, info.num_workers, options)
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    if cpu_replicas:
        devices = local.split_cpu(tf, cpu_replicas)
    if devices:
        return tf.distribute.MirroredStrategy(devices=list(devices))
    if gpus:
        return tf.distribute.MirroredStrategy()
    return tf.distribute.get_strategy()
