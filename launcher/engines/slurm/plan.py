"""Slurm plans: where a run's files live (the shared workdir), the tasks' plans, what every task gets."""

from __future__ import annotations

import enum
import os

from launcher.plan import TaskPlan, worker_argv
from launcher.spec import ClusterSpec, Host


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
    """What every task gets (env.json); worker.task.slurm adds TF_CONFIG, MGPU_TASK_INDEX, MGPU_RUN_DIR."""
    cfg = spec.slurm
    env = {"MGPU_RUN_ID": run_id, "MGPU_NUM_WORKERS": str(cfg.nodes), "TF_USE_LEGACY_KERAS": "1",
           "PYTHONUNBUFFERED": "1"}
    if cfg.gpus_per_node == 0:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(cfg.env or {})
    return env


def plan_slurm(spec: ClusterSpec, run_id: str) -> list[TaskPlan]:
    cfg, root = spec.slurm, run_folder(spec, run_id)
    common = common_env(spec, run_id)
    plans = []
    for i in range(cfg.nodes):
        run_dir = f"{root}/task-{i}"
        plans.append(TaskPlan(
            index=i, host=Host.model_construct(address="slurm", port=cfg.port or 0), python=cfg.python,
            cwd=os.path.expanduser(cfg.workdir), run_dir=run_dir, argv=worker_argv(spec, cfg.python),
            env={**common, "MGPU_TASK_INDEX": str(i), "MGPU_RUN_DIR": run_dir}, grace=spec.launch.stop_grace,
            preempt_grace=spec.launch.preempt_grace))
    return plans
