"""The one builder of a task's environment and TF_CONFIG, for every engine (pure; standard library).

The launcher builds it for supervised tasks (launcher.plan); a Slurm task or a Kubernetes pod
builds it on its node when it starts, from what the scheduler tells it, with the same functions.
"""

from __future__ import annotations

import json


def endpoint(address: str, port: int) -> str:
    """host:port as TF_CONFIG wants it ([v6]:port for an IPv6 address)."""
    return f"[{address}]:{port}" if ":" in address and not address.startswith("[") else f"{address}:{port}"


def tf_config(workers: list[str], rank: int) -> dict:
    """TF_CONFIG of the task of `rank` among `workers` (host:port, in rank order); rank 0 is the chief."""
    if not 0 <= rank < len(workers):
        raise ValueError(f"rank {rank} is not one of the cluster's {len(workers)} task(s)")
    return {"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": rank}}


def task_environment(common: dict[str, str], workers: list[str], rank: int, run_id: str, run_dir: str,
                     index: int | None = None) -> dict[str, str]:
    """Every variable a task gets (the README's environment contract). `common` (the engine's own and
    the spec's env) comes last, so a user's value wins; `index` is the task's own number when it is not
    its rank (an elastic run that goes on with fewer hosts)."""
    env = {
        "TF_CONFIG": json.dumps(tf_config(workers, rank)),
        "MGPU_RUN_ID": run_id,
        "MGPU_TASK_INDEX": str(rank if index is None else index),
        "MGPU_NUM_WORKERS": str(len(workers)),
        "MGPU_RUN_DIR": run_dir,
        "TF_USE_LEGACY_KERAS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    return {**env, **common}
