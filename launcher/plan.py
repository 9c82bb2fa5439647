"""What each task runs, where and with which environment: a pure function of spec and run."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from launcher.run.home import run_folder
from launcher.spec.cluster import ClusterSpec, Host, HostsSpec
from launcher.spec.base import SECRET
from worker.host import layout
from worker.host.entries import SupervisedArgs
from worker.host.env import Backend, endpoint, keeps_spare, task_environment, visible_devices
from worker.host.spawn import module_argv
from worker.task.program import Program, not_a_form

SUPERVISOR = SupervisedArgs.module  # the on-host entry of local and SSH tasks


@dataclass(frozen=True)
class TaskPlan:
    index: int
    host: Host
    python: str
    cwd: str | None  # None: the login folder (SSH); a local host without a workdir runs in the spec's folder
    run_dir: str  # the task's folder on its host; relative paths are relative to cwd
    argv: tuple[str, ...]
    env: dict[str, str]
    grace: float = 1.0
    preempt_grace: float = 60.0
    warm: bool = False  # each attempt forked from the task's fork server (worker.task.forkserver): the run can restart

    @property
    def label(self) -> str:
        port = self.host.port  # 0: not known before the start (a scheduler picks the node and port)
        return f"task {self.index} ({self.host.label}:{port})" if port else f"task {self.index} ({self.host.label})"

    def supervisor_argv(self, attempt: int, lifeline: float | None = None, standby: bool = False) -> list[str]:
        return module_argv(self.python, SUPERVISOR) + self.supervisor_args(attempt, lifeline, standby)

    def supervisor_args(self, attempt: int, lifeline: float | None = None, standby: bool = False) -> list[str]:
        """The supervisor's arguments (after its module): a held preflight check passes them on. `standby`:
        it starts the program warm and the attempt on "go" (worker.task.supervised)."""
        return SupervisedArgs(run_dir=self.run_dir, attempt=attempt, port=self.host.port, grace=self.grace,
                              preempt_grace=self.preempt_grace, env_stdin=True, cpus=tuple(self.host.cpus or ()),
                              lifeline=lifeline or None, warm=self.warm, standby=standby and self.warm,
                              program=self.argv).argv()


def warm(spec: ClusterSpec) -> bool:
    """Whether tasks start from fork servers and keep standbys: only where the run can restart (and its program
    is Python's, in a form a fork can run: worker.task.program)."""
    launch = spec.launch
    return launch.standby and (launch.max_restarts > 0 or launch.max_preemptions > 0)


def cold_words(spec: ClusterSpec, plans: list[TaskPlan]) -> str | None:
    """Why a run that can restart keeps no standbys, its restarts starting cold (None where it keeps them): its
    command is not in a form a fork server runs (one that is, in another Python than the task core's, is said by
    the task: worker.task.warmstart)."""
    if not warm(spec) or not plans or any(p.warm for p in plans):
        return None
    return f"restarts start cold (no standbys): {not_a_form(plans[0].argv)}, the forms a fork server can start"


def run_root(host: Host, run_id: str) -> str:
    """The run's folder on a host, holding the tasks' folders, checkpoint and model.

    Relative paths are relative to the task's folder (its workdir, or the SSH login folder)."""
    if host.is_local and not host.workdir:
        return str(layout.local_run_root(run_folder(run_id)))
    return layout.run_root("", run_id)


def checkpoint_folder(spec: ClusterSpec, host: Host, run_id: str) -> str:
    """A task's checkpoint folder as the built-in runner finds it (relative to its folder): the spec's, else the
    run's on its host."""
    return spec.training.checkpoint_dir or layout.checkpoint_dir(run_root(host, run_id))


def host_env(host: Host) -> dict[str, str]:
    """What the launcher gives a task of this host besides the contract: its GPUs, and the spec's env."""
    return {**visible_devices(host.gpus), **(host.env or {})}


def cpu_devices(spec: ClusterSpec, gpus_named: bool) -> int | None:
    """The logical CPU devices the builder gives a JAX task (XLA_FLAGS): local_replicas, on a task whose GPUs
    are not named (on GPUs each visible GPU is one replica). TensorFlow's runner splits its CPU itself."""
    jax = spec.training.backend is Backend.JAX
    return spec.training.local_replicas if jax and not gpus_named else None


def worker_argv(spec: ClusterSpec, python: str) -> tuple[str, ...]:
    t = spec.training
    if t.command is not None:
        return (*t.command, *t.args)
    assert t.entrypoint is not None  # the spec holds exactly one of command and entrypoint
    argv = [*module_argv(python, "worker"), "--entrypoint", t.entrypoint]
    for flag, value in (("--epochs", t.epochs), ("--steps-per-epoch", t.steps_per_epoch),
                        ("--batch-size-per-replica", t.batch_size_per_replica), ("--learning-rate", t.learning_rate)):
        if value is not None:
            argv += [flag, repr(value)]
    if t.scale_learning_rate is not None:
        argv += ["--scale-learning-rate" if t.scale_learning_rate else "--no-scale-learning-rate"]
    if t.checkpoint_dir:
        argv += ["--checkpoint-dir", t.checkpoint_dir]
    if t.checkpoint_every_steps:
        argv += ["--checkpoint-every-steps", str(t.checkpoint_every_steps)]
    if t.tensorboard:
        argv += ["--tensorboard", t.tensorboard]
    if t.mixed_precision:
        argv += ["--mixed-precision"]
    if t.local_replicas is not None:
        argv += ["--local-replicas", str(t.local_replicas)]
    if t.collective.value != "auto":
        argv += ["--collective", t.collective.value]
    return (*argv, *t.args)


def plan_tasks(spec: HostsSpec, run_id: str, only: list[int] | None = None) -> list[TaskPlan]:
    """Every task's plan; `only`: the spec's host indices that take part (elastic: fewer hosts).

    A task keeps its index and folder whatever the others do; its TF_CONFIG (or Keras' variables) names
    only the hosts that take part, and its rank among them."""
    chosen = list(range(len(spec.hosts))) if only is None else list(only)
    workers = [endpoint(spec.hosts[i].address, spec.hosts[i].port) for i in chosen]
    plans = []
    for rank, i in enumerate(chosen):
        host = spec.hosts[i]
        python = host.python or (sys.executable if host.is_local else "python3")
        run_dir = layout.task_dir(run_root(host, run_id), i)
        gpus_named = host.gpus == "all" or bool(isinstance(host.gpus, list) and host.gpus)
        argv = worker_argv(spec, python)
        plans.append(TaskPlan(
            index=i, host=host, python=python, run_dir=run_dir,
            cwd=(os.path.expanduser(host.workdir) if host.workdir else spec.folder) if host.is_local else host.workdir,
            argv=argv,
            env=task_environment(host_env(host), workers, rank, run_id, run_dir, index=i, backend=spec.training.backend,
                                 cpu_devices=cpu_devices(spec, gpus_named),
                                 spare=spec.training.entrypoint is not None and keeps_spare(workers, rank)),
            grace=spec.launch.stop_grace, preempt_grace=spec.launch.preempt_grace,
            warm=warm(spec) and Program.parse(argv) is not None,
        ))
    return plans


def mask_env(env: dict[str, str]) -> dict[str, str]:
    """Env for display: values of secret-looking names hidden."""
    return {k: ("****" if SECRET.search(k) else v) for k, v in env.items()}
