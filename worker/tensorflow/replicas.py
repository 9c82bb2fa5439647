"""Several replicas in one worker: one per visible GPU, or `local_replicas` logical CPU devices.

TensorFlow splits a CPU into logical devices before its runtime starts; MirroredStrategy then runs
one replica on each. MultiWorkerMirroredStrategy takes its local devices from one private method,
`CollectiveAllReduceExtended._initialize_local_devices` (the GPUs if any, else CPU:0 only):
`cpu_local_devices` answers the worker's logical CPUs there while the strategy is built, and fails
loudly where TensorFlow no longer has that method. Only used when CPU local replicas are asked for.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator, Sequence

from worker.training.errors import WorkerError

PRIVATE = "CollectiveAllReduceExtended._initialize_local_devices"
SIGNATURE = ["self", "cluster_resolver", "worker_device"]  # as in TensorFlow 2.13 .. 2.21


class LocalReplicasUnsupported(WorkerError):
    """This TensorFlow builds MultiWorkerMirroredStrategy's local devices elsewhere."""


# Any (here and below): TensorFlow's module and objects, which have no types
def split_cpu(tf: Any, n: int) -> list[str]:
    """Splits this process's CPU into `n` logical devices; their names, e.g. ["/cpu:0", "/cpu:1"].

    Must come before TensorFlow runs anything (its runtime fixes the devices when it starts)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    wanted = [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is None or len(current) != n:
        try:
            tf.config.set_logical_device_configuration(cpu, wanted)
        except RuntimeError as exc:
            raise WorkerError(f"cannot split the CPU into {n} local replicas: TensorFlow has started "
                              f"already ({exc}); build the strategy before anything runs") from None
    return [f"/cpu:{i}" for i in range(n)]


def _extended() -> Any:
    try:
        from tensorflow.python.distribute.collective_all_reduce_strategy import \
            CollectiveAllReduceExtended
    except ImportError as exc:
        raise LocalReplicasUnsupported(_moved(f"cannot import it: {exc}")) from None
    method = getattr(CollectiveAllReduceExtended, "_initialize_local_devices", None)
    if method is None:
        raise LocalReplicasUnsupported(_moved("the method is gone"))
    params = list(inspect.signature(method).parameters)
    if params != SIGNATURE:
        raise LocalReplicasUnsupported(_moved(f"its parameters are now {params}, not {SIGNATURE}"))
    return CollectiveAllReduceExtended


def _moved(why: str) -> str:
    import tensorflow as tf

    return (f"local_replicas on CPU with several workers relies on TensorFlow's private {PRIVATE}, and "
            f"TensorFlow {tf.__version__} moved it ({why}): install a TensorFlow that works with "
            "mgpu-cluster (2.21 is tested), or leave local_replicas out of the spec")


@contextlib.contextmanager
def cpu_local_devices(n: int) -> Iterator[None]:
    """While inside, a MultiWorkerMirroredStrategy being built takes `n` local CPU devices
    (`<worker>/device:CPU:0` .. `CPU:n-1`) instead of one; the CPU must be split (`split_cpu`)."""
    extended = _extended()
    original = extended.__dict__["_initialize_local_devices"]

    def local_devices(self: object, cluster_resolver: object, worker_device: str) -> tuple[tuple[str, ...], str]:
        return tuple(f"{worker_device}/device:CPU:{i}" for i in range(n)), "CPU"

    extended._initialize_local_devices = local_devices
    try:
        yield
    finally:
        extended._initialize_local_devices = original


def multi_worker_strategy(tf: Any, local_replicas: int, num_workers: int, options: Any) -> Any:
    """MultiWorkerMirroredStrategy with `local_replicas` logical CPU devices per worker (checked:
    `local_replicas x num_workers` replicas in sync, or an error)."""
    split_cpu(tf, local_replicas)
    with cpu_local_devices(local_replicas):
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    if strategy.num_replicas_in_sync != local_replicas * num_workers:
        raise LocalReplicasUnsupported(_moved(
            f"{strategy.num_replicas_in_sync} replicas in sync, not {local_replicas} x {num_workers}"))
    return strategy


def check_gpu_count(local_replicas: int | None, gpus: Sequence[object]) -> None:
    """On a GPU task the replicas are its visible GPUs; a `local_replicas` that differs is refused."""
    if local_replicas and gpus and local_replicas != len(gpus):
        raise WorkerError(f"local_replicas = {local_replicas}, but this task sees {len(gpus)} GPU(s): on "
                          "GPUs each visible GPU is one replica; pick the GPUs with the host's 'gpus' "
                          "setting and leave local_replicas out (or make it equal)")
