"""The cluster spec's model: a validated, frozen ClusterSpec (launcher.spec.file reads cluster.toml into it)."""

from __future__ import annotations

import enum
from typing import Annotated, Literal, Optional, Union

from pydantic import Field, PrivateAttr, TypeAdapter, field_validator, model_validator

from launcher.spec.base import (DEVICES_MAX, LOCAL_ADDRESSES, WEEK_S, Count, CpuIndex, Devices, Entrypoint, GpuIndex,
                               Port, Restarts, Seconds, _Model, _no_control, env_names, nul_at)
from launcher.spec.kubernetes import K8S_NOT_LAUNCH, Kubernetes
from launcher.spec.slurm import Slurm, scheduler_problems
from worker.host.env import Backend

LEARNING_RATE_MAX = 1000.0  # far above any rate that trains; scaled by the replicas it stays a finite float32
PREEMPT_GRACE_MAX = 65535  # Slurm's --signal=USR1@<seconds> takes at most 65535


class HostOptions(_Model):
    """Keys a host may set; `[defaults]` fills whichever a host leaves out."""

    name: Optional[str] = None
    user: Optional[str] = None
    ssh_port: Optional[Port] = None
    identity_file: Optional[str] = None
    python: Optional[str] = None
    workdir: Optional[str] = None
    gpus: Union[Literal["all", "none"], list[GpuIndex], None] = None

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus(cls, value: object) -> object:
        ok = value is None or value in ("all", "none") or (
            isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < DEVICES_MAX
                                            for i in value)
        )
        if not ok:
            raise ValueError(f'must be "all", "none" or a list of GPU indices like [0, 1] (each 0..{DEVICES_MAX - 1})')
        return value
    cpus: Optional[list[CpuIndex]] = None
    env: Optional[dict[str, str]] = None

    _env = field_validator("env")(classmethod(lambda cls, env: env_names(env)))

    @field_validator("name", "user", "python", "workdir", "identity_file")
    @classmethod
    def _not_empty(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty")
        return value

    @field_validator("name", "user")
    @classmethod
    def _one_line(cls, value: str | None) -> str | None:  # shown in every line of output (paths may hold any character but NUL)
        if value is not None and not _no_control(value):
            raise ValueError(f"{value!r} holds a control character; it must be one line of plain text")
        return value


class Host(HostOptions):
    address: str
    port: Port

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        if not value.strip() or any(c.isspace() for c in value) or not _no_control(value):
            raise ValueError("must be a host name or IP address without spaces or control characters")
        return value

    @property
    def is_local(self) -> bool:
        return self.address in LOCAL_ADDRESSES

    @property
    def label(self) -> str:
        return self.name or self.address


class Collective(str, enum.Enum):
    """The all-reduce between workers: auto (NCCL on GPU tasks, ring on CPU), ring or nccl."""

    AUTO = "auto"
    RING = "ring"
    NCCL = "nccl"


class Training(_Model):
    backend: Annotated[Backend, Field(strict=False)] = Backend.TENSORFLOW  # what trains (worker.host.env)
    entrypoint: Optional[str] = None
    command: Optional[list[str]] = Field(default=None, min_length=1)
    args: list[str] = []  # appended to the training's command line; `up SPEC -- ARGS` appends more
    # None: the entrypoint's own default
    epochs: Optional[Count] = None
    steps_per_epoch: Optional[Count] = None
    batch_size_per_replica: Optional[Count] = None
    learning_rate: Optional[Annotated[float, Field(gt=0, le=LEARNING_RATE_MAX, allow_inf_nan=False)]] = None
    scale_learning_rate: Optional[bool] = None
    checkpoint_dir: Optional[str] = None
    checkpoint_every_steps: Optional[Count] = None
    tensorboard: Optional[str] = None
    mixed_precision: bool = False
    # replicas per worker: on a CPU host, logical CPU devices (None: one; GPU hosts: one per visible GPU)
    local_replicas: Optional[Annotated[Devices, Field(ge=1)]] = None
    collective: Annotated[Collective, Field(strict=False)] = Collective.AUTO  # all-reduce between workers

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint(cls, value: str | None) -> str | None:
        if value is not None and not Entrypoint.match(value):
            raise ValueError(f"{value!r} is not of the form 'package.module:function'")
        return value

    @model_validator(mode="after")
    def _one_of(self) -> Training:
        if (self.entrypoint is None) == (self.command is None):
            raise ValueError("set exactly one of 'entrypoint' (built-in runner) or 'command' (your own program)")
        jax = self.backend is Backend.JAX  # where the builder gives a command local_replicas too (XLA_FLAGS)
        if self.command is not None and (self.local_replicas is not None and not jax or
                                         self.collective != Collective.AUTO):
            raise ValueError("local_replicas and collective are settings of the built-in runner ('entrypoint'); "
                             "a 'command' builds its own strategy (see worker.strategy_from_env); with backend = "
                             "\"jax\" local_replicas gives a command's tasks their CPU devices too")
        if self.backend is Backend.JAX and self.collective != Collective.AUTO:
            raise ValueError(f"collective = {self.collective.value!r} is a setting of TensorFlow's all-reduce; with "
                             "backend = \"jax\" JAX picks its own collectives: leave collective out")
        return self


class Launch(_Model):
    max_restarts: Restarts = 0
    connect_timeout: Seconds = 10.0
    start_timeout: Seconds = 120.0
    heartbeat_timeout: Seconds = 300.0
    stop_grace: Annotated[float, Field(ge=0, le=WEEK_S, allow_inf_nan=False)] = 1.0
    accept_new_host_keys: bool = False
    # notice (SIGTERM) to KILL: time for the group's checkpoint
    preempt_grace: Annotated[Seconds, Field(le=PREEMPT_GRACE_MAX)] = 60.0
    max_preemptions: Restarts = 100  # restarts after preemption; not max_restarts
    min_hosts: Optional[Count] = None  # elastic: go on with this many hosts when others are lost
    # elastic: a host lost again soon after it came back is kept out this long (twice as long each time it does so
    # again, at most rejoin_cooldown_max); growing may cost at most regroup_share of the run's time
    rejoin_cooldown: Seconds = 60.0
    rejoin_cooldown_max: Seconds = 3600.0
    regroup_share: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 0.25
    # a warm process per task (Python and TensorFlow imported) that a restart starts from (local and SSH hosts)
    standby: bool = True

    @model_validator(mode="after")
    def _cooldowns(self) -> Launch:
        if self.rejoin_cooldown > self.rejoin_cooldown_max:
            raise ValueError(f"rejoin_cooldown = {self.rejoin_cooldown:g} is more than rejoin_cooldown_max = "
                             f"{self.rejoin_cooldown_max:g}: the first cooldown cannot pass its ceiling")
        return self

    @property
    def lifeline(self) -> float:
        """How long tasks outlive a silent launcher (SSH hosts cut off, a Slurm job whose launcher was
        killed): heartbeat_timeout, within 10 s .. 2 min."""
        return min(max(self.heartbeat_timeout, 10.0), 120.0)


ENGINE_TABLES = ("hosts", "slurm", "kubernetes")  # exactly one of them says where the tasks run
ONE_ENGINE = ("set exactly one of [[hosts]] (the machines to train on, named here), [slurm] (a Slurm cluster that picks "
              "the nodes) or [kubernetes] (a JobSet to apply); see cluster.example.toml, cluster.slurm.toml and "
              "cluster.k8s.toml")


class _Spec(_Model):
    """What every spec holds, whichever engine runs it: the training, the launch's settings, files to sync."""

    defaults: HostOptions = HostOptions()
    training: Training
    launch: Launch = Launch()
    sync: list[str] = []
    _folder: Optional[str] = PrivateAttr(default=None)  # set by launcher.spec.file.load_spec

    @property
    def folder(self) -> str | None:
        """The spec file's folder (symlinks resolved): a local host runs there unless its workdir says otherwise,
        and a relative workdir is relative to it. None for a spec not read from a file."""
        return self._folder

    @property
    def num_workers(self) -> int:
        raise NotImplementedError

    @model_validator(mode="before")
    @classmethod
    def _no_nul(cls, data: object) -> object:
        where = nul_at(data)
        if where is not None:
            where = where.replace("\x00", "\\x00")  # a key may hold it too
            raise ValueError(f"{where}: holds a NUL character (\\x00), which no program can be given (not in an "
                             "argument, a path nor the environment); remove it")
        return data


class _Scheduled(_Spec):
    """A spec whose nodes or pods a scheduler picks: no [defaults], no sync, no elastic group."""

    def _scheduled(self, table: str, sched: Slurm | Kubernetes) -> None:
        shared = ("[slurm].workdir is shared by every node already" if table == "slurm"
                  else "put the files in the image, or on the volume_claim")
        for key, why in (("defaults", f"set python and env in [{table}]"), ("sync", shared)):
            if key in self.model_fields_set:
                raise ValueError(f"{key}: not used with [{table}] ({why})")
        if self.launch.min_hosts is not None:
            raise ValueError(f"launch.min_hosts: elastic runs work with [[hosts]] only, not with [{table}]")
        for key in sorted(self.launch.model_fields_set & set(K8S_NOT_LAUNCH)) if table == "kubernetes" else ():
            raise ValueError(f"launch.{key}: not used with [kubernetes] ({K8S_NOT_LAUNCH[key]})")
        problem = scheduler_problems(sched, self.training.local_replicas, self.training.checkpoint_dir,
                                     self.training.entrypoint is not None)
        if problem:
            raise ValueError(problem)


class HostsSpec(_Spec):
    """[[hosts]]: the machines named here (local processes for localhost, SSH for the rest)."""

    hosts: list[Host] = Field(min_length=1)

    @property
    def num_workers(self) -> int:
        return len(self.hosts)

    @model_validator(mode="after")
    def _apply_defaults(self) -> HostsSpec:
        """Fill each host's missing keys from [defaults]; env tables merge, the host winning."""
        defaults = self.defaults.model_dump(exclude_none=True)
        hosts = []
        for host in self.hosts:
            update = {k: v for k, v in defaults.items() if getattr(host, k) is None}
            if host.env is not None and "env" in defaults:
                update["env"] = {**defaults["env"], **host.env}
            hosts.append(host.model_copy(update=update))
        object.__setattr__(self, "hosts", hosts)  # frozen model: set once, while validating
        return self

    @model_validator(mode="after")
    def _unique_tasks(self) -> HostsSpec:
        seen: dict[tuple[str, int], int] = {}
        for i, host in enumerate(self.hosts):
            key = (host.address, host.port)
            if key in seen:
                raise ValueError(
                    f"hosts[{i}]: repeats {host.address}:{host.port} of hosts[{seen[key]}]; "
                    "two tasks cannot share one host and port"
                )
            seen[key] = i
        if self.launch.min_hosts is not None and self.launch.min_hosts > len(self.hosts):
            raise ValueError(f"launch.min_hosts = {self.launch.min_hosts} is more than the {len(self.hosts)} "
                             "host(s) listed")
        names: dict[str, int] = {}
        for i, host in enumerate(self.hosts):
            if host.name is not None:
                if host.name in names:
                    raise ValueError(f"hosts[{i}]: name {host.name!r} is already the name of hosts[{names[host.name]}]; "
                                     "names tell tasks apart in output, status and logs, so each must be unique")
                names[host.name] = i
        return self


class SlurmSpec(_Scheduled):
    """[slurm]: one task per node of a job that Slurm places."""

    slurm: Slurm

    @property
    def num_workers(self) -> int:
        return self.slurm.nodes

    @model_validator(mode="after")
    def _fits(self) -> SlurmSpec:
        self._scheduled("slurm", self.slurm)
        return self


class KubernetesSpec(_Scheduled):
    """[kubernetes]: one pod per task of a JobSet we render."""

    kubernetes: Kubernetes

    @property
    def num_workers(self) -> int:
        return self.kubernetes.workers

    @model_validator(mode="after")
    def _fits(self) -> KubernetesSpec:
        self._scheduled("kubernetes", self.kubernetes)
        return self


# The spec, by the table that says where its tasks run; each engine takes its own kind (launcher.engines).
ClusterSpec = Union[HostsSpec, SlurmSpec, KubernetesSpec]
SPEC_KINDS: dict[str, type[HostsSpec] | type[SlurmSpec] | type[KubernetesSpec]] = {
    "hosts": HostsSpec, "slurm": SlurmSpec, "kubernetes": KubernetesSpec}


def spec_schema() -> dict[str, object]:
    """The JSON Schema of cluster.toml (for editors): one of the three kinds."""
    schema: dict[str, object] = TypeAdapter(ClusterSpec).json_schema()
    schema["title"] = "ClusterSpec"
    return schema
