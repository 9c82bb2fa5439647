"""The JobSet a [kubernetes] spec renders to (jobset.x-k8s.io/v1alpha2): one replicated job of
`workers` pods, each running the task core's pod entry (`python -m worker.task.pod`), which builds
TF_CONFIG (or Keras' variables) from Kubernetes' JOB_COMPLETION_INDEX and the JobSet's stable host
names. Pure and deterministic: no time or random value in it, so the same spec renders the same file."""

from __future__ import annotations

import json
import math
from typing import Any

from launcher.plan import cpu_devices, mask_env, worker_argv
from launcher.spec.cluster import KubernetesSpec
from launcher.spec.kubernetes import OWN_LABELS, REPLICATED_JOB, RUNS_VOLUME, SHM_VOLUME, Toleration, pod_host
from worker.host import layout
from worker.host.entries import PodArgs
from worker.host.env import Backend, pod_environment
from worker.host.spawn import module_argv
from worker.host.protocol import EXIT_PREEMPTED

PREEMPTED_RULE = "preempted"
Manifest = dict[str, Any]  # Any: a Kubernetes object, nested as its API spells it (checked by validate.py)
RUN_LABEL = OWN_LABELS + "run"  # the run's id, the JobSet's name: kubectl logs -l mgpu-cluster/run=<name>


def run_folder(spec: KubernetesSpec) -> str:
    return layout.run_root(spec.kubernetes.workdir, spec.kubernetes.jobset)


def host_pattern(spec: KubernetesSpec) -> str:
    """Pod i's stable name in the JobSet's headless service: <jobset>-<job>-0-<i>.<subdomain>."""
    name = spec.kubernetes.jobset
    return f"{pod_host(name, '{i}')}.{name}"


def pod_command(spec: KubernetesSpec) -> list[str]:
    """`python -m worker.task.pod ... -- PROGRAM`, as a reader of the manifest expects it. The container's env
    holds PYTHONSAFEPATH=1 (worker.host.env.pod_environment), so that a worker.py in the workdir does not stand
    in for our package (what module_argv's boot does elsewhere; Python >= 3.11, an older Python ignores it).
    Our runner keeps that guard (it puts the workdir on sys.path itself for the entrypoint: --safe-path); a
    program of the spec's `command` gets Python's usual sys.path."""
    k8s, launch = spec.kubernetes, spec.launch
    program = list(worker_argv(spec, k8s.python))
    boot = module_argv(k8s.python, "worker")
    ours = spec.training.command is None and program[:len(boot)] == boot
    if ours:
        program[:len(boot)] = [k8s.python, "-m", "worker"]
    # on JAX the builder needs the backend and the CPU's devices too (on TensorFlow neither: its pods' command
    # stays as it was)
    jax = spec.training.backend is Backend.JAX
    devices = cpu_devices(spec, bool(k8s.gpus_per_worker)) if jax else None
    entry = PodArgs(run_id=k8s.jobset, run_dir=run_folder(spec), hosts=host_pattern(spec), workers=k8s.workers,
                    port=k8s.port, grace=launch.stop_grace, preempt_grace=launch.preempt_grace, safe_path=ours,
                    backend=spec.training.backend, cpu_devices=devices or None, program=tuple(program))
    return [k8s.python, "-m", entry.module, *entry.argv()]


def pod_env(spec: KubernetesSpec) -> dict[str, str]:
    """What the launcher gives every pod in clear (the container's env); the pod entry builds the rest of the
    task's environment, TF_CONFIG included, with the one builder (worker.host.env)."""
    return pod_environment(spec.kubernetes.gpus_per_worker, spec.kubernetes.env)


def _env(spec: KubernetesSpec, masked: bool) -> list[Manifest]:
    """Values in clear, then those from Secrets (secretKeyRef: the manifest names the Secret, never the value)."""
    env = mask_env(pod_env(spec)) if masked else pod_env(spec)
    return [*({"name": key, "value": value} for key, value in env.items()),
            *({"name": key, "valueFrom": {"secretKeyRef": {"name": ref.secret, "key": ref.key}}}
              for key, ref in (spec.kubernetes.secret_env or {}).items())]


def _resources(spec: KubernetesSpec) -> dict[str, dict[str, str]]:
    """Requests equal to limits (a device, an extended resource, takes no other): cpu, memory, GPUs and the
    spec's other resources (rdma/hca)."""
    k8s = spec.kubernetes
    own = {"cpu": k8s.cpu, "memory": k8s.memory, "nvidia.com/gpu": k8s.gpus_per_worker and str(k8s.gpus_per_worker)}
    limits = {**{key: value for key, value in own.items() if value},
              **{key: str(value) for key, value in (k8s.resources or {}).items()}}
    return {"requests": dict(limits), "limits": limits} if limits else {}


def _toleration(t: Toleration) -> dict[str, str | int]:
    fields: dict[str, str | int | None] = {"key": t.key, "operator": t.operator.value, "value": t.value,
              "effect": t.effect.value if t.effect else None, "tolerationSeconds": t.toleration_seconds}
    return {key: value for key, value in fields.items() if value is not None}


