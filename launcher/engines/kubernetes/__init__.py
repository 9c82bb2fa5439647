"""The Kubernetes engine: a rendered JobSet (render.py), checked against JobSet's API models
(validate.py). Kubernetes starts the task core in each pod (`worker.task.pod`) and restarts the group
by the JobSet's failure policy; nothing here submits or follows a run: `kubectl apply -f` does."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Callable

from launcher.engines.base import Engine, EngineKind, Result, Sink, TaskCheck
from launcher.engines.kubernetes.render import jobset_name, manifest, pod_command, run_folder, to_yaml
from launcher.engines.kubernetes.validate import validate
from launcher.plan import TaskPlan, worker_argv
from launcher.spec import Host

NOT_HERE = "a [kubernetes] run is applied with kubectl, not started by mgpu-cluster"


def render(spec, run_id: str, masked: bool = False) -> str:
    """The run's manifest as YAML, checked against JobSet's API models first."""
    return to_yaml(validate(manifest(spec, run_id, masked)))


class KubernetesEngine(Engine):
    kind = EngineKind.KUBERNETES

    def plan_tasks(self, only: list[int] | None) -> list[TaskPlan]:
        k8s, root = self.spec.kubernetes, run_folder(self.spec, self.run_id)
        name = jobset_name(self.run_id)
        return [TaskPlan(index=i, host=Host.model_construct(address=f"{name}-worker-0-{i}", port=k8s.port),
                         python=k8s.python, cwd=k8s.workdir, run_dir=f"{root}/task-{i}",
                         argv=worker_argv(self.spec, k8s.python), env={}) for i in range(k8s.workers)]

    def dry_run(self, say: Callable[[str], None]) -> None:
        say("# apply with: mgpu-cluster render SPEC -o jobset.yaml && kubectl apply -f jobset.yaml")
        say(f"# each pod runs: {shlex.join(pod_command(self.spec, self.run_id))}")
        say(render(self.spec, self.run_id, masked=True))

    def not_started_here(self, spec_path: str = "SPEC") -> str:
        ns = self.spec.kubernetes.namespace
        return (f"{NOT_HERE}: write its JobSet with 'mgpu-cluster render {spec_path} -o jobset.yaml' (or see it "
                f"with 'up --dry-run'), apply it with 'kubectl apply -f jobset.yaml', and follow it with 'kubectl get "
                f"jobsets -n {ns}' and 'kubectl logs -n {ns} -l mgpu-cluster/run=<run id>' (the id is in the file).")

    def preflight(self, base: Path | None, say: Callable[[str], None], for_start: bool = False) -> list[TaskCheck]:
        return [TaskCheck(plan=self.plans[0], title="the JobSet", problems=[self.not_started_here()])]

    def start(self, attempt: int, sink: Sink) -> dict[int, str]:
        return {p.index: NOT_HERE for p in self.plans}

    def _not_here(self, indices: list[int]) -> list[Result]:
        return [Result(error=RuntimeError(NOT_HERE)) for _ in indices]

    def stop(self, indices: list[int]) -> None:
        pass

    def stop_from_folders(self, indices: list[int]) -> list[Result[dict]]:
        return self._not_here(indices)

    def probe(self, indices: list[int]) -> list[Result[dict]]:
        return self._not_here(indices)

    def read_log(self, index: int, offset: int, tail: int | None = None) -> tuple[str, int]:
        raise RuntimeError(f"{NOT_HERE}: read a pod's log with 'kubectl logs'")

    def call(self, index: int, argv: list[str], timeout: float) -> tuple[int, str, str]:
        return 1, "", f"{NOT_HERE}: use 'kubectl exec'"
