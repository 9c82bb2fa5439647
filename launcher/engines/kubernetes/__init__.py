"""The Kubernetes engine: a rendered JobSet (render.py), checked against JobSet's API models
(validate.py). Kubernetes starts the task core in each pod (`worker.task.pod`) and restarts the group
by the JobSet's failure policy; nothing here submits or follows a run: `kubectl apply -f` does."""

from __future__ import annotations

import shlex
from typing import Callable

from launcher.engines.base import Engine, EngineKind
from launcher.engines.kubernetes.render import RUN_LABEL, host_pattern, manifest, pod_command, run_folder, to_yaml
from launcher.engines.kubernetes.validate import validate
from launcher.plan import TaskPlan, worker_argv
from launcher.spec.cluster import Host, KubernetesSpec
from launcher.spec.kubernetes import pod_host
from worker.host import layout
from worker.host.env import POD_INDEX, PROCESS_ID, Backend, endpoint, keras_distribution

NOT_HERE = "a [kubernetes] run is applied with kubectl, not started by mgpu-cluster"


def render(spec: KubernetesSpec, masked: bool = False) -> str:
    """The run's manifest as YAML, checked against JobSet's API models first."""
    return to_yaml(validate(manifest(spec, masked)))


class KubernetesEngine(Engine):
    """Plans and renders; Kubernetes starts, restarts and stops the pods (no Launching, no Inspecting). The run's
    id is the JobSet's name, whatever id the caller made: the same spec is the same object and run folder."""

    kind = EngineKind.KUBERNETES
    spec: KubernetesSpec

    def plan_tasks(self, only: list[int] | None) -> list[TaskPlan]:
        k8s, root = self.spec.kubernetes, run_folder(self.spec)
        return [TaskPlan(index=i, host=Host.model_construct(address=pod_host(k8s.jobset, i), port=k8s.port),
                         python=k8s.python, cwd=k8s.workdir, run_dir=layout.task_dir(root, i),
                         argv=worker_argv(self.spec, k8s.python), env={}) for i in range(k8s.workers)]

    def dry_run(self, say: Callable[[str], None]) -> None:
        say("# apply with: mgpu-cluster render SPEC -o jobset.yaml && kubectl apply -f jobset.yaml")
        say(f"# each pod runs: {shlex.join(pod_command(self.spec))}")
        if self.spec.training.backend is Backend.JAX:
            k8s = self.spec.kubernetes
            hosts = [endpoint(host_pattern(self.spec).format(i=i), k8s.port) for i in range(k8s.workers)]
            found = {**keras_distribution(hosts, 0), PROCESS_ID: f"<{POD_INDEX}>"}
            say(f"# each pod's Keras variables, built by its entry: {' '.join(f'{k}={v}' for k, v in found.items())}")
        say(render(self.spec, masked=True))

    def not_started_here(self, spec_path: str = "SPEC") -> str:
        ns, name = self.spec.kubernetes.namespace, self.spec.kubernetes.jobset
        return (f"{NOT_HERE}: write its JobSet with 'mgpu-cluster render {spec_path} -o jobset.yaml' (or see it "
                f"with 'up --dry-run'), apply it with 'kubectl apply -f jobset.yaml', and follow it with 'kubectl get "
                f"jobset {name} -n {ns}' and 'kubectl logs -n {ns} -l {RUN_LABEL}={name} --prefix'.")
