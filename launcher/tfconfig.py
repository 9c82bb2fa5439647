"""TF_CONFIG for each task, and the rest of its environment: pure functions of the spec."""

from __future__ import annotations

from launcher.spec import ClusterSpec
from worker.task.env import endpoint, task_environment


def cluster_addresses(spec: ClusterSpec) -> list[str]:
    return [endpoint(h.address, h.port) for h in spec.hosts]


def tf_config(spec: ClusterSpec, index: int) -> dict:
    """The TF_CONFIG of task `index`; task 0 is the chief."""
    if spec.hosts is None:
        from launcher.errors import SpecError

        raise SpecError("with [slurm] or [kubernetes], each task builds its TF_CONFIG when it starts, from the "
                        "nodes Slurm gave the job (worker.task.slurm) or the JobSet's host names (worker.task.pod); "
                        "'mgpu-cluster up --dry-run' shows how")
    if not 0 <= index < spec.num_workers:
        raise IndexError(f"task {index} does not exist; the spec has tasks 0..{spec.num_workers - 1}")
    return {"cluster": {"worker": cluster_addresses(spec)}, "task": {"type": "worker", "index": index}}


def task_env(spec: ClusterSpec, index: int, run_id: str, run_dir: str) -> dict[str, str]:
    """Every variable the launcher sets for a task (the worker's environment contract)."""
    host = spec.hosts[index]
    common = {}
    if host.gpus == "none":
        common["CUDA_VISIBLE_DEVICES"] = ""
    elif isinstance(host.gpus, list):
        common["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, host.gpus))
    common.update(host.env or {})
    return task_environment(common, cluster_addresses(spec), index, run_id, run_dir)
