"""A manifest a cluster takes as is: the [kubernetes] keys a real cluster needs (a stable name, node selector,
tolerations, image pull policy and secrets, service account, priority class, labels and annotations, env
from Secrets, a memory-backed /dev/shm), each rendered by the real `mgpu-cluster render` and checked against
JobSet's published models (Kubernetes' Pod spec inside); what Kubernetes would refuse is refused by key."""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, Cli, free_port

from launcher.engines.kubernetes import render
from launcher.engines.kubernetes.validate import validate
from launcher.errors import SpecError
from launcher.spec.kubernetes import Dns1035, name_from
from launcher.spec.file import parse_spec

PY = sys.executable
DIGITS = {"entrypoint": "worker.examples.digits:task"}


def docs_example() -> str:
    """The GPU node pool of docs/engines.md, as the page shows it."""
    page = (REPO / "docs" / "engines.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```toml\n(.*?)^```", page, re.M | re.S)
    found = [b for b in blocks if 'name = "resnet-a100"' in b]
    assert len(found) == 1, "docs/engines.md lost its GPU node pool example"
    return found[0]


def rendered(cli, spec, *args) -> tuple[str, dict]:
    """`mgpu-cluster render SPEC` as text, and as a JobSet that JobSet's models take unchanged."""
    r = cli("render", spec, *args, timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return r.stdout, validate(yaml.safe_load(r.stdout))


def pod_template(m: dict) -> dict:
    return m["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]


def test_the_docs_gpu_node_pool_renders_each_key_as_kubernetes_spells_it(cli, tmp_path):
    spec = tmp_path / "gpu.toml"
    spec.write_text(docs_example())
    _, m = rendered(cli, spec)
    template = pod_template(m)
    pod, container = template["spec"], template["spec"]["containers"][0]
    assert m["metadata"]["name"] == m["spec"]["network"]["subdomain"] == "resnet-a100"  # name, not the file's
    labels = {"mgpu-cluster/run": "resnet-a100", "team": "vision", "kueue.x-k8s.io/queue-name": "gpu"}
    for meta in (m["metadata"], template["metadata"]):  # on the JobSet (Kueue reads it there) and each pod
        assert meta["labels"] == labels
        assert meta["annotations"] == {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert (pod["serviceAccountName"], pod["priorityClassName"]) == ("trainer", "training")
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and container["imagePullPolicy"] == "IfNotPresent"
    assert container["resources"]["limits"] == {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "8"}
    mounts = {v["name"]: v["mountPath"] for v in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts == {"runs": "/workspace/.mgpu", "shm": "/dev/shm"}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert volumes["runs"]["persistentVolumeClaim"] == {"claimName": "mgpu-runs"}
    assert container["env"] == [
        {"name": "PYTHONSAFEPATH", "value": "1"},  # the pod entry's guard (test_kubernetes: a worker.py in workdir)
        {"name": "NCCL_DEBUG", "value": "WARN"},
        {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}}]


def test_the_same_spec_renders_the_same_bytes_named_by_its_file(cli, tmp_path):
    """No time or random value: from any folder, to stdout or a file, one spec is one object (`kubectl apply`
    again updates it) and one run folder; `up --dry-run` shows the same."""
    folder = tmp_path / "specs"
    folder.mkdir()
    spec = folder / "GPU train.v2.toml"
    spec.write_text((REPO / "cluster.k8s.toml").read_text())
    text, m = rendered(cli, spec)
    elsewhere = Cli(cli.home, folder)
    assert elsewhere("render", spec.name, timeout=60).stdout == text
    for out in ("a.yaml", "b.yaml"):
        assert cli("render", spec, "-o", tmp_path / out, timeout=60).returncode == 0
        assert (tmp_path / out).read_text() == text
    assert not re.search(r"\d{8}-\d{6}", text), "a time stamp in the manifest"
    name = "gpu-train-v2"
    command = pod_template(m)["spec"]["containers"][0]["command"]
    assert m["metadata"]["name"] == m["spec"]["network"]["subdomain"] == m["metadata"]["labels"][
        "mgpu-cluster/run"] == command[command.index("--run-id") + 1] == name
    assert command[command.index("--run-dir") + 1] == f"/workspace/.mgpu/runs/{name}"
    assert command[command.index("--hosts") + 1] == f"{name}-worker-0-{{i}}.{name}"
    dry = cli("up", "--dry-run", spec, timeout=60)
    assert dry.returncode == 0 and f"name: {name}\n" in dry.stdout and f"--run-id {name} " in dry.stdout, dry.stderr
    spec.write_text(spec.read_text().replace("[kubernetes]\n", '[kubernetes]\nname = "digits-cpu"\n'))
    assert rendered(cli, spec)[1]["metadata"]["name"] == "digits-cpu"


@pytest.mark.parametrize("stem, workers, name", [
    ("GPU train.v2", 2, "gpu-train-v2"), ("cluster.k8s", 2, "cluster-k8s"), ("2026-run", 2, "mgpu-2026-run"),
    ("___", 2, "mgpu"), ("Übung", 2, "bung"), ("ü", 2, "mgpu"),
    ("a" * 80, 10, "a" * 46), ("a" * 80, 100000, "a" * 42), ("x" * 41 + "-y", 100000, "x" * 41)])
def test_a_name_from_a_file_is_one_that_jobset_takes(stem, workers, name):
    """Lower-case, '-' for the rest, a letter first, cut so that the last pod's name is at most 63 (no '-'
    left at the end): the name key takes it, and the manifest passes the models."""
    assert name_from(stem, workers) == name and Dns1035.match(name)
    spec = parse_spec({"kubernetes": {"image": "x", "workers": workers, "name": name, "volume_claim": "runs"},
                       "training": DIGITS})
    assert validate(yaml.safe_load(render(spec)))["metadata"]["name"] == name


@pytest.mark.parametrize("shm, volume", [
    (True, {"medium": "Memory"}), ("16Gi", {"medium": "Memory", "sizeLimit": "16Gi"}), (False, None)])
def test_shm_is_a_memory_volume_at_dev_shm(shm, volume):
    spec = parse_spec({"kubernetes": {"image": "x", "workers": 1, "shm": shm}, "training": DIGITS})
    pod = pod_template(validate(yaml.safe_load(render(spec))))["spec"]
    got = {v["name"]: v for v in pod.get("volumes", [])}
    assert (got["shm"]["emptyDir"] if volume else got.get("shm")) == volume
    mounts = pod["containers"][0].get("volumeMounts", [])
    assert ({"name": "shm", "mountPath": "/dev/shm"} in mounts) == bool(volume)


@pytest.mark.parametrize("k8s, named", [
    ({"name": "Resnet"}, "kubernetes.name: 'Resnet' is not a JobSet name"),
    ({"name": "9lives"}, "kubernetes.name"),
    ({"name": "a" * 47}, "at most 46 characters"),  # 10 workers: a-...-worker-0-9-xxxxx
    ({"name": "run-"}, "kubernetes.name"),
    ({"node_selector": {"nvidia.com/gpu product": "x"}}, "kubernetes.node_selector: 'nvidia.com/gpu product'"),
    ({"node_selector": {"pool": "a" * 64}}, "not a label value"),
    ({"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "value": "present"}]},
     r"tolerations\[0\]: operator \"Exists\""),
    ({"tolerations": [{"effect": "NoSchedule"}]}, "needs operator = \"Exists\""),
    ({"tolerations": [{"key": "a", "effect": "NoSchedule", "toleration_seconds": 30}]}, "NoExecute"),
    ({"tolerations": [{"key": "a", "effect": "NoExecute", "toleration_seconds": 2**31}]},
     r"tolerations\[0\]\.toleration_seconds: "),
    ({"tolerations": [{"key": "a", "effect": "NoScheduling"}]}, r"tolerations\[0\]\.effect: "),
    ({"tolerations": [{"key": "a", "operator": "Gt", "value": "1"}]}, r"tolerations\[0\]\.operator: "),
    ({"tolerations": [{"key": "a", "efect": "NoSchedule"}]},
     r"tolerations\[0\]\.efect: unknown key \(did you mean 'effect'"),
    # Kubernetes' spelling, copied from a manifest: the hint names ours, from the table the key is in
    ({"tolerations": [{"key": "a", "effect": "NoExecute", "tolerationSeconds": 5}]},
     r"tolerationSeconds: unknown key \(did you mean 'toleration_seconds'\?\)"),
    ({"nodeSelector": {"pool": "gpu"}}, r"kubernetes\.nodeSelector: unknown key \(did you mean 'node_selector'"),
    ({"serviceAccountName": "trainer"}, r"did you mean 'service_account'"),
    ({"secret_env": {"A": {"name": "wandb", "key": "k"}}}, r"secret_env\.A\.name: unknown key(\n|$)"),
    ({"image_pull_policy": "always"}, "kubernetes.image_pull_policy"),
    ({"image_pull_secrets": ["RegCred"]}, r"image_pull_secrets: \[0\] 'RegCred'"),
    ({"service_account": "trainer sa"}, "kubernetes.service_account"),
    ({"priority_class": "High"}, "kubernetes.priority_class"),
    ({"labels": {"mgpu-cluster/run": "x"}}, "mgpu-cluster/run: labels under mgpu-cluster/"),
    ({"labels": {"team": "vision ml"}}, "kubernetes.labels: team"),
    ({"annotations": {"example.com/notes": "x" * (256 * 1024)}}, "256 KiB"),
    ({"annotations": {"/notes": "x"}}, "not an annotation key"),
    ({"env": {"HF_TOKEN": "hf_abc"}}, "kubernetes.env: HF_TOKEN: a name that looks secret"),
    ({"env": {"DB_PASSWORD": "pw"}}, "DB_PASSWORD"),
    ({"secret_env": {"TF_CONFIG": {"secret": "s", "key": "k"}}}, "kubernetes.secret_env: TF_CONFIG"),
    ({"secret_env": {"A": {"secret": "wandb"}}}, r"secret_env\.A\.key: required"),
    ({"secret_env": {"A": {"secret": "Wandb", "key": "k"}}}, "not a Secret name"),
    ({"secret_env": {"A": {"secret": "w", "key": "a/b"}}}, "not a key of a Secret"),
    ({"env": {"A": "1"}, "secret_env": {"A": {"secret": "w", "key": "k"}}}, "env and secret_env both set A"),
    ({"shm": "64GB"}, "kubernetes.shm: '64GB' is not a Kubernetes quantity"),
    ({"shm": "2Ei"}, "kubernetes.shm: .* more than any pod gets"),
    ({"env": {"PYTHONSAFEPATH": "1"}}, "kubernetes.env: PYTHONSAFEPATH: set in each pod by the rendered JobSet"),
    ({"env": {"JOB_COMPLETION_INDEX": "1"}}, "kubernetes.env: JOB_COMPLETION_INDEX: set in each pod by Kubernetes"),
    ({"volumes": [{"name": "data", "mount": "/data"}]}, r"volumes\[0\]: volume 'data': give exactly one source .*none"),
    ({"volumes": [{"name": "data", "mount": "/data", "claim": "a", "host_path": "/x"}]}, "claim, host_path given"),
    ({"volumes": [{"name": "shm", "mount": "/data", "claim": "a"}]}, r"volumes\[0\]\.name: 'shm' is the name of"),
    ({"volumes": [{"name": "Data", "mount": "/data", "claim": "a"}]}, r"volumes\[0\]\.name: 'Data' is not a volume"),
    ({"volumes": [{"name": "d", "mount": "data", "claim": "a"}]}, r"volumes\[0\]\.mount: 'data' is not a mount path"),
    ({"volumes": [{"name": "d", "mount": "/workspace/.mgpu/", "claim": "a"}]},
     "'d' and runs \\(volume_claim\\) both mount at /workspace/.mgpu/"),
    ({"volumes": [{"name": "d", "mount": "/a", "claim": "a"}, {"name": "d", "mount": "/b", "claim": "b"}]},
     "two volumes named 'd'"),
    ({"volumes": [{"name": "d", "mount": "/a", "claim": "a"}, {"name": "e", "mount": "/a", "claim": "b"}]},
     "'e' and 'd' both mount at /a"),
    ({"volumes": [{"name": "d", "mount": "/a", "claim": "a", "mountPath": "/x"}]}, r"mountPath: unknown key"),
    ({"volumes": [{"name": "d", "mount": "/a", "sub_path": "../etc", "claim": "a"}]}, "not a folder inside"),
    ({"volumes": [{"name": "d", "mount": "/a", "empty_dir": "10GB"}]}, "'10GB' is not a Kubernetes quantity"),
    ({"volumes": [{"name": "d", "mount": "/a", "nfs": {"server": "nfs", "path": "data"}}]},
     r"nfs\.path: 'data' is not an NFS export"),
    ({"resources": {"nvidia.com/gpu": 1}}, "nvidia.com/gpu: set with the key gpus_per_worker"),
    ({"resources": {"memory": "1Gi"}}, "memory: set with the key memory"),
    ({"resources": {"rdma/hca": "0.5"}}, "rdma/hca: '0.5': a device .* whole units"),
    ({"resources": {"rdma/hca": 0}}, "rdma/hca: 0: give a count of at least 1"),
    ({"resources": {"rdma hca": 1}}, "'rdma hca' is not a resource key"),
    ({"affinity": {"nodeAfinity": {}}}, "kubernetes.affinity: not a Kubernetes Affinity .* nodeAfinity: not a field"),
    ({"topology_spread_constraints": [{"maxSkew": 1, "topologyKey": "k", "whenUnsatisfiable": "Never"}]},
     r"topology_spread_constraints: \[0\] not a Kubernetes TopologySpreadConstraint .* whenUnsatisfiable"),
    ({"topology_spread_constraints": [{"maxSkew": "one", "topologyKey": "k", "whenUnsatisfiable": "ScheduleAnyway"}]},
     "maxSkew: Input should be a valid integer"),
    ({"hostNetwork": True}, r"kubernetes\.hostNetwork: unknown key \(did you mean 'host_network'"),
])
def test_what_kubernetes_would_refuse_is_refused_by_key(k8s, named):
    base = {"image": "x", "workers": 10, "volume_claim": "runs"}
    assert parse_spec({"kubernetes": base, "training": DIGITS}).num_workers == 10  # fine without the extra
    with pytest.raises(SpecError, match=named):
        parse_spec({"kubernetes": {**base, **k8s}, "training": DIGITS})


def test_every_toleration_kubernetes_takes_renders_and_passes_the_models():
    tolerations = [{"operator": "Exists"}, {"key": "nvidia.com/gpu", "operator": "Exists"},
                   {"key": "dedicated", "value": "ml", "effect": "NoSchedule"},
                   {"key": "spot", "operator": "Equal", "value": "", "effect": "PreferNoSchedule"},
                   {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
                    "toleration_seconds": 0}]
    spec = parse_spec({"kubernetes": {"image": "x", "workers": 1, "tolerations": tolerations}, "training": DIGITS})
    pod = pod_template(validate(yaml.safe_load(render(spec))))["spec"]
    assert pod["tolerations"] == [
        {"operator": "Exists"}, {"key": "nvidia.com/gpu", "operator": "Exists"},
        {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"},
        {"key": "spot", "operator": "Equal", "value": "", "effect": "PreferNoSchedule"},
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 0}]


@pytest.mark.cluster
def test_a_value_from_a_secret_reaches_the_training_and_no_file_of_the_run(tmp_path):
    """The pod entry, run from the rendered command with the env as the kubelet resolves it (the secretKeyRef's
    value): the training sees the value; the manifest and every file of the run folder never hold it."""
    value = "s3cr3t-" + hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12]
    seen = tmp_path / "seen.json"
    show = f"import json, os; open({str(seen)!r}, 'w').write(json.dumps(dict(os.environ)))"
    name = f"secret-{secrets.token_hex(4)}"  # the run's id: another session's pod of the same run would stop ours
    spec = parse_spec({"kubernetes": {"image": "x", "workers": 1, "python": PY, "name": name,
                                      "port": free_port(),  # the core refuses a port another test holds
                                      "workdir": str(tmp_path / "pod"),
                                      "secret_env": {"WANDB_API_KEY": {"secret": "wandb", "key": "api-key"}}},
                       "training": {"command": [PY, "-c", show]}})
    text = render(spec)
    assert value not in text
    container = pod_template(validate(yaml.safe_load(text)))["spec"]["containers"][0]
    stored = {("wandb", "api-key"): value}  # what the Secret holds in the cluster
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    env = {**{e["name"]: e["value"] for e in container["env"] if "value" in e},
           **{var: stored[ref["name"], ref["key"]] for var, ref in refs.items()}}
    (tmp_path / "pod").mkdir()
    r = subprocess.run(container["command"], env={**os.environ, **env, "JOB_COMPLETION_INDEX": "0"}, cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(seen.read_text())["WANDB_API_KEY"] == value
    run = tmp_path / "pod" / ".mgpu" / "runs" / name
    files = [p for p in run.rglob("*") if p.is_file()]
    assert any(p.name.startswith("events-") for p in files), files  # the core ran and recorded
    assert not [p for p in files if value.encode() in p.read_bytes()]


GPU_POOL = {
    "image": "x", "workers": 4, "name": "rdma", "gpus_per_worker": 8, "volume_claim": "runs", "shm": "64Gi",
    "host_network": True, "resources": {"rdma/hca": 1, "hugepages-2Mi": "2Gi"},
    "volumes": [{"name": "imagenet", "mount": "/data", "claim": "imagenet", "read_only": True},
                {"name": "nvme", "mount": "/scratch", "host_path": "/mnt/nvme0"},
                {"name": "cache", "mount": "/cache", "empty_dir": "100Gi"},
                {"name": "corpus", "mount": "/corpus", "nfs": {"server": "10.0.0.2", "path": "/export"},
                 "read_only": True, "sub_path": "v2"},
                {"name": "config", "mount": "/etc/train", "config_map": "train-config"},
                {"name": "keys", "mount": "/etc/keys", "secret": "gcs-key", "read_only": True}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "cloud.google.com/gke-accelerator", "operator": "In",
                               "values": ["nvidia-h100-80gb"]}]}]}},
                 "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                     {"labelSelector": {"matchLabels": {"mgpu-cluster/run": "rdma"}},
                      "topologyKey": "kubernetes.io/hostname"}]}},
    "topology_spread_constraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                     "whenUnsatisfiable": "ScheduleAnyway",
                                     "labelSelector": {"matchLabels": {"mgpu-cluster/run": "rdma"}}}]}


