"""The one builder of a task's environment, TF_CONFIG or Keras' distribution variables, for every engine
(pure; standard library).

The launcher builds it for supervised tasks (launcher.plan); a Slurm task or a Kubernetes pod
builds it on its node when it starts, from what the scheduler tells it, with the same functions.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Mapping, MutableMapping
from typing import Any

XLA_FLAGS = "XLA_FLAGS"  # XLA's flags, ours (XLA_CPU_DEVICES) before a user's
XLA_CPU_DEVICES = "--xla_force_host_platform_device_count"  # XLA's logical devices on the CPU platform
NCCL_IFNAME = "NCCL_SOCKET_IFNAME"  # the interface NCCL talks on: the preflight's finding where a host has several


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


def tf_config(workers: list[str], rank: int) -> dict[str, Any]:
    """TF_CONFIG of the task of `rank` among `workers` (host:port, in rank order); rank 0 is the chief."""
    _check_rank(workers, rank)
    return {"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": rank}}


# every variable name of the task environment, spelled here alone (tests/test_structure.py)
TF_CONFIG, VISIBLE_DEVICES, KERAS_BACKEND = "TF_CONFIG", "CUDA_VISIBLE_DEVICES", "KERAS_BACKEND"
RUN_ID, RUN_DIR, TASK_INDEX, NUM_WORKERS = "MGPU_RUN_ID", "MGPU_RUN_DIR", "MGPU_TASK_INDEX", "MGPU_NUM_WORKERS"
NUM_PROCESSES, PROCESS_ID = "KERAS_DISTRIBUTION_NUM_PROCESSES", "KERAS_DISTRIBUTION_PROCESS_ID"
JOB_ADDRESSES = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
HOST_ADDRESS = "MGPU_HOST_ADDRESS"  # on JAX: this task's address in the cluster, where its collectives listen
KERAS_VARIABLES = (KERAS_BACKEND, JOB_ADDRESSES, NUM_PROCESSES, PROCESS_ID)
ATTEMPT = "MGPU_ATTEMPT"  # set by the task core at exec time: which attempt a process was started for
FORK_SERVER = "fork-server"  # a fork server's ATTEMPT: no attempt's sweep stops it, a run's does
# read by the worker, set by a user (or a test) where wanted: the builder sets none of them
PROGRESS_INTERVAL, STEP_CLOCK = "MGPU_PROGRESS_INTERVAL", "MGPU_STEP_CLOCK"
TF_DATA_AUTOTUNE = "MGPU_TF_DATA_AUTOTUNE"
SPARE_BACKUP = "MGPU_SPARE_BACKUP"  # "1": this task keeps a spare copy of each backup (`keeps_spare`)
HOME = "MGPU_HOME"  # the launcher's own: where it keeps its runs
# what a framework reads from the environment when it is imported (JAX_ENABLE_X64, XLA_FLAGS, TF_*, KERAS_BACKEND,
# CUDA_VISIBLE_DEVICES, ...): a fork server's imports were made under its own, which a forked attempt must share
FRAMEWORK_PREFIXES = ("JAX_", "XLA_", "TF_", "KERAS_", "CUDA_", "TPU_")
LEGACY_KERAS, TF_LOG_LEVEL = "TF_USE_LEGACY_KERAS", "TF_CPP_MIN_LOG_LEVEL"
GPU_GROWTH, GPU_ALLOCATOR = "TF_FORCE_GPU_ALLOW_GROWTH", "TF_GPU_ALLOCATOR"


def tf_defaults(environ: MutableMapping[str, str] | None = None) -> None:
    """What the TensorFlow runner (and a fork server, as it) sets before TensorFlow is imported, where it is not
    set already: Keras 2 (tf_keras), as MultiWorkerMirroredStrategy's fit needs (keras-team/keras#20585); C++ INFO
    lines off; GPU memory taken as it is needed unless an allocator is chosen (tasks that share a GPU host do not
    each take all of a GPU's memory at start)."""
    environ = os.environ if environ is None else environ
    environ.setdefault(LEGACY_KERAS, "1")
    environ.setdefault(TF_LOG_LEVEL, "1")
    if GPU_ALLOCATOR not in environ:
        environ.setdefault(GPU_GROWTH, "true")
FRAMEWORK_MODULES = ("jax", "tensorflow", "keras", "tf_keras")


def is_framework_setting(name: str) -> bool:
    """Whether a framework reads variable `name` when it is imported (not the group's: TF_CONFIG and Keras'
    distribution variables are read when the group is joined, after the imports)."""
    return name.startswith(FRAMEWORK_PREFIXES) and name != TF_CONFIG and not name.startswith(tuple(OWNED_PREFIXES))


def framework_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` that a framework reads when it is imported."""
    return {k: v for k, v in environ.items() if is_framework_setting(k)}


HOSTS = "[[hosts]] (or [slurm] nodes, [kubernetes] workers)"
# the variables this builder owns, by the spec key that sets each: a spec's env that sets one is refused (a task
# would train in another group, or on other devices, than the launcher planned and its preflight checked)
OWNED = {TF_CONFIG: HOSTS, TASK_INDEX: HOSTS, NUM_WORKERS: HOSTS, KERAS_BACKEND: "[training] backend",
         VISIBLE_DEVICES: "gpus (or [slurm] gpus_per_node, [kubernetes] gpus_per_worker)",
         RUN_ID: "`up` (each run's own id)", RUN_DIR: "workdir", HOST_ADDRESS: "address"}
OWNED_PREFIXES = {"KERAS_DISTRIBUTION_": HOSTS}  # every variable keras.distribution reads
OWNED_FLAGS = {XLA_FLAGS: {XLA_CPU_DEVICES: "[training] local_replicas"}}  # a flag inside a variable


# set in each pod by Kubernetes or by the JobSet we render, for the pod entry: refused in [kubernetes] env
POD_INDEX = "JOB_COMPLETION_INDEX"  # the pod's rank (its Indexed Job's)
SAFE_PATH = "PYTHONSAFEPATH"  # the pod entry's guard (Python >= 3.11): no worker.py of the workdir before our package
POD_OWNED = {POD_INDEX: "Kubernetes (each pod's index in its Job)",
             SAFE_PATH: "the rendered JobSet (so that a worker.py in workdir cannot stand in for mgpu-cluster's "
                        "worker package when the pod starts)"}


def owner(name: str, value: str = "") -> tuple[str, str] | None:
    """Where this builder owns variable `name` (given `value`): what it sets (the name, or a flag in it) and
    the spec key to use instead; else None."""
    prefix = next((p for p in OWNED_PREFIXES if name.startswith(p)), None)
    flag = next((f for f in OWNED_FLAGS.get(name, ()) if f in value), None)
    if name in OWNED:
        return name, OWNED[name]
    if prefix:
        return name, OWNED_PREFIXES[prefix]
    return (f"{flag} in {name}", OWNED_FLAGS[name][flag]) if flag else None


def visible_devices(gpus: int | str | list[int] | None) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for a task's GPUs, the one rule of every engine: "" where it has none ("none", or 0
    GPUs: it must not take a GPU it could see), the indices where named, nothing for "all", a count or no setting."""
    if gpus in ("none", 0):
        return {VISIBLE_DEVICES: ""}
    return {VISIBLE_DEVICES: ",".join(map(str, gpus))} if isinstance(gpus, list) else {}


def pod_environment(gpus: int, env: Mapping[str, str] | None) -> dict[str, str]:
    """What a Kubernetes pod's container gets in clear (its manifest's env): its GPUs, the pod entry's start
    guard and the spec's env; the pod entry builds the rest (task_environment) from its index."""
    return {**visible_devices(gpus), SAFE_PATH: "1", **(env or {})}


def inherited(environ: Mapping[str, str]) -> dict[str, str]:
    """What a task's builder takes as `common` from the environment its engine gave (a pod's container env):
    every variable but those this builder owns, which it computes itself."""
    return {k: v for k, v in environ.items() if owner(k, v) is None and k not in POD_OWNED}


def keras_distribution(workers: list[str], rank: int) -> dict[str, str]:
    """KERAS_VARIABLES on JAX, what `keras.distribution.initialize()` reads: the coordinator (rank 0's
    host:port), the number of processes and this one's id."""
    _check_rank(workers, rank)
    return dict(zip(KERAS_VARIABLES, ("jax", workers[0], str(len(workers)), str(rank))))


def keeps_spare(workers: list[str], rank: int) -> bool:
    """Whether the task of `rank` keeps a spare copy of each backup in its checkpoint folder: the first task of each
    host other than the chief's, so that a restart whose chief's host is gone (and its disk with the backup) goes
    on from a whole copy on a live host. Its tasks write the same weights as the chief's at each backup anyway."""
    hosts = [address_of(w) for w in workers]
    return hosts[rank] != hosts[0] and hosts.index(hosts[rank]) == rank


def task_environment(common: dict[str, str], workers: list[str], rank: int, run_id: str, run_dir: str,
                     index: int | None = None, *, backend: Backend = Backend.TENSORFLOW,
                     cpu_devices: int | None = None, spare: bool = False) -> dict[str, str]:
    """Every variable a task gets (docs/worker.md's environment contract). `common` (the engine's own and
    the spec's env) comes last, so a user's value wins; `index` is the task's own number when it is not
    its rank (an elastic run that goes on with fewer hosts). On JAX, `cpu_devices` (local_replicas on a
    task without GPUs) is XLA's device count on the CPU, before the flags of a user's XLA_FLAGS (the
    last of a flag wins). `spare`: the task keeps a spare copy of each backup (`keeps_spare`, where hosts share
    no checkpoint folder)."""
    run = {RUN_ID: run_id, TASK_INDEX: str(rank if index is None else index),
           NUM_WORKERS: str(len(workers)), RUN_DIR: run_dir, **({SPARE_BACKUP: "1"} if spare else {})}
    if Backend(backend) is not Backend.JAX:
        env = {TF_CONFIG: json.dumps(tf_config(workers, rank)), **run, LEGACY_KERAS: "1",
               "PYTHONUNBUFFERED": "1"}
        return {**env, **common}
    # the task's own address: JAX's gloo binds where the host's name resolves unless told (127.0.x.1 on many hosts)
    env = {**keras_distribution(workers, rank), **run, HOST_ADDRESS: address_of(workers[rank]), "PYTHONUNBUFFERED": "1"}
    if cpu_devices:
        flags = " ".join(f for f in (f"{XLA_CPU_DEVICES}={cpu_devices}", common.get(XLA_FLAGS, "").strip()) if f)
        env[XLA_FLAGS] = flags
        common = {**common, XLA_FLAGS: flags}
    return {**env, **common}


def with_findings(found: Mapping[str, str], planned: Mapping[str, str]) -> dict[str, str]:
    """What the launcher gives a task at each start: its planned environment (task_environment's) over what the
    preflight found on its host (NCCL_IFNAME): a value the spec sets wins over a finding."""
    return {**found, **planned}


def program_environment(inherited: Mapping[str, str], given: Mapping[str, str], run_dir: str,
                        attempt: str) -> dict[str, str]:
    """The environment a task's program runs in, its last step (the task core's, on the host): the host's own that
    the core inherited, what the launcher gave the task over it (with_findings, or an entry's task_environment),
    and what is known only when the process starts (at_exec)."""
    return {**inherited, **given, **at_exec(run_dir, attempt)}


def at_exec(run_dir: str, attempt: str) -> dict[str, str]:
    """What the task core adds when it starts a process, known only then: the task's folder made absolute
    (the builder may give it relative to the workdir) and the attempt (or FORK_SERVER)."""
    return {RUN_DIR: run_dir, "PYTHONUNBUFFERED": "1", ATTEMPT: attempt}
