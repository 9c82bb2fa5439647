"""The spec's [slurm] table (nodes Slurm picks), and what a scheduler's table ([slurm] or [kubernetes], in
kubernetes.py) cannot run with the rest of the spec."""

from __future__ import annotations

import posixpath
import re
from typing import Annotated, Optional

from pydantic import Field, field_validator

from worker.host import layout
from launcher.spec.base import Devices, Port, _Model, _no_control, env_names
from launcher.spec.kubernetes import Kubernetes

# Slurm's time formats: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds; or no limit
SlurmTime = re.compile(r"^(\d{1,9}(:\d{1,2}){0,2}|\d{1,9}-\d{1,2}(:\d{1,2}){0,2}|INFINITE|UNLIMITED)\Z")
SLURM_TIME_MAX_S = 365 * 24 * 3600  # a longer job asks for INFINITE
SLURM_NODES_MAX = 65533  # far above the largest Slurm cluster
SlurmName = re.compile(r"^[A-Za-z0-9_.+-]+\Z")
# sbatch options that [slurm] sets itself (or that mgpu-cluster relies on): refused in `sbatch`
SBATCH_OWN = {
    "-N": "nodes", "--nodes": "nodes", "-p": "partition", "--partition": "partition", "-t": "time",
    "--time": "time", "--gpus-per-node": "gpus_per_node", "-D": "workdir", "--chdir": "workdir",
    "-J": "", "--job-name": "", "-o": "", "--output": "", "-e": "", "--error": "", "-n": "", "--ntasks": "",
    "--ntasks-per-node": "", "-a": "", "--array": "", "--open-mode": "", "--parsable": "", "--wrap": "",
    "--test-only": "", "-W": "", "--wait": "", "-H": "", "--hold": "",
    "--signal": "", "--requeue": "", "--no-requeue": "",  # the notice before a time limit; a requeue resumes
}


class Slurm(_Model):
    """A Slurm cluster: one task per node, the run's files in `workdir` (seen by every node)."""

    nodes: Annotated[int, Field(ge=1, le=SLURM_NODES_MAX)]
    workdir: str
    partition: Optional[str] = None  # None: the cluster's default partition
    time: Optional[str] = None  # Slurm's format, e.g. "30", "2:00:00", "1-12:00:00"; None: the partition's default
    gpus_per_node: Devices = 0
    python: str = "python3"
    port: Optional[Port] = None  # None: 20000 + job id % 10000 (two jobs on one node do not collide)
    sbatch: list[str] = []
    env: Optional[dict[str, str]] = None

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, value: str) -> str:
        if not value.strip() or not _no_control(value):
            raise ValueError("must be a folder path (no control characters)")
        if not (value.startswith("/") or value.startswith("~")):
            raise ValueError(f"{value!r} must be an absolute path (or start with ~) of a folder that every node "
                             "sees, e.g. a home or project folder on shared storage")
        return value

    @field_validator("python")
    @classmethod
    def _python(cls, value: str) -> str:
        if not value.strip() or not _no_control(value):
            raise ValueError("must be the interpreter's name or path on the nodes, e.g. \"python3\"")
        return value

    @field_validator("partition")
    @classmethod
    def _partition(cls, value: str | None) -> str | None:
        if value is not None and not SlurmName.match(value):
            raise ValueError(f"{value!r} is not a partition name (letters, digits, '_', '.', '-')")
        return value

    @field_validator("time")
    @classmethod
    def _time(cls, value: str | None) -> str | None:
        if value is not None and not (SlurmTime.match(value) and slurm_seconds(value) <= SLURM_TIME_MAX_S):
            raise ValueError(f"{value!r} is not a Slurm time limit: use minutes (\"30\"), \"hours:minutes:seconds\" "
                             "(\"2:00:00\") or \"days-hours:minutes:seconds\" (\"1-12:00:00\"), at most 365 days "
                             "(or INFINITE)")
        return value

    @field_validator("sbatch")
    @classmethod
    def _sbatch(cls, value: list[str]) -> list[str]:
        for i, opt in enumerate(value):
            if not _no_control(opt) or not opt.strip():
                raise ValueError(f"[{i}] {opt!r}: an option must be one line of text")
            name = opt.split("=", 1)[0] if opt.startswith("--") else opt[:2]
            if name.startswith("--") and len(name) > 3:  # sbatch takes a long option's unambiguous prefix
                name = next((own for own in SBATCH_OWN if own.startswith(name)), name)
            if name in SBATCH_OWN:
                key = SBATCH_OWN[name]
                raise ValueError(f"[{i}] {opt!r}: " + (f"set it with [slurm].{key} instead" if key else
                                 "mgpu-cluster sets this option itself"))
            if i == 0 and not opt.startswith("-"):
                raise ValueError(f"[0] {opt!r}: each entry is an sbatch option such as \"--account=proj\" "
                                 "(a value may follow its option as the next entry)")
        return value

    _env = field_validator("env")(classmethod(lambda cls, env: env_names(env)))


def slurm_seconds(value: str) -> int:
    """The seconds of a time limit that SlurmTime matched (INFINITE and UNLIMITED: 0, no limit)."""
    if value in ("INFINITE", "UNLIMITED"):
        return 0
    days, _, clock = value.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:
        parts = [int(days) * 24 + parts[0], *parts[1:], 0, 0]  # days-hours[:minutes[:seconds]]
    elif len(parts) < 3:
        parts = [0, *parts, 0]  # minutes[:seconds]
    hours, minutes, seconds = parts[:3]
    return (hours * 60 + minutes) * 60 + seconds


def scheduler_problems(sched: Slurm | Kubernetes, local_replicas: int | None, checkpoint_dir: str | None,
                       builtin: bool) -> str | None:
    """What a [slurm] or [kubernetes] table cannot run with the rest of the spec (no preflight may catch it:
    Kubernetes starts the pods, Slurm picks the nodes)."""
    gpus, key = ((sched.gpus_per_node, "slurm.gpus_per_node") if isinstance(sched, Slurm)
                 else (sched.gpus_per_worker, "kubernetes.gpus_per_worker"))
    if gpus and local_replicas and local_replicas != gpus:
        return (f"training.local_replicas: {local_replicas}, but {key} = {gpus}: on GPUs each GPU is one replica; "
                "leave local_replicas out (or make it equal)")
    if isinstance(sched, Slurm) or sched.workers == 1 or not (checkpoint_dir or builtin):
        return None
    if checkpoint_dir and "://" in checkpoint_dir and not checkpoint_dir.startswith("file://"):
        return None  # a URL (gs://, s3://) is shared storage
    mount = posixpath.normpath(layout.mgpu_dir(sched.workdir))
    where = posixpath.normpath(posixpath.join(sched.workdir, checkpoint_dir or layout.run_root("", "")))
    if sched.volume_claim and where.startswith(mount + "/"):
        return None
    return ("training.checkpoint_dir: with several pods the checkpoint must be on storage every pod shares (a pod "
            "that Kubernetes starts again has an empty file system, so a restart or preemption would start over): "
            f"set kubernetes.volume_claim to a PersistentVolumeClaim (mounted at {mount}, where the default "
            f"checkpoint lies) and keep the checkpoint below {mount}, or set checkpoint_dir to a URL (gs://...)")
