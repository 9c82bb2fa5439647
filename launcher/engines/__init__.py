"""Engines: how a run's tasks come to life. `engine_for(spec, run_id)` picks one; base.py is the seam."""

from __future__ import annotations

from launcher.engines.base import Engine, Landed
from launcher.spec.cluster import ClusterSpec, KubernetesSpec, SlurmSpec


def engine_for(spec: ClusterSpec, run_id: str, only: list[int] | None = None, landed: Landed | None = None) -> Engine:
    """The engine of this spec's kind, its tasks planned for `run_id` (`only`: the tasks that take part);
    `landed`: the run's record, where the engine reads what the run learned (None: `check`, a dry run)."""
    if isinstance(spec, SlurmSpec):
        from launcher.engines.slurm import SlurmEngine

        return SlurmEngine(spec, run_id, only, landed)
    if isinstance(spec, KubernetesSpec):
        from launcher.engines.kubernetes import KubernetesEngine

        return KubernetesEngine(spec, run_id, only, landed)
    from launcher.engines.supervised import SupervisedEngine

    return SupervisedEngine(spec, run_id, only, landed)
