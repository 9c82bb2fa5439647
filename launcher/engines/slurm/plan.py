"""Slurm plans (pure, linear in nodes): where a run's files live (the shared workdir, laid out by
worker.host.layout), the tasks' plans with what the launcher gives every task, and what the one builder
makes of it on a node, for a described cluster (plans and the dry run show it)."""

from __future__ import annotations

import enum
import os
from pathlib import Path

from launcher.plan import TaskPlan, cpu_devices, worker_argv
from launcher.spec.cluster import Host, SlurmSpec
from worker.host import layout
from worker.host.env import task_environment, visible_devices

JOB_OUT = "job.out"  # the batch jobs' own output (srun's lines), in the run's folder


class Mode(str, enum.Enum):
    BATCH = "batch"  # we submit a job (sbatch) for each attempt
    ALLOCATION = "allocation"  # `up` runs inside the user's own job: each attempt is an srun step

    def __str__(self) -> str:
        return self.value


def mode_here() -> Mode:
    return Mode.ALLOCATION if os.environ.get("SLURM_JOB_ID") else Mode.BATCH


def run_folder(spec: SlurmSpec, run_id: str) -> str:
    """The run's folder under [slurm].workdir (seen by every node): tasks, checkpoint, batch script."""
    return layout.run_root(os.path.expanduser(spec.slurm.workdir), run_id)


def script_file(root: Path, attempt: int) -> Path:
    return root / f"job-{attempt}.sh"


def step_output(root: Path, attempt: int) -> Path:
    """srun's own lines of a step run inside an allocation."""
    return root / f"step-{attempt}.out"


def job_name(run_id: str) -> str:
    return f"mgpu-{run_id}"


def common_env(spec: SlurmSpec) -> dict[str, str]:
    """What the launcher gives every task (in layout.ENV): CUDA_VISIBLE_DEVICES and the spec's env. Each task
    builds the rest on its node, with TF_CONFIG or Keras' variables, by the one builder (worker.host.env)."""
    cfg = spec.slurm
    return {**visible_devices(cfg.gpus_per_node), **(cfg.env or {})}


def given(spec: SlurmSpec, run_id: str) -> dict[str, object]:
    """What the launcher gives every task's builder on its node (written to layout.ENV): the run's id, the
    common env, the backend and, on JAX, the logical CPU devices (local_replicas on nodes without GPUs)."""
    return {"run_id": run_id, "env": common_env(spec), "backend": spec.training.backend.value,
            "cpu_devices": cpu_devices(spec, bool(spec.slurm.gpus_per_node))}


def plan_slurm(spec: SlurmSpec, run_id: str) -> list[TaskPlan]:
    """The tasks' plans, each with what the launcher gives it (Slurm picks the nodes: no TF_CONFIG yet)."""
    cfg, root = spec.slurm, run_folder(spec, run_id)
    host, cwd = Host.model_construct(address="slurm", port=cfg.port or 0), os.path.expanduser(cfg.workdir)
    argv, common = worker_argv(spec, cfg.python), common_env(spec)
    return [TaskPlan(index=i, host=host, python=cfg.python, cwd=cwd, run_dir=layout.task_dir(root, i), argv=argv,
                     env=dict(common), grace=spec.launch.stop_grace, preempt_grace=spec.launch.preempt_grace)
            for i in range(cfg.nodes)]


def described_environment(spec: SlurmSpec, run_id: str, rank: int = 0) -> dict[str, str]:
    """The environment the one builder gives task `rank` on its node, for a cluster described by
    placeholders (the step's nodes in Slurm's order, each at its address: known once the job runs)."""
    cfg = spec.slurm
    port = cfg.port or "<port>"
    workers = [f"<node {j}>:{port}" for j in range(cfg.nodes)]
    return task_environment(common_env(spec), workers, rank, run_id, layout.task_dir(run_folder(spec, run_id), rank),
                            backend=spec.training.backend, cpu_devices=cpu_devices(spec, bool(cfg.gpus_per_node)))
