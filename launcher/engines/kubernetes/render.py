"""The JobSet a [kubernetes] spec renders to (jobset.x-k8s.io/v1alpha2): one replicated job of
`workers` pods, each running the task core's pod entry (`python -m worker.task.pod`), which builds
TF_CONFIG from Kubernetes' JOB_COMPLETION_INDEX and the JobSet's stable host names. Pure."""

from __future__ import annotations

import json
import math

from launcher.plan import mask_env, worker_argv
from launcher.spec import ClusterSpec
from worker.host import layout
from worker.protocol import EXIT_PREEMPTED

REPLICATED_JOB = "worker"
PREEMPTED_RULE = "preempted"


def jobset_name(run_id: str) -> str:
    """A DNS label from the run id ("mgpu-20261124-231031-2e16")."""
    return f"mgpu-{run_id}".lower()


def run_folder(spec: ClusterSpec, run_id: str) -> str:
    return layout.run_root(spec.kubernetes.workdir, run_id)


def host_pattern(run_id: str) -> str:
    """Pod i's stable name in the JobSet's headless service: <jobset>-<job>-0-<i>.<subdomain>."""
    name = jobset_name(run_id)
    return f"{name}-{REPLICATED_JOB}-0-{{i}}.{name}"


def pod_command(spec: ClusterSpec, run_id: str) -> list[str]:
    k8s, launch = spec.kubernetes, spec.launch
    return [k8s.python, "-m", "worker.task.pod", "--run-id", run_id, "--run-dir", run_folder(spec, run_id), "--hosts",
            host_pattern(run_id), "--workers", str(k8s.workers), "--port", str(k8s.port),
            "--grace", f"{launch.stop_grace:g}", "--preempt-grace", f"{launch.preempt_grace:g}", "--",
            *worker_argv(spec, k8s.python)]


def pod_env(spec: ClusterSpec) -> dict[str, str]:
    """What the launcher gives every pod (the container's env); the pod entry builds the rest of the
    task's environment, TF_CONFIG included, with the one builder (worker.host.env)."""
    k8s = spec.kubernetes
    return {**({"CUDA_VISIBLE_DEVICES": ""} if k8s.gpus_per_worker == 0 else {}), **(k8s.env or {})}


def _resources(spec: ClusterSpec) -> dict:
    k8s, limits = spec.kubernetes, {}
    if k8s.cpu:
        limits["cpu"] = k8s.cpu
    if k8s.memory:
        limits["memory"] = k8s.memory
    if k8s.gpus_per_worker:
        limits["nvidia.com/gpu"] = str(k8s.gpus_per_worker)
    return {"requests": dict(limits), "limits": limits} if limits else {}


def manifest(spec: ClusterSpec, run_id: str, masked: bool = False) -> dict:
    """The JobSet; `masked`: env values whose names look secret shown as **** (for --dry-run)."""
    k8s, launch, name = spec.kubernetes, spec.launch, jobset_name(run_id)
    env = mask_env(pod_env(spec)) if masked else pod_env(spec)
    container = {"name": "worker", "image": k8s.image, "command": pod_command(spec, run_id),
                 "workingDir": k8s.workdir, "ports": [{"name": "tf", "containerPort": k8s.port, "protocol": "TCP"}],
                 "env": [{"name": key, "value": value} for key, value in env.items()]}
    if _resources(spec):
        container["resources"] = _resources(spec)
    pod = {"restartPolicy": "Never", "containers": [container],
           # the notice (SIGTERM) to KILL: the group's coordinated save, with room for the core's own stop
           "terminationGracePeriodSeconds": math.ceil(launch.preempt_grace) + 10}
    if k8s.volume_claim:
        container["volumeMounts"] = [{"name": "runs", "mountPath": layout.mgpu_dir(k8s.workdir)}]
        pod["volumes"] = [{"name": "runs", "persistentVolumeClaim": {"claimName": k8s.volume_claim}}]
    job = {"completionMode": "Indexed", "completions": k8s.workers, "parallelism": k8s.workers,
           "backoffLimit": 0,  # one failed pod fails the group at once (fail fast)
           # a pod that saved on notice (exit 75), or one Kubernetes took away (evicted by a drain, preempted by
           # the scheduler, its node lost: condition DisruptionTarget) whatever its exit, fails its Job with
           # reason PodFailurePolicy: restarted below without counting against maxRestarts
           "podFailurePolicy": {"rules": [
               {"action": "FailJob", "onExitCodes": {"containerName": "worker", "operator": "In",
                                                     "values": [EXIT_PREEMPTED]}},
               {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
           "template": {"metadata": {"labels": {"mgpu-cluster/run": run_id}}, "spec": pod}}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": name, "namespace": k8s.namespace, "labels": {"mgpu-cluster/run": run_id}},
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": name},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": job}}],
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]},
            "failurePolicy": {"maxRestarts": launch.max_restarts, "restartStrategy": "Recreate", "rules": [
                {"name": PREEMPTED_RULE, "action": "RestartJobSetAndIgnoreMaxRestarts",
                 "onJobFailureReasons": ["PodFailurePolicy"]}]},
        },
    }


def to_yaml(data: dict) -> str:
    """YAML; JSON (which is YAML, and kubectl takes it) where PyYAML is not installed."""
    try:
        import yaml  # only `render` needs it
    except ImportError:
        return json.dumps(data, indent=2) + "\n"
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=120)
