"""Kubernetes: the JobSet we render is checked against JobSet's published API models, and the pods'
command and env, taken from the rendered file as they are, train together (TensorFlow, and Keras 3 on
JAX) in two network namespaces whose /etc/hosts maps the JobSet's host names (what the cluster's DNS
does); SIGTERM to a pod saves and exits 75. No API server can run here, so nothing is applied."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import REPO, free_port, namespace_hosts, need, wait_for
from launcher.engines.kubernetes import render
from launcher.engines.kubernetes.render import manifest
from launcher.engines.kubernetes.validate import ManifestError, validate
from launcher.errors import SpecError
from launcher.spec.file import load_spec, parse_spec

PY = sys.executable
# the JobSet's name, which is the run's id: unique to this session, as the task core stops what a process of the
# same run and task leaves on its host (another session of these tests, a CI run beside ours, is such a process)
RUN = f"digits-{secrets.token_hex(4)}"


def gpu_spec():
    return parse_spec({"kubernetes": {"image": "registry/x:1", "workers": 4, "gpus_per_worker": 8, "cpu": "32",
                                      "memory": "200Gi", "volume_claim": "runs", "namespace": "ml"},
                       "training": {"command": ["python3", "train.py"], "checkpoint_dir": "/workspace/.mgpu/ck"},
                       "launch": {"max_restarts": 3, "preempt_grace": 120}})


@pytest.mark.parametrize("spec", [lambda: load_spec(REPO / "cluster.k8s.toml"), gpu_spec], ids=["example", "gpu"])
def test_rendered_jobsets_round_trip_through_jobsets_models(spec):
    cluster = spec()
    m = manifest(cluster)
    assert validate(json.loads(json.dumps(m))) == m  # unchanged: no unknown or ill-typed field anywhere
    job = m["spec"]["replicatedJobs"][0]["template"]["spec"]
    workers, launch = cluster.kubernetes.workers, cluster.launch
    assert (job["completionMode"], job["completions"], job["parallelism"], job["backoffLimit"]) == (
        "Indexed", workers, workers, 0)
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] >= launch.preempt_grace
    assert m["spec"]["network"]["enableDNSHostnames"] is True
    assert m["spec"]["successPolicy"]["operator"] == "All"
    policy = m["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == launch.max_restarts and policy["rules"][0]["action"] == \
        "RestartJobSetAndIgnoreMaxRestarts"  # a preemption (exit 75) restarts without counting
    rules = job["podFailurePolicy"]["rules"]  # each fails the Job with reason PodFailurePolicy (the rule above)
    assert rules[0]["onExitCodes"]["values"] == [75] and rules[1]["onPodConditions"][0]["type"] == "DisruptionTarget"
    assert policy["rules"][0]["onJobFailureReasons"] == ["PodFailurePolicy"]
    env = pod["containers"][0]["env"]
    assert all(set(e) == {"name", "value"} for e in env)  # no downward API: the command carries the rest
    limits = pod["containers"][0].get("resources", {}).get("limits", {})
    assert limits.get("nvidia.com/gpu") == (str(cluster.kubernetes.gpus_per_worker) if
                                            cluster.kubernetes.gpus_per_worker else None)


def _job(m):
    return m["spec"]["replicatedJobs"][0]["template"]["spec"]


@pytest.mark.parametrize("change, named", [
    (lambda m: _job(m)["template"]["spec"]["containers"][0].update(imagePullPolcy="x"), "imagePullPolcy"),
    (lambda m: _job(m).update(completions="2"), "completions"),
    (lambda m: m["spec"]["failurePolicy"]["rules"][0].update(action="RestartJobSetIgnoreMaxRestarts"),
     "RestartJobSetAndIgnoreMaxRestarts"),  # a value outside those the model's description lists
    (lambda m: m["spec"]["failurePolicy"]["rules"][0].update(name="pre-empted"), "regular|match"),
    (lambda m: _job(m)["podFailurePolicy"]["rules"][0].update(action="Fail"), "FailJob"),
    (lambda m: _job(m)["template"]["spec"].update(restartPolicy="Nevr"), "restartPolicy"),
], ids=["unknown-field", "wrong-type", "jobset-action", "rule-name", "pod-failure-action", "restart-policy"])
def test_what_jobset_does_not_take_is_refused(change, named):
    m = manifest(load_spec(REPO / "cluster.k8s.toml"))
    change(m)
    with pytest.raises(ManifestError, match=named):
        validate(m)


@pytest.mark.parametrize("extra, named", [
    ({"hosts": [{"address": "localhost", "port": 20000}]}, "exactly one of"),
    ({"defaults": {"python": "python3"}}, "defaults"),
    ({"sync": {}}, "sync"),
    ({"launch": {"min_hosts": 1}}, "launch.min_hosts"),
    ({"launch": {"accept_new_host_keys": True}}, "launch.accept_new_host_keys"),
    ({"launch": {"heartbeat_timeout": 30.0}}, "launch.heartbeat_timeout"),
    ({"launch": {"max_preemptions": 3}}, "launch.max_preemptions"),
    ({"training": {"entrypoint": "worker.examples.digits:task", "checkpoint_dir": "/ck"}}, "volume_claim"),
    ({"kubernetes": {"image": "x", "workers": 2, "volume_claim": "runs"},  # a volume, but the checkpoint not on it
      "training": {"entrypoint": "worker.examples.digits:task", "checkpoint_dir": "/workspace/ck"}},
     "below /workspace/.mgpu"),
    ({"kubernetes": {"image": "x", "workers": 2, "volume_claim": "runs"},
      "training": {"entrypoint": "worker.examples.digits:task", "checkpoint_dir": ".mgpu/../ck"}}, "below"),
    ({"kubernetes": {"image": "x", "workers": 2, "workdir": "rel"}}, "kubernetes.workdir"),
    ({"kubernetes": {"image": "x", "workers": 2, "namespace": "ML"}}, "kubernetes.namespace"),
    ({"kubernetes": {"image": "x", "workers": 2, "memory": "16GB"}}, "kubernetes.memory"),
    ({"kubernetes": {"workers": 2}}, "kubernetes.image"),
    ({"kubernetes": {"image": "x", "workers": 2}}, "storage every pod shares"),  # the default checkpoint, no volume
    ({"training": {"entrypoint": "worker.examples.digits:task", "checkpoint_dir": "file:///ck"}}, "volume_claim"),
    ({"kubernetes": {"image": "x", "workers": 2, "volume_claim": "runs", "gpus_per_worker": 2},
      "training": {"entrypoint": "worker.examples.digits:task", "local_replicas": 4}}, "training.local_replicas"),
    ({"kubernetes": {"image": "x", "workers": 2, "namespace": "team-" + "a" * 60}}, "kubernetes.namespace"),
    ({"kubernetes": {"image": " x:1 ", "workers": 2}}, "kubernetes.image"),
    ({"kubernetes": {"image": "x", "workers": 100001}}, "kubernetes.workers"),
    ({"kubernetes": {"image": "x", "workers": 2, "env": {"JOB_COMPLETION_INDEX": "0"}}}, "JOB_COMPLETION_INDEX"),
    ({"kubernetes": {"image": "x", "workers": 2, "env": {"TF_CONFIG": "{}"}}}, "TF_CONFIG"),
])
def test_keys_that_mean_nothing_to_a_jobset_are_refused_by_name(extra, named):
    base = {"kubernetes": {"image": "x", "workers": 2, "volume_claim": "runs"},
            "training": {"entrypoint": "worker.examples.digits:task"}}
    assert parse_spec(base).num_workers == 2  # the spec without the extra is fine
    with pytest.raises(SpecError, match=named):
        parse_spec({**base, **extra})


def test_render_and_check_from_the_cli(cli, tmp_path):
    out = tmp_path / "jobset.yaml"
    r = cli("render", REPO / "cluster.k8s.toml", "-o", out, timeout=60)
    assert r.returncode == 0 and "kubectl apply -f" in r.stdout, r.stderr
    assert yaml.safe_load(out.read_text())["kind"] == "JobSet"
    assert out.stat().st_mode & 0o777 == 0o600  # it holds the spec's env as given, secrets included
    dry = cli("up", "--dry-run", REPO / "cluster.k8s.toml", timeout=60)
    assert dry.returncode == 0 and "kind: JobSet" in dry.stdout
    # the rest, one paragraph and exit 2, before anything is planned or recorded (no run in MGPU_HOME)
    for args in (["check", REPO / "cluster.k8s.toml"], ["up", REPO / "cluster.k8s.toml"],
                 ["up", "--detach", REPO / "cluster.k8s.toml"], ["render", REPO / "cluster.example.toml"]):
        r = cli(*args, timeout=60)
        said = "kubectl apply -f" if args[0] != "render" else "no [kubernetes] table"
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stdout + r.stderr, r.stderr
        assert "preflight" not in r.stdout + r.stderr, r.stdout  # not told as a refused preflight of hosts
    assert not list((tmp_path / "mgpu-home").glob("runs/*")), "a run that Kubernetes starts is not recorded here"


def test_names_and_quantities_kubernetes_takes_are_taken():
    spec = parse_spec({"kubernetes": {"image": "x", "workers": 2, "volume_claim": "data.shared-1", "memory": "1.5Pi",
                                      "cpu": ".5", "gpus_per_worker": 2},
                       "training": {"entrypoint": "worker.examples.digits:task", "local_replicas": 2}})
    assert spec.kubernetes.volume_claim == "data.shared-1" and spec.kubernetes.memory == "1.5Pi"
    with pytest.raises(SpecError, match="slurm.gpus_per_node = 2"):
        parse_spec({"slurm": {"nodes": 2, "workdir": "/tmp", "gpus_per_node": 2},
                    "training": {"entrypoint": "worker.examples.digits:task", "local_replicas": 4}})


@pytest.mark.parametrize("k8s, checkpoint_dir", [
    ({"volume_claim": "runs"}, "/workspace/.mgpu/ck"), ({"volume_claim": "runs"}, ".mgpu/ck"),
    ({}, "gs://bucket/ck"), ({"workers": 1}, "/ck")])
def test_a_checkpoint_every_pod_shares_is_taken(k8s, checkpoint_dir):
    spec = parse_spec({"kubernetes": {"image": "x", "workers": 2, **k8s},
                       "training": {"entrypoint": "worker.examples.digits:task", "checkpoint_dir": checkpoint_dir}})
    assert f"--checkpoint-dir {checkpoint_dir}" in " ".join(manifest(spec)["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]["containers"][0]["command"])


def test_a_secret_is_never_written_in_clear_only_named_from_a_kubernetes_secret(cli, tmp_path):
    """A secret-looking name in env is refused (exit 2, no value shown anywhere); secret_env renders a
    secretKeyRef: the manifest names the Secret and its key, never a value."""
    spec = tmp_path / "k8s.toml"
    text = (REPO / "cluster.k8s.toml").read_text()
    spec.write_text(text.replace('env = { TF_CPP_MIN_LOG_LEVEL = "2" }',
                                 'env = { TF_CPP_MIN_LOG_LEVEL = "2", WANDB_API_KEY = "s3cr3t-value" }'))
    for args in (["render", spec], ["up", "--dry-run", spec]):
        r = cli(*args, timeout=60)
        assert r.returncode == 2 and "kubernetes.env: WANDB_API_KEY" in r.stderr and "secret_env" in r.stderr, r.stderr
        assert "s3cr3t-value" not in r.stdout + r.stderr and "Traceback" not in r.stderr
    spec.write_text(text.replace('env = { TF_CPP_MIN_LOG_LEVEL = "2" }', 'env = { TF_CPP_MIN_LOG_LEVEL = "2" }\n'
                                 'secret_env = { WANDB_API_KEY = { secret = "wandb", key = "api-key" } }'))
    r = cli("render", spec, timeout=60)
    assert r.returncode == 0, r.stderr
    env = _job(validate(yaml.safe_load(r.stdout)))["template"]["spec"]["containers"][0]["env"]
    assert {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}} in env
    assert {"name": "TF_CPP_MIN_LOG_LEVEL", "value": "2"} in env


@pytest.mark.parametrize("missing", ["kubeflow_trainer_api", "yaml"])
def test_render_without_the_kubernetes_extra(missing):
    """Without kubeflow-trainer-api: one paragraph naming the extra, exit 2; without PyYAML: JSON (YAML too)."""
    code = (f"import sys; sys.modules[{missing!r}] = None; sys.argv = ['mgpu-cluster', 'render', "
            f"{str(REPO / 'cluster.k8s.toml')!r}]; from launcher.cli import main; main()")
    r = subprocess.run([PY, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in r.stderr, r.stderr
    if missing == "yaml":
        assert r.returncode == 0 and validate(json.loads(r.stdout))["kind"] == "JobSet", r.stderr
    else:
        assert r.returncode == 2 and "mgpu-cluster[kubernetes]" in r.stderr and not r.stdout, r.stderr


def test_the_pod_entry_builds_tf_config_from_its_index_and_the_specs_env_stands(tmp_path):
    """The rendered command and env as they are, with Kubernetes' JOB_COMPLETION_INDEX: TF_CONFIG names the
    JobSet's hosts, the task folder and its records are written, and a value of [kubernetes].env wins."""
    show = "import json, os; print(json.dumps({k: os.environ.get(k) for k in %r}))" % (
        ["TF_CONFIG", "MGPU_TASK_INDEX", "MGPU_RUN_DIR", "MGPU_RUN_ID", "TF_USE_LEGACY_KERAS", "TF_CPP_MIN_LOG_LEVEL"],)
    port = free_port()  # the core refuses a port that another process holds
    spec = parse_spec({"kubernetes": {"image": "x", "workers": 3, "python": PY, "port": port, "name": RUN,
                                      "workdir": str(tmp_path), "env": {"TF_USE_LEGACY_KERAS": "0"}},
                       "training": {"command": [PY, "-c", show]}})
    m = yaml.safe_load(render(spec))
    container = _job(m)["template"]["spec"]["containers"][0]
    env = {**os.environ, **{e["name"]: e["value"] for e in container["env"]}, "JOB_COMPLETION_INDEX": "2"}
    r = subprocess.run(container["command"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    seen = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    name, task = m["metadata"]["name"], tmp_path / ".mgpu" / "runs" / RUN / "task-2"
    hosts = [f"{name}-worker-0-{i}.{name}:{port}" for i in range(3)]
    assert json.loads(seen["TF_CONFIG"]) == {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": 2}}
    assert (seen["MGPU_TASK_INDEX"], seen["MGPU_RUN_DIR"], seen["MGPU_RUN_ID"]) == ("2", str(task), RUN)
    assert seen["TF_USE_LEGACY_KERAS"] == "0"  # the spec's value, not the builder's default
    events = [json.loads(line) for line in (task / "events-0.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events][0] == "started" and events[-1]["event"] == "exit" and events[-1]["code"] == 0
    bad = subprocess.run(container["command"], env={**env, "JOB_COMPLETION_INDEX": "3"}, cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "JOB_COMPLETION_INDEX" in bad.stderr and "Traceback" not in bad.stderr


def test_a_worker_py_in_the_workdir_does_not_stand_in_for_our_package(tmp_path):
    """The rendered command and env, run in the container's workingDir where the user's code has a worker.py:
    the pod entry (PYTHONSAFEPATH=1) and, with --safe-path, our runner are ours (the worker.py never runs); a
    program of the spec's own gets Python's usual sys.path (it imports its neighbour) and no PYTHONSAFEPATH."""
    work, shadowed = tmp_path / "workspace", tmp_path / "shadowed"
    work.mkdir()
    (work / "worker.py").write_text(f"open({str(shadowed)!r}, 'w').write('ran'); raise SystemExit(3)\n")
    (work / "helper.py").write_text("WHERE = 'beside train.py'\n")
    (work / "train.py").write_text("import json, os, helper\n"
                                   "print(json.dumps([helper.WHERE, os.environ.get('PYTHONSAFEPATH')]))\n")

    def pod(training: dict) -> tuple[list[str], dict]:
        spec = parse_spec({"kubernetes": {"image": "x", "workers": 1, "python": PY, "port": free_port(),
                                          "name": f"safe-{secrets.token_hex(4)}", "workdir": str(work)},
                           "training": training})
        container = _job(yaml.safe_load(render(spec)))["template"]["spec"]["containers"][0]
        assert container["workingDir"] == str(work)
        env = {**os.environ, **{e["name"]: e["value"] for e in container["env"]}, "JOB_COMPLETION_INDEX": "0"}
        return container["command"], env

    command, env = pod({"command": [PY, "train.py"]})
    r = subprocess.run(command, env=env, cwd=work, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not shadowed.exists(), r.stdout + r.stderr
    assert json.loads([line for line in r.stdout.splitlines() if line.startswith("[")][-1]) == ["beside train.py", None]
    command, env = pod({"entrypoint": "train:task"})
    command = command[:command.index("--entrypoint")] + ["--help"]  # our runner as rendered, told only to say how
    assert "--safe-path" in command and command[command.index("--") + 1:] == [PY, "-m", "worker", "--help"]
    r = subprocess.run(command, env=env, cwd=work, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "usage: python -m worker" in r.stdout and not shadowed.exists(), r.stdout + r.stderr


@pytest.fixture(scope="module")
def pods_hosts(tmp_path_factory):
    yield from namespace_hosts(2, tmp_path_factory.mktemp("k8shosts"))


def pods(hosts, tmp_path: Path, training: dict) -> list[tuple[list[str], dict, str]]:
    """Each pod's (command, env, namespace) from the rendered manifest, its host names in /etc/netns."""
    spec = parse_spec({"kubernetes": {"image": "unused", "workers": 2, "python": PY, "port": 20000, "name": RUN,
                                      "workdir": str(tmp_path / "pods"), "volume_claim": "runs"},
                       "training": training, "launch": {"preempt_grace": 30}})
    rendered = tmp_path / "jobset.yaml"
    rendered.write_text(render(spec))  # what `mgpu-cluster render -o` writes
    m = yaml.safe_load(rendered.read_text())
    container = m["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    name = m["metadata"]["name"]
    lines = "".join(f"{h.address} {name}-worker-0-{i}.{name} {name}-worker-0-{i}\n" for i, h in enumerate(hosts.hosts))
    for h in hosts.hosts:
        folder = Path("/etc/netns") / h.netns
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text("127.0.0.1 localhost\n" + lines)
    return [(container["command"], {**env, "JOB_COMPLETION_INDEX": str(i)}, h.netns) for i, h in enumerate(hosts.hosts)]


def start(pod) -> subprocess.Popen:
    command, env, netns = pod
    return subprocess.Popen(["ip", "netns", "exec", netns, *command], env={**os.environ, **env}, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@contextlib.contextmanager
def running(each: list):
    """The pods started; any still running at the end killed (their training dies with its core)."""
    procs = [start(p) for p in each]
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def netns_hosts_files(pods_hosts):
    yield pods_hosts
    for h in pods_hosts.hosts:
        shutil.rmtree(Path("/etc/netns") / h.netns, ignore_errors=True)


@pytest.mark.cluster
def test_two_pods_from_the_rendered_file_train_together(netns_hosts_files, tmp_path):
    with running(pods(netns_hosts_files, tmp_path, {
            "entrypoint": "worker.examples.digits:task", "epochs": 2, "batch_size_per_replica": 32})) as procs:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "2 replica(s) in sync" in outs[0] and "val_accuracy" in outs[1], outs
    for i in (0, 1):
        events = (tmp_path / "pods" / ".mgpu" / "runs" / RUN / f"task-{i}" / "events-0.jsonl").read_text()
        assert '"event": "started"' in events and '"code": 0' in events


@pytest.mark.cluster
def test_two_pods_of_a_jax_jobset_train_digits_keras3_in_step(netns_hosts_files, tmp_path):
    """backend = "jax": each pod's entry builds Keras' variables from its index (JAX's coordinator and gloo on the
    JobSet's host names) and the Keras 3 runner trains with 2 CPU devices per pod: 4 replicas, equal weights."""
    need("jax")
    weights = tmp_path / "pods" / "weights-{task}.npz"
    training = {"entrypoint": "worker.examples.digits_keras3:task", "backend": "jax", "local_replicas": 2,
                "epochs": 2, "batch_size_per_replica": 16,
                "args": ["--steps-per-epoch", "6", "--save-weights", str(weights)]}
    with running(pods(netns_hosts_files, tmp_path, training)) as procs:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for i, out in enumerate(outs):
        role = "chief" if i == 0 else "worker"
        assert f"task {i} of 2 ({role}): DataParallel (jax), 4 replica(s) in sync" in out, out
        assert "epoch 2/2 loss=" in out, out
        events = (tmp_path / "pods" / ".mgpu" / "runs" / RUN / f"task-{i}" / "events-0.jsonl").read_text()
        assert '"event": "started"' in events and '"code": 0' in events
    a, b = (np.load(str(weights).format(task=i)) for i in (0, 1))
    assert a.files and a.files == b.files and all(np.array_equal(a[k], b[k]) for k in a.files), "weights differ"


@pytest.mark.cluster
def test_sigterm_to_a_pod_saves_and_exits_75_and_the_pods_started_again_resume(netns_hosts_files, tmp_path):
    ckpt = tmp_path / "pods" / ".mgpu" / "runs" / RUN / "checkpoint"  # the run folder's (here every pod sees it)
    each = pods(netns_hosts_files, tmp_path, {"entrypoint": "worker.examples.digits:task", "epochs": 3})
    task = tmp_path / "pods" / ".mgpu" / "runs" / RUN
    with running(each) as procs:
        wait_for(lambda: all(json.loads((task / f"task-{i}" / "progress.json").read_text() or "{}")
                             .get("global_step", 0) > 2 for i in (0, 1)) if all(
            (task / f"task-{i}" / "progress.json").exists() for i in (0, 1)) else False, 240, "both pods training")
        procs[1].send_signal(signal.SIGTERM)  # a node drain: the pod's core gets the notice
        outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [75, 75], outs  # both preempted: the JobSet's rule restarts on 75
    assert "saved a checkpoint" in outs[1] and list(ckpt.iterdir()), outs[1]
    steps = [re.search(r"saved a checkpoint at global step (\d+)", out) for out in outs]
    assert all(steps) and steps[0].group(1) == steps[1].group(1), outs  # one agreed step for the group
    assert "notice from another worker" in outs[0], outs[0]
    # what the JobSet's rule does next: the same pods again (same command and env), a new attempt of each
    with running(each) as again:
        outs = [p.communicate(timeout=300)[0] for p in again]
    assert [p.returncode for p in again] == [0, 0], outs
    for i in (0, 1):
        assert json.loads((task / f"task-{i}" / "progress.json").read_text())["first_global_step"] == int(
            steps[0].group(1)), outs[i]  # resumed at the saved step: nothing trained twice
        assert '"code": 0' in (task / f"task-{i}" / "events-1.jsonl").read_text()
