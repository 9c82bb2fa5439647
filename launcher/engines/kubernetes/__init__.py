"""The Kubernetes engine: a rendered JobSet (render.py), checked against JobSet's API models
(validate.py). Kubernetes starts the task core in each pod (`worker.task.pod`) and restarts the group
by the JobSet's failure policy; nothing here submits or follows a run: `kubectl apply -f` does."""

from __future__ import annotations

import shlex
from typing import Callable

from launcher.engines.base import Engine, EngineKind
from launcher.engines.kubernetes.render import jobset_name, manifest, pod_command, run_folder, to_yaml
from launcher.engines.kubernetes.validate import validate
from launcher.plan import TaskPlan, worker_argv
from launcher.spec import Host
from worker.host import layout

NOT_HERE = "a [kubernetes] run is applied with kubectl, not started by mgpu-cluster"


def render(spec, run_id: str, masked: bool = False) -> str:
    """The run's manifest as YAML, checked against JobSet's API models first."""
    return to_yaml(validate(manifest(spec, run_id, masked)))


class KubernetesEngine(Engine):
    """Plans and renders; Kubernetes starts, restarts and stops the pods (no Launching, no Inspecting)."""

    kind = EngineKind.KUBERNETES

    def plan_tasks(self, only: list[int] | None) -> list[TaskPlan]:
        k8s, root = self.spec.kubernetes, run_folder(self.spec, self.run_id)
        name = jobset_name(self.run_id)
        return [TaskPlan(index=i, host=Host.model_construct(address=f"{name}-worker-0-{i}", port=k8s.port),
                         python=k8s.python, cwd=k8s.workdir, run_dir=layout.task_dir(root, i),
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
