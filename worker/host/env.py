"""The one builder of a task's environment, TF_CONFIG or Keras' distribution variables, for every engine
(pure; standard library).

The launcher builds it for supervised tasks (launcher.plan); a Slurm task or a Kubernetes pod
builds it on its node when it starts, from what the scheduler tells it, with the same functions.
"""

from __future__ import annotations

import enum
import json

XLA_CPU_DEVICES = "--xla_force_host_platform_device_count"  # XLA's logical devices on the CPU platform


class Backend(str, enum.Enum):
    """What trains: TensorFlow (MultiWorkerMirroredStrategy with tf-keras) or Keras 3 on JAX (keras.distribution)."""

    TENSORFLOW = "tensorflow"
    JAX = "jax"

    def __str__(self) -> str:
        return self.value


def endpoint(address: str, port: int) -> str:
    """host:port as TF_CONFIG wants it ([v6]:port for an IPv6 address)."""
    return f"[{address}]:{port}" if ":" in address and not address.startswith("[") else f"{address}:{port}"


def address_of(end: str) -> str:
    """The host of an endpoint() ('[v6]:port' or 'host:port')."""
    host = end.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _check_rank(workers: list[str], rank: int) -> None:
    if not 0 <= rank < len(workers):
        raise ValueError(f"rank {rank} is not one of the cluster's {len(workers)} task(s)")


def tf_config(workers: list[str], rank: int) -> dict:
    """TF_CONFIG of the task of `rank` among `workers` (host:port, in rank order); rank 0 is the chief."""
    _check_rank(workers, rank)
    return {"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": rank}}


NUM_PROCESSES, PROCESS_ID = "KERAS_DISTRIBUTION_NUM_PROCESSES", "KERAS_DISTRIBUTION_PROCESS_ID"
HOST_ADDRESS = "MGPU_HOST_ADDRESS"  # on JAX: this task's address in the cluster, where its collectives listen
KERAS_VARIABLES = ("KERAS_BACKEND", "KERAS_DISTRIBUTION_JOB_ADDRESSES", NUM_PROCESSES, PROCESS_ID)


HOSTS = "[[hosts]] (or [slurm] nodes, [kubernetes] workers)"
# the variables this builder owns, by the spec key that sets each: a spec's env that sets one is refused (a task
# would train in another group, or on other devices, than the launcher planned and its preflight checked)
OWNED = {"TF_CONFIG": HOSTS, "MGPU_TASK_INDEX": HOSTS, "MGPU_NUM_WORKERS": HOSTS, "KERAS_BACKEND": "[training] backend",
         "CUDA_VISIBLE_DEVICES": "gpus (or [slurm] gpus_per_node, [kubernetes] gpus_per_worker)",
         "MGPU_RUN_ID": "`up` (each run's own id)", "MGPU_RUN_DIR": "workdir", HOST_ADDRESS: "address"}
OWNED_PREFIXES = {"KERAS_DISTRIBUTION_": HOSTS}  # every variable keras.distribution reads
OWNED_FLAGS = {"XLA_FLAGS": {XLA_CPU_DEVICES: "[training] local_replicas"}}  # a flag inside a variable


def owner(name: str, value: str = "") -> tuple[str, str] | None:
    """Where this builder owns variable `name` (given `value`): what it sets (the name, or a flag in it) and
    the spec key to use instead; else None."""
    prefix = next((p for p in OWNED_PREFIXES if name.startswith(p)), None)
    flag = next((f for f in OWNED_FLAGS.get(name, ()) if f in value), None)
    if name in OWNED or prefix:
        return name, OWNED.get(name) or OWNED_PREFIXES[prefix]
    return (f"{flag} in {name}", OWNED_FLAGS[name][flag]) if flag else None


def keras_distribution(workers: list[str], rank: int) -> dict[str, str]:
    """KERAS_VARIABLES on JAX, what `keras.distribution.initialize()` reads: the coordinator (rank 0's
    host:port), the number of processes and this one's id."""
    _check_rank(workers, rank)
    return dict(zip(KERAS_VARIABLES, ("jax", workers[0], str(len(workers)), str(rank))))


def task_environment(common: dict[str, str], workers: list[str], rank: int, run_id: str, run_dir: str,
                     index: int | None = None, *, backend: Backend = Backend.TENSORFLOW,
                     cpu_devices: int | None = None) -> dict[str, str]:
    """Every variable a task gets (docs/worker.md's environment contract). `common` (the engine's own and
    the spec's env) comes last, so a user's value wins; `index` is the task's own number when it is not
    its rank (an elastic run that goes on with fewer hosts). On JAX, `cpu_devices` (local_replicas on a
    task without GPUs) is XLA's device count on the CPU, before the flags of a user's XLA_FLAGS (the
    last of a flag wins)."""
    run = {"MGPU_RUN_ID": run_id, "MGPU_TASK_INDEX": str(rank if index is None else index),
           "MGPU_NUM_WORKERS": str(len(workers)), "MGPU_RUN_DIR": run_dir}
    if Backend(backend) is not Backend.JAX:
        env = {"TF_CONFIG": json.dumps(tf_config(workers, rank)), **run, "TF_USE_LEGACY_KERAS": "1",
               "PYTHONUNBUFFERED": "1"}
        return {**env, **common}
    # the task's own address: JAX's gloo binds where the host's name resolves unless told (127.0.x.1 on many hosts)
    env = {**keras_distribution(workers, rank), **run, HOST_ADDRESS: address_of(workers[rank]), "PYTHONUNBUFFERED": "1"}
    if cpu_devices:
        flags = " ".join(f for f in (f"{XLA_CPU_DEVICES}={cpu_devices}", common.get("XLA_FLAGS", "").strip()) if f)
        env["XLA_FLAGS"] = flags
        common = {**common, "XLA_FLAGS": flags}
    return {**env, **common}
