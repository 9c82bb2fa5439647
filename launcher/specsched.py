"""The spec's tables for scheduler engines: [slurm] (nodes Slurm picks) and [kubernetes] (a JobSet)."""

from __future__ import annotations

import re
from typing import Annotated, Optional

from pydantic import Field, field_validator

from launcher.specbase import EnvName, Port, PositiveInt, _Model, _no_control, env_names  # noqa: F401

# Slurm's time formats: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds; or no limit
SlurmTime = re.compile(r"^(\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|INFINITE|UNLIMITED)$")
SlurmName = re.compile(r"^[A-Za-z0-9_.+-]+$")
# sbatch options that [slurm] sets itself (or that mgpu-cluster relies on): refused in `sbatch`
SBATCH_OWN = {
    "-N": "nodes", "--nodes": "nodes", "-p": "partition", "--partition": "partition", "-t": "time",
    "--time": "time", "--gpus-per-node": "gpus_per_node", "-D": "workdir", "--chdir": "workdir",
    "-J": "", "--job-name": "", "-o": "", "--output": "", "-e": "", "--error": "", "-n": "", "--ntasks": "",
    "--ntasks-per-node": "", "-a": "", "--array": "", "--open-mode": "", "--parsable": "", "--wrap": "",
    "--test-only": "", "-W": "", "--wait": "", "-H": "", "--hold": "",
}


class Slurm(_Model):
    """A Slurm cluster: one task per node, the run's files in `workdir` (seen by every node)."""

    nodes: PositiveInt
    workdir: str
    partition: Optional[str] = None  # None: the cluster's default partition
    time: Optional[str] = None  # Slurm's format, e.g. "30", "2:00:00", "1-12:00:00"; None: the partition's default
    gpus_per_node: Annotated[int, Field(ge=0)] = 0
    python: str = "python3"
    port: Optional[Port] = None  # None: 20000 + job id % 10000 (two jobs on one node do not collide)
    sbatch: list[str] = []
    env: Optional[dict[str, str]] = None

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, value):
        if not value.strip() or not _no_control(value):
            raise ValueError("must be a folder path (no control characters)")
        if not (value.startswith("/") or value.startswith("~")):
            raise ValueError(f"{value!r} must be an absolute path (or start with ~) of a folder that every node "
                             "sees, e.g. a home or project folder on shared storage")
        return value

    @field_validator("python")
    @classmethod
    def _python(cls, value):
        if not value.strip() or not _no_control(value):
            raise ValueError("must be the interpreter's name or path on the nodes, e.g. \"python3\"")
        return value

    @field_validator("partition")
    @classmethod
    def _partition(cls, value):
        if value is not None and not SlurmName.match(value):
            raise ValueError(f"{value!r} is not a partition name (letters, digits, '_', '.', '-')")
        return value

    @field_validator("time")
    @classmethod
    def _time(cls, value):
        if value is not None and not SlurmTime.match(value):
            raise ValueError(f"{value!r} is not a Slurm time limit: use minutes (\"30\"), \"hours:minutes:seconds\" "
                             "(\"2:00:00\") or \"days-hours:minutes:seconds\" (\"1-12:00:00\")")
        return value

    @field_validator("sbatch")
    @classmethod
    def _sbatch(cls, value):
        for i, opt in enumerate(value):
            if not _no_control(opt) or not opt.strip():
                raise ValueError(f"[{i}] {opt!r}: an option must be one line of text")
            name = opt.split("=", 1)[0] if opt.startswith("--") else opt[:2]
            if name in SBATCH_OWN:
                key = SBATCH_OWN[name]
                raise ValueError(f"[{i}] {opt!r}: " + (f"set it with [slurm].{key} instead" if key else
                                 "mgpu-cluster sets this option itself"))
            if i == 0 and not opt.startswith("-"):
                raise ValueError(f"[0] {opt!r}: each entry is an sbatch option such as \"--account=proj\" "
                                 "(a value may follow its option as the next entry)")
        return value

    _env = field_validator("env")(classmethod(lambda cls, env: env_names(env)))


K8sName = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # a DNS label
K8sQuantity = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
# [launch] keys that mean nothing to a JobSet, and why
K8S_NOT_LAUNCH = {**dict.fromkeys(("accept_new_host_keys", "connect_timeout"), "no SSH: Kubernetes starts the pods"),
                  **dict.fromkeys(("start_timeout", "heartbeat_timeout"), "no launcher follows the pods"),
                  "max_preemptions": "JobSet restarts a preempted group without counting or limit"}


class Kubernetes(_Model):
    """A Kubernetes cluster: a JobSet of `workers` pods, rendered by `mgpu-cluster render`."""

    image: str
    workers: PositiveInt
    namespace: str = "default"
    port: Port = 20000
    gpus_per_worker: Annotated[int, Field(ge=0)] = 0  # the nvidia.com/gpu limit of each pod
    python: str = "python3"
    workdir: str = "/workspace"  # the container's working folder; run files in <workdir>/.mgpu/runs/<run-id>/
    env: Optional[dict[str, str]] = None
    cpu: Optional[str] = None  # each pod's CPU request and limit, e.g. "4"
    memory: Optional[str] = None  # each pod's memory request and limit, e.g. "16Gi"
    volume_claim: Optional[str] = None  # a PersistentVolumeClaim mounted at workdir/.mgpu: shared by every pod

    @field_validator("namespace", "volume_claim")
    @classmethod
    def _name(cls, value):
        if value is not None and not K8sName.match(value):
            raise ValueError(f"{value!r} is not a Kubernetes name (lower-case letters, digits and '-')")
        return value

    @field_validator("cpu", "memory")
    @classmethod
    def _quantity(cls, value):
        if value is not None and not K8sQuantity.match(value):
            raise ValueError(f"{value!r} is not a Kubernetes quantity such as \"4\", \"500m\" or \"16Gi\"")
        return value

    @field_validator("image", "python", "workdir")
    @classmethod
    def _text(cls, value, info):
        if not value.strip() or not _no_control(value):
            raise ValueError("must be one line of text")
        if info.field_name == "workdir" and not value.startswith("/"):
            raise ValueError(f"{value!r} must be an absolute path in the container")
        return value

    _env = field_validator("env")(classmethod(lambda cls, env: env_names(env)))


