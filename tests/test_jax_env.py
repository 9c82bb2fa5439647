"""backend = "jax": the one builder's environment (Keras' distribution variables in place of TF_CONFIG) on
every engine: the plan and dry run, a Slurm task built on its node and a pod from its index (the real entries,
a fake `scontrol`), a user's own script under `command` started by `up`; the TensorFlow environment exactly as
it was; the host check of jax and Keras 3. No JAX training here."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from conftest import REPO, free_port, latest_state, need, write_spec
from launcher.engines.kubernetes.render import manifest, pod_command
from launcher.engines.slurm.plan import described_environment, given, run_folder
from launcher.plan import plan_tasks
from launcher.spec.file import parse_spec
from worker.preflight import doctor
from worker.host import env as task_env
from worker.host import layout
from worker.host.env import Backend, endpoint, task_environment

PY = sys.executable
KERAS = task_env.KERAS_VARIABLES
# the program of a task: what it was given, written to its folder
DUMP = ("import json, os; json.dump(dict(os.environ), open(os.path.join(os.environ['MGPU_RUN_DIR'], 'seen.json'), "
        "'w'))")


def keras_of(workers: list[str], rank: int) -> dict[str, str]:
    return {"KERAS_BACKEND": "jax", "KERAS_DISTRIBUTION_JOB_ADDRESSES": workers[0],
            "KERAS_DISTRIBUTION_NUM_PROCESSES": str(len(workers)), "KERAS_DISTRIBUTION_PROCESS_ID": str(rank)}


# ---------------------------------------------------------------- the builder (pure)

def test_the_builder_gives_every_rank_kerass_variables_and_no_tf_config():
    workers = [endpoint("fd00::7", 23456), endpoint("10.0.0.2", 23456), endpoint("node3", 23456)]
    assert workers[0] == "[fd00::7]:23456"  # the coordinator, as gRPC takes an IPv6 address
    for rank in range(3):
        env = task_environment({"A": "1"}, workers, rank, "r", f"/x/task-{rank}", backend=Backend.JAX)
        assert list(env.items()) == [*keras_of(workers, rank).items(), ("MGPU_RUN_ID", "r"),
                                     ("MGPU_TASK_INDEX", str(rank)), ("MGPU_NUM_WORKERS", "3"),
                                     ("MGPU_RUN_DIR", f"/x/task-{rank}"),
                                     ("MGPU_HOST_ADDRESS", ["fd00::7", "10.0.0.2", "node3"][rank]),
                                     ("PYTHONUNBUFFERED", "1"), ("A", "1")]
    # an elastic run that went on without host 0: its rank among those taking part, its own index
    env = task_environment({}, workers[1:], 1, "r", "/x/task-2", index=2, backend="jax")
    assert (env["KERAS_DISTRIBUTION_JOB_ADDRESSES"], env["KERAS_DISTRIBUTION_PROCESS_ID"], env["MGPU_TASK_INDEX"]) == (
        "10.0.0.2:23456", "1", "2")
    with pytest.raises(ValueError):
        task_environment({}, workers, 3, "r", "/x", backend=Backend.JAX)


def test_cpu_devices_are_xlas_before_a_users_flags_and_a_users_value_wins_elsewhere():
    workers = ["h:1", "h:2"]
    env = task_environment({"XLA_FLAGS": " --xla_dump_to=/tmp/d ", "KERAS_BACKEND": "mine"}, workers, 1, "r", "/x",
                           backend=Backend.JAX, cpu_devices=4)
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4 --xla_dump_to=/tmp/d"
    assert env["KERAS_BACKEND"] == "mine"  # the spec's env wins, as on TensorFlow
    assert task_environment({}, workers, 0, "r", "/x", backend=Backend.JAX, cpu_devices=2)["XLA_FLAGS"] == \
        "--xla_force_host_platform_device_count=2"
    assert "XLA_FLAGS" not in task_environment({}, workers, 0, "r", "/x", backend=Backend.JAX)
    assert task_environment({"XLA_FLAGS": "--a"}, workers, 0, "r", "/x", backend=Backend.JAX)["XLA_FLAGS"] == "--a"


def test_the_tensorflow_environment_is_as_it_was():
    workers = ["10.0.0.1:20000", "[fd00::2]:20000"]
    expected = [
        ("TF_CONFIG", '{"cluster": {"worker": ["10.0.0.1:20000", "[fd00::2]:20000"]}, "task": {"type": "worker", '
                      '"index": 1}}'),
        ("MGPU_RUN_ID", "r"), ("MGPU_TASK_INDEX", "1"), ("MGPU_NUM_WORKERS", "2"), ("MGPU_RUN_DIR", "/x/task-1"),
        ("TF_USE_LEGACY_KERAS", "1"), ("PYTHONUNBUFFERED", "1"), ("CUDA_VISIBLE_DEVICES", ""),
        ("XLA_FLAGS", "--a")]
    common = {"CUDA_VISIBLE_DEVICES": "", "XLA_FLAGS": "--a"}
    for env in (task_environment(common, workers, 1, "r", "/x/task-1"),
                task_environment(common, workers, 1, "r", "/x/task-1", backend=Backend.TENSORFLOW, cpu_devices=4)):
        assert list(env.items()) == expected


# ---------------------------------------------------------------- the spec, the plan, the dry run

def hosts_spec(training: dict, *hosts: dict) -> object:
    return parse_spec({"hosts": list(hosts), "training": training})


def test_the_backend_is_tensorflow_unless_the_spec_says_jax():
    host = {"address": "localhost", "port": 20000}
    assert hosts_spec({"command": ["x"]}, host).training.backend is Backend.TENSORFLOW
    assert hosts_spec({"command": ["x"], "backend": "jax"}, host).training.backend is Backend.JAX
    from launcher.spec.cluster import spec_schema

    schema = spec_schema()
    assert schema["$defs"]["Backend"]["enum"] == ["tensorflow", "jax"]
    assert schema["$defs"]["Training"]["properties"]["backend"]["default"] == "tensorflow"


def test_the_plan_gives_each_host_its_rank_and_xla_devices_only_where_no_gpus_are_named():
    spec = hosts_spec({"entrypoint": "worker.examples.digits:task", "backend": "jax", "local_replicas": 2},
                      {"address": "::1", "port": 21000, "gpus": "none", "env": {"XLA_FLAGS": "--b"}},
                      {"address": "10.0.0.2", "port": 21001}, {"address": "10.0.0.3", "port": 21002, "gpus": [0, 1]},
                      {"address": "10.0.0.4", "port": 21003, "gpus": "all"})
    plans = plan_tasks(spec, "r1")
    workers = ["[::1]:21000", "10.0.0.2:21001", "10.0.0.3:21002", "10.0.0.4:21003"]
    for rank, p in enumerate(plans):
        assert {k: p.env[k] for k in KERAS} == keras_of(workers, rank)
        assert "TF_CONFIG" not in p.env and "TF_USE_LEGACY_KERAS" not in p.env
        assert p.argv[-2:] == ("--local-replicas", "2")  # the runner is told as on TensorFlow
    assert [p.env.get("XLA_FLAGS") for p in plans] == [
        "--xla_force_host_platform_device_count=2 --b", "--xla_force_host_platform_device_count=2", None, None]
    # elastic: the hosts that take part; the first of them coordinates
    shrunk = plan_tasks(spec, "r1", only=[1, 3])
    assert [(p.index, {k: p.env[k] for k in KERAS}) for p in shrunk] == [
        (1, keras_of(["10.0.0.2:21001", "10.0.0.4:21003"], 0)), (3, keras_of(["10.0.0.2:21001", "10.0.0.4:21003"], 1))]


def run_cli(tmp_path: Path, *args) -> subprocess.CompletedProcess:
    """The CLI for what starts nothing (dry run, tf-config)."""
    return subprocess.run([PY, "-m", "launcher", *map(str, args)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "MGPU_HOME": str(tmp_path / "home"), "COLUMNS": "200"})


def test_dry_run_and_tf_config_show_kerass_variables(tmp_path):
    spec = write_spec(tmp_path, 'backend = "jax"\ncommand = ["python3", "train.py"]')
    ports = [p.host.port for p in plan_tasks(parse_spec_file(spec), "x")]
    r = run_cli(tmp_path, "up", spec, "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in (0, 1):
        shown = "".join(f"  env {k}={v}\n" for k, v in keras_of([f"localhost:{p}" for p in ports], rank).items())
        assert shown in r.stdout
    assert "TF_CONFIG" not in r.stdout and "TF_USE_LEGACY_KERAS" not in r.stdout
    one = run_cli(tmp_path, "tf-config", spec, "--task", "1")
    assert one.returncode == 0 and json.loads(one.stdout) == keras_of([f"localhost:{p}" for p in ports], 1), one.stderr
    every = run_cli(tmp_path, "tf-config", spec, "--all")
    assert json.loads(every.stdout) == [keras_of([f"localhost:{p}" for p in ports], r) for r in (0, 1)]


def parse_spec_file(path: Path):
    from launcher.spec.file import load_spec

    return load_spec(path)


# ---------------------------------------------------------------- Slurm: built on the node

def slurm_spec(tmp_path: Path, backend: str) -> object:
    training = {"entrypoint": "worker.examples.digits:task", "backend": backend, "local_replicas": 2}
    return parse_spec({"slurm": {"nodes": 2, "workdir": str(tmp_path), "gpus_per_node": 0, "python": PY,
                                 "env": {"XLA_FLAGS": "--b", "MY_TOKEN": "t"}}, "training": training})


def fake_scontrol(folder: Path) -> Path:
    """`scontrol` as the node entry asks it: the step's nodes, then their addresses (node2's IPv6)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "scontrol"
    script.write_text('#!/bin/sh\nif [ "$1" = show ]; then printf "node1\\nnode2\\n"; exit 0; fi\n'
                      'printf "NodeName=node1 NodeAddr=10.9.0.1\\nNodeName=node2 NodeAddr=fd00::2\\n"\n')
    script.chmod(0o755)
    return folder