def _volumes(spec: KubernetesSpec, container: Manifest, pod: Manifest) -> None:
    """The shared run folder (a PersistentVolumeClaim), a memory-backed /dev/shm, where the spec asks, and the
    spec's own volumes (data sets, a node's SSD)."""
    k8s = spec.kubernetes
    mounts: list[Manifest] = []
    volumes: list[Manifest] = []
    if k8s.volume_claim:
        mounts.append({"name": RUNS_VOLUME, "mountPath": layout.mgpu_dir(k8s.workdir)})
        volumes.append({"name": RUNS_VOLUME, "persistentVolumeClaim": {"claimName": k8s.volume_claim}})
    if k8s.shm is not False:
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
        size = {"sizeLimit": k8s.shm} if isinstance(k8s.shm, str) else {}
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", **size}})
    for volume in k8s.volumes or ():
        mounts.append(volume.mounted())
        volumes.append({"name": volume.name, **volume.source()})
    if volumes:
        container["volumeMounts"], pod["volumes"] = mounts, volumes


def _pod(spec: KubernetesSpec, masked: bool) -> Manifest:
    """The pod template's spec: one container, the task core's pod entry, where and how it is scheduled."""
    k8s, launch = spec.kubernetes, spec.launch
    container: Manifest = {"name": "worker", "image": k8s.image, "command": pod_command(spec), "workingDir": k8s.workdir,
                 "ports": [{"name": "tf", "containerPort": k8s.port, "protocol": "TCP"}], "env": _env(spec, masked)}
    if k8s.image_pull_policy:
        container["imagePullPolicy"] = k8s.image_pull_policy.value
    if _resources(spec):
        container["resources"] = _resources(spec)
    pod: Manifest = {"restartPolicy": "Never", "containers": [container],
           # the notice (SIGTERM) to KILL: the group's coordinated save, with room for the core's own stop
           "terminationGracePeriodSeconds": math.ceil(launch.preempt_grace) + 10}
    _volumes(spec, container, pod)
    scheduling: Manifest = {"nodeSelector": k8s.node_selector,
                  "tolerations": k8s.tolerations and [_toleration(t) for t in k8s.tolerations],
                  "affinity": k8s.affinity, "topologySpreadConstraints": k8s.topology_spread_constraints,
                  # the node's network; its DNS policy so that the JobSet's host names still resolve
                  "hostNetwork": k8s.host_network, "dnsPolicy": k8s.host_network and "ClusterFirstWithHostNet",
                  "imagePullSecrets": k8s.image_pull_secrets and [{"name": s} for s in k8s.image_pull_secrets],
                  "serviceAccountName": k8s.service_account, "priorityClassName": k8s.priority_class}
    return {**pod, **{key: value for key, value in scheduling.items() if value}}


def _metadata(spec: KubernetesSpec) -> Manifest:
    """Labels (ours, the run's id, first) and annotations, the same on the JobSet and on each pod."""
    k8s = spec.kubernetes
    meta: Manifest = {"labels": {RUN_LABEL: k8s.jobset, **(k8s.labels or {})}}
    return {**meta, "annotations": dict(k8s.annotations)} if k8s.annotations else meta


def manifest(spec: KubernetesSpec, masked: bool = False) -> Manifest:
    """The JobSet, the same for the same spec (its name is the run's id: `kubectl apply` updates one object);
    `masked`: env values whose names look secret shown as **** (for --dry-run)."""
    k8s, launch, name = spec.kubernetes, spec.launch, spec.kubernetes.jobset
    job: Manifest = {"completionMode": "Indexed", "completions": k8s.workers, "parallelism": k8s.workers,
           "backoffLimit": 0,  # one failed pod fails the group at once (fail fast)
           # a pod that saved on notice (exit 75), or one Kubernetes took away (evicted by a drain, preempted by
           # the scheduler, its node lost: condition DisruptionTarget) whatever its exit, fails its Job with
           # reason PodFailurePolicy: restarted below without counting against maxRestarts
           "podFailurePolicy": {"rules": [
               {"action": "FailJob", "onExitCodes": {"containerName": "worker", "operator": "In",
                                                     "values": [EXIT_PREEMPTED]}},
               {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
           "template": {"metadata": _metadata(spec), "spec": _pod(spec, masked)}}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": name, "namespace": k8s.namespace, **_metadata(spec)},
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": name},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": job}}],
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]},
            "failurePolicy": {"maxRestarts": launch.max_restarts, "restartStrategy": "Recreate", "rules": [
                {"name": PREEMPTED_RULE, "action": "RestartJobSetAndIgnoreMaxRestarts",
                 "onJobFailureReasons": ["PodFailurePolicy"]}]},
        },
    }


def to_yaml(data: Manifest) -> str:
    """YAML; JSON (which is YAML, and kubectl takes it) where PyYAML is not installed."""
    try:
        import yaml  # only `render` needs it
    except ImportError:
        return json.dumps(data, indent=2) + "\n"
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=120)
