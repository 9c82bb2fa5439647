"""Slurm plans: where a run's files live (the shared workdir), the tasks' plans, what every task gets."""

from __future__ import annotations

import enum
import os

from launcher.plan import TaskPlan, worker_argv
from launcher.spec import ClusterSpec, Host
from worker.task.env import endpoint, task_environment


class Mode(str, enum.Enum):
    BATCH = "batch"  # we submit a job (sbatch) for each attempt
    ALLOCATION = "allocation"  # `up` runs inside the user's own job: each attempt is an srun step

    def __str__(self) -> str:
        return self.value


def mode_here() -> Mode:
    return Mode.ALLOCATION if os.environ.get("SLURM_JOB_ID") else Mode.BATCH


def run_folder(spec: ClusterSpec, run_id: str) -> str:
    """The run's folder under [slurm].workdir (seen by every node): tasks, checkpoint, batch script."""
    return os.path.join(os.path.expanduser(spec.slurm.workdir), ".mgpu", "runs", run_id)


def job_name(run_id: str) -> str:
    return f"mgpu-{run_id}"


def common_env(spec: ClusterSpec, run_id: str) -> dict[str, str]:
    """What the launcher gives every task (env.json): the run's id and the spec's env. Each task builds
    the rest on its node, with TF_CONFIG, by the one builder (worker.task.env)."""
    cfg = spec.slurm
    env = {"MGPU_RUN_ID": run_id}
    if cfg.gpus_per_node == 0:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return {**env, **(cfg.env or {})}


def plan_slurm(spec: ClusterSpec, run_id: str) -> list[TaskPlan]:
    """The tasks' plans; their env is what each will get on its node (but TF_CONFIG: Slurm picks the nodes)."""
    cfg, root = spec.slurm, run_folder(spec, run_id)
    common = common_env(spec, run_id)
    workers = [endpoint(f"<node {j}>", cfg.port or 0) for j in range(cfg.nodes)]
    plans = []
    for i in range(cfg.nodes):
        run_dir = f"{root}/task-{i}"
        env = task_environment(common, workers, i, run_id, run_dir)
        del env["TF_CONFIG"]
        plans.append(TaskPlan(
            index=i, host=Host.model_construct(address="slurm", port=cfg.port or 0), python=cfg.python,
            cwd=os.path.expanduser(cfg.workdir), run_dir=run_dir, argv=worker_argv(spec, cfg.python),
            env=env, grace=spec.launch.stop_grace, preempt_grace=spec.launch.preempt_grace))
    return plans