def slurm_task(tmp_path: Path, spec, run_id: str, rank: int, port: int) -> dict:
    """Task `rank` started as srun starts it on its node; what its program saw."""
    root = Path(run_folder(spec, run_id))
    root.mkdir(parents=True, exist_ok=True)
    (root / layout.ENV).write_text(json.dumps(given(spec, run_id)))  # what the launcher writes before the job
    bin_dir = fake_scontrol(tmp_path / "bin")
    env = {**scrubbed(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_PROCID": str(rank), "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_STEP_NUM_TASKS": "2", "SLURMD_NODENAME": f"node{rank + 1}"}
    r = subprocess.run([PY, "-m", "worker.task.slurm", "--run-dir", str(root), "--port", str(port), "--", PY, "-c",
                        DUMP], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((Path(layout.task_dir(root, rank)) / "seen.json").read_text())


def scrubbed() -> dict[str, str]:
    """This process's environment without the variables a task gets from its builder alone."""
    return {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "TF_USE_LEGACY_KERAS", *KERAS)}


def test_a_slurm_task_builds_kerass_variables_on_its_node(tmp_path):
    spec, port = slurm_spec(tmp_path, "jax"), free_port()
    workers = [f"10.9.0.1:{port}", f"[fd00::2]:{port}"]
    for rank in (0, 1):
        seen = slurm_task(tmp_path, spec, "r1", rank, port)
        assert {k: seen.get(k) for k in KERAS} == keras_of(workers, rank)
        assert seen["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2 --b"
        assert (seen["MGPU_RUN_ID"], seen["MGPU_TASK_INDEX"], seen["CUDA_VISIBLE_DEVICES"], seen["MY_TOKEN"]) == (
            "r1", str(rank), "", "t")
        assert seen["MGPU_RUN_DIR"] == layout.task_dir(run_folder(spec, "r1"), rank)
        assert "TF_CONFIG" not in seen and "TF_USE_LEGACY_KERAS" not in seen
    # the dry run shows task 0's, with the step's nodes as placeholders
    shown = described_environment(spec, "r1")
    assert {k: shown[k] for k in KERAS} == keras_of(["<node 0>:<port>", "<node 1>:<port>"], 0)


def test_a_slurm_task_on_tensorflow_gets_what_it_got(tmp_path):
    spec, port = slurm_spec(tmp_path, "tensorflow"), free_port()
    assert given(spec, "r2") == {"run_id": "r2", "env": {"CUDA_VISIBLE_DEVICES": "", "XLA_FLAGS": "--b",
                                                         "MY_TOKEN": "t"}, "backend": "tensorflow", "cpu_devices": None}
    seen = slurm_task(tmp_path, spec, "r2", 1, port)
    built = {k: seen[k] for k in ("TF_CONFIG", "MGPU_RUN_ID", "MGPU_TASK_INDEX", "MGPU_NUM_WORKERS",
                                  "TF_USE_LEGACY_KERAS", "XLA_FLAGS")}
    assert built == {"TF_CONFIG": json.dumps({"cluster": {"worker": [f"10.9.0.1:{port}", f"[fd00::2]:{port}"]},
                                              "task": {"type": "worker", "index": 1}}),
                     "MGPU_RUN_ID": "r2", "MGPU_TASK_INDEX": "1", "MGPU_NUM_WORKERS": "2", "TF_USE_LEGACY_KERAS": "1",
                     "XLA_FLAGS": "--b"}
    assert not set(KERAS) & set(seen)


# ---------------------------------------------------------------- Kubernetes: built in the pod

def k8s_spec(tmp_path: Path, backend: str, port: int) -> object:
    return parse_spec({"kubernetes": {"image": "x", "workers": 2, "python": PY, "port": port, "name": "jaxrun",
                                      "workdir": str(tmp_path), "volume_claim": "runs",
                                      "env": {"XLA_FLAGS": "--b"}},
                       "training": {"entrypoint": "worker.examples.digits:task", "backend": backend,
                                    "local_replicas": 2}})


def test_a_rendered_jax_jobset_is_valid_and_its_pod_builds_kerass_variables_from_its_index(tmp_path):
    need("kubeflow_trainer_api")
    from launcher.engines.kubernetes import render
    from launcher.engines.kubernetes.validate import validate

    port = free_port()
    spec = k8s_spec(tmp_path, "jax", port)
    m = manifest(spec)
    assert validate(json.loads(json.dumps(m))) == m and render(spec)
    container = m["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    command = container["command"]
    assert command[command.index("--") - 4:command.index("--")] == ["--backend", "jax", "--cpu-devices", "2"]
    program = [*command[:command.index("--") + 1], PY, "-c", DUMP]  # the rendered pod entry, a program that tells
    env = {**scrubbed(), **{e["name"]: e["value"] for e in container["env"]}, "JOB_COMPLETION_INDEX": "1"}
    r = subprocess.run(program, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    seen = json.loads((tmp_path / ".mgpu" / "runs" / "jaxrun" / "task-1" / "seen.json").read_text())
    hosts = [f"jaxrun-worker-0-{i}.jaxrun:{port}" for i in (0, 1)]
    assert {k: seen.get(k) for k in KERAS} == keras_of(hosts, 1)
    assert seen["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2 --b"  # the container's, added to
    assert "TF_CONFIG" not in seen and "TF_USE_LEGACY_KERAS" not in seen
    # TensorFlow's pods run what they ran: no backend on their command line
    assert "--backend" not in pod_command(k8s_spec(tmp_path, "tensorflow", port))


def test_a_pods_keras_variables_cannot_be_set_in_the_specs_env():
    from launcher.errors import SpecError

    with pytest.raises(SpecError, match="KERAS_DISTRIBUTION_PROCESS_ID"):
        parse_spec({"kubernetes": {"image": "x", "env": {"KERAS_DISTRIBUTION_PROCESS_ID": "0"}},
                    "training": {"command": ["x"], "backend": "jax"}})


# ---------------------------------------------------------------- the host check

def test_a_host_without_jax_or_keras_3_is_one_paragraph(monkeypatch):
    from worker.preflight import packages

    have = {"jax": "0.10.2", "jaxlib": "0.10.2", "keras": "2.15.0", "tensorflow": None, "tf-keras": None}
    monkeypatch.setattr(packages, "version", have.get)
    report = doctor.check_tasks([{"index": 0, "port": free_port()}], program="true", backend=Backend.JAX)
    [problem] = report["tasks"][0]["problems"]
    assert f"keras >= 3 (it has keras 2.15.0) not installed for {sys.executable} on host {socket.gethostname()}" in \
        problem and "pip install 'mgpu-cluster[jax]'" in problem
    assert report["versions"] == {"python": report["versions"]["python"], "jax": "0.10.2", "jaxlib": "0.10.2",
                                  "keras": "2.15.0"}
    assert not doctor.check_tasks([{"index": 0, "port": free_port()}], program="true")["tasks"][0]["problems"]


def bare_python(tmp_path: Path) -> Path:
    """An interpreter with the standard library, our package and psutil only (no jax, no keras)."""
    import psutil

    venv.create(tmp_path / "bare", with_pip=False)
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "psutil").symlink_to(Path(psutil.__file__).parent)
    wrapper = tmp_path / "bare-python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={REPO}:{tmp_path / "only"} exec {tmp_path / "bare" / "bin" / "python"} '
                       '"$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_check_refuses_a_jax_spec_on_a_host_without_jax(cli, tmp_path):
    spec = write_spec(tmp_path, f'backend = "jax"\ncommand = ["{PY}", "-c", "pass"]', n=1,
                      extra=f'python = "{bare_python(tmp_path)}"\n')
    r = cli("check", spec, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "jax, jaxlib, keras not installed" in out and "mgpu-cluster[jax]" in out, out
    assert "Traceback" not in out


def test_the_coordinators_port_is_checked_like_every_tasks(cli, tmp_path):
    need("jax")
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        spec = tmp_path / "c.toml"
        spec.write_text(f'[[hosts]]\naddress = "localhost"\nport = {port}\n'
                        f'[[hosts]]\naddress = "localhost"\nport = {free_port()}\n'
                        f'[training]\nbackend = "jax"\ncommand = ["{PY}", "-c", "pass"]\n')
        r = cli("check", spec, timeout=60)
        up = cli("up", spec, timeout=60)
    finally:
        holder.close()
    for res in (r, up):
        out = res.stdout + res.stderr
        assert res.returncode == 2 and f"port {port} is in use by pid {os.getpid()}" in out and "task 0" in out, out
    assert "nothing was started" in up.stdout + up.stderr


# ---------------------------------------------------------------- a user's own script, started by `up`

def test_a_users_own_script_gets_kerass_variables_on_every_task(cli, tmp_path):
    need("jax")
    cli.env = scrubbed()  # what the task gets comes from the run alone
    cli.env.update({"MGPU_HOME": str(cli.home), "COLUMNS": "200", "PYTHONUNBUFFERED": "1"})
    show = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in %r}))\n" % (
        [*KERAS, "TF_CONFIG", "TF_USE_LEGACY_KERAS", "MGPU_TASK_INDEX"],)) + DUMP
    spec = write_spec(tmp_path, f'backend = "jax"\ncommand = {json.dumps([PY, "-c", show])}')
    r = cli("up", spec, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    st = latest_state(cli)
    workers = [f"localhost:{t['port']}" for t in st["tasks"]]
    for rank, t in enumerate(st["tasks"]):
        seen = json.loads((Path(t["run_dir"]) / "seen.json").read_text())
        assert {k: seen.get(k) for k in KERAS} == keras_of(workers, rank)
        assert "TF_CONFIG" not in seen and "TF_USE_LEGACY_KERAS" not in seen and seen["MGPU_TASK_INDEX"] == str(rank)
        assert f"task{rank} localhost | " in r.stdout and f'"KERAS_DISTRIBUTION_PROCESS_ID": "{rank}"' in r.stdout