def test_a_gpu_node_pool_gets_its_volumes_network_placement_and_devices():
    """Volumes beside the run folder's claim, the node's network (with the DNS policy that keeps the JobSet's
    host names), affinity and spread as Kubernetes' own objects, devices besides GPUs: each as Kubernetes
    spells it, requests equal to limits, and the whole JobSet taken unchanged by the models."""
    spec = parse_spec({"kubernetes": GPU_POOL, "training": DIGITS})
    pod = pod_template(validate(yaml.safe_load(render(spec))))["spec"]
    container = pod["containers"][0]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["affinity"] == GPU_POOL["affinity"]
    assert pod["topologySpreadConstraints"] == GPU_POOL["topology_spread_constraints"]
    limits = {"nvidia.com/gpu": "8", "rdma/hca": "1", "hugepages-2Mi": "2Gi"}
    assert container["resources"] == {"requests": limits, "limits": limits}
    assert [v["name"] for v in pod["volumes"]] == [m["name"] for m in container["volumeMounts"]] == [
        "runs", "shm", "imagenet", "nvme", "cache", "corpus", "config", "keys"]
    volumes = {v.pop("name"): v for v in pod["volumes"]}
    assert volumes["imagenet"] == {"persistentVolumeClaim": {"claimName": "imagenet", "readOnly": True}}
    assert volumes["nvme"] == {"hostPath": {"path": "/mnt/nvme0", "type": "Directory"}}
    assert volumes["cache"] == {"emptyDir": {"sizeLimit": "100Gi"}}
    assert volumes["corpus"] == {"nfs": {"server": "10.0.0.2", "path": "/export", "readOnly": True}}
    assert volumes["config"] == {"configMap": {"name": "train-config"}}
    assert volumes["keys"] == {"secret": {"secretName": "gcs-key"}}
    mounts = {m.pop("name"): m for m in container["volumeMounts"]}
    assert mounts["imagenet"] == {"mountPath": "/data", "readOnly": True}
    assert mounts["corpus"] == {"mountPath": "/corpus", "readOnly": True, "subPath": "v2"}
    assert mounts["nvme"] == {"mountPath": "/scratch"}
    plain = pod_template(manifest_of({"image": "x", "workers": 1}))["spec"]
    assert not {"hostNetwork", "dnsPolicy", "affinity", "topologySpreadConstraints", "volumes"} & set(plain)


