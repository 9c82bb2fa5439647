"""What each task runs, where and with which environment: a pure function of spec and run."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from launcher.spec import ClusterSpec, Host
from launcher.tfconfig import task_env

SECRET = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)


@dataclass(frozen=True)
class TaskPlan:
    index: int
    host: Host
    python: str
    cwd: str | None  # None: the login folder (SSH) or the launcher's folder (local)
    run_dir: str  # the task's folder on its host; relative paths are relative to cwd
    argv: tuple[str, ...]
    env: dict[str, str]
    grace: float = 1.5

    @property
    def label(self) -> str:
        return f"task {self.index} ({self.host.label}:{self.host.port})"

    def supervisor_argv(self, attempt: int) -> list[str]:
        cpus = ["--cpus", ",".join(map(str, self.host.cpus))] if self.host.cpus else []
        return [self.python, "-m", "worker.supervisor", "--run-dir", self.run_dir,
                "--attempt", str(attempt), "--grace", f"{self.grace:g}", *cpus, "--", *self.argv]


def mgpu_home() -> Path:
    """Where runs are recorded on the control machine: $MGPU_HOME, else the user's state folder."""
    if os.environ.get("MGPU_HOME"):
        return Path(os.environ["MGPU_HOME"]).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "mgpu-cluster"


def run_root(host: Host, run_id: str) -> str:
    """The run's folder on a host: beside the tasks' folders, holds checkpoint and model."""
    if host.workdir:
        return f"{host.workdir.rstrip('/')}/.mgpu/runs/{run_id}"
    if host.is_local:
        return str(mgpu_home() / "runs" / run_id / "hosts" / "localhost")
    return f".mgpu/runs/{run_id}"  # relative to the SSH login folder


def worker_argv(spec: ClusterSpec, python: str) -> tuple[str, ...]:
    t = spec.training
    if t.command is not None:
        return tuple(t.command)
    argv = [python, "-m", "worker", "--entrypoint", t.entrypoint]
    for flag, value in (("--epochs", t.epochs), ("--steps-per-epoch", t.steps_per_epoch),
                        ("--batch-size-per-replica", t.batch_size_per_replica), ("--learning-rate", t.learning_rate)):
        if value is not None:
            argv += [flag, repr(value)]
    if t.scale_learning_rate is not None:
        argv += ["--scale-learning-rate" if t.scale_learning_rate else "--no-scale-learning-rate"]
    if t.checkpoint_dir:
        argv += ["--checkpoint-dir", t.checkpoint_dir]
    if t.tensorboard:
        argv += ["--tensorboard", t.tensorboard]
    if t.mixed_precision:
        argv += ["--mixed-precision"]
    return tuple(argv)


def plan_tasks(spec: ClusterSpec, run_id: str) -> list[TaskPlan]:
    plans = []
    for i, host in enumerate(spec.hosts):
        python = host.python or (sys.executable if host.is_local else "python3")
        run_dir = f"{run_root(host, run_id)}/task-{i}"
        plans.append(TaskPlan(
            index=i, host=host, python=python, cwd=host.workdir, run_dir=run_dir,
            argv=worker_argv(spec, python), env=task_env(spec, i, run_id, run_dir), grace=spec.launch.stop_grace,
        ))
    return plans


def mask_env(env: dict[str, str]) -> dict[str, str]:
    """Env for display: values of secret-looking names hidden."""
    return {k: ("****" if SECRET.search(k) else v) for k, v in env.items()}