def manifest_of(k8s: dict, training: dict = DIGITS) -> dict:
    return validate(yaml.safe_load(render(parse_spec({"kubernetes": k8s, "training": training}))))


@pytest.mark.parametrize("training, program", [
    (DIGITS, [PY, "-m", "worker", "--entrypoint", "worker.examples.digits:task"]),
    ({"command": [PY, "train.py"]}, [PY, "train.py"])])
def test_the_pods_command_reads_as_python_dash_m_and_our_runner_keeps_the_guard(training, program):
    """No opaque `-c "import runpy..."` in the manifest: `python -m worker.task.pod ... -- PROGRAM`, the guard
    against a worker.py in workdir being PYTHONSAFEPATH=1 in the env; our runner keeps it (--safe-path), a
    program of the spec's own does not (its script's folder first on sys.path, as Python does)."""
    m = manifest_of({"image": "x", "workers": 2, "python": PY, "volume_claim": "runs"}, training)
    container = pod_template(m)["spec"]["containers"][0]
    command = container["command"]
    assert command[:3] == [PY, "-m", "worker.task.pod"] and "runpy" not in json.dumps(m)
    assert command[command.index("--") + 1:] == program
    assert ("--safe-path" in command) == ("command" not in training)
    assert {"name": "PYTHONSAFEPATH", "value": "1"} in container["env"]
