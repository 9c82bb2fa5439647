"""A user's env against the launcher's contract: every variable the one environment builder owns (worker.host.env's
OWNED) is refused in a spec's env, by key, naming the spec key to use; and a task that finds itself in a group of
another size than its launcher planned stops at once, naming both sizes, whatever caused it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, write_spec
from launcher.errors import SpecError
from launcher.spec.file import parse_spec
from worker.host import env

PY = sys.executable
COMMAND = {"command": ["x"]}
# every owned variable, with a value the builder would set (the flag owned inside XLA_FLAGS)
OWNED = [*((name, "1") for name in env.OWNED), *((f"{p}JOB_ADDRESSES", "h:1") for p in env.OWNED_PREFIXES),
         *((name, f"--xla_cpu_enable_fast_math=false {flag}=3") for name, flags in env.OWNED_FLAGS.items()
           for flag in flags)]
WHERE = {  # a spec with `variables` in each env table a spec has
    "defaults": lambda v: {"defaults": {"env": v}, "hosts": [{"address": "localhost", "port": 20000}]},
    "hosts": lambda v: {"hosts": [{"address": "localhost", "port": 20000, "env": v}]},
    "slurm": lambda v: {"slurm": {"nodes": 2, "workdir": "/shared", "env": v}},
    "kubernetes": lambda v: {"kubernetes": {"image": "i", "workers": 1, "env": v}},
}


def test_the_builder_sets_every_name_it_owns():
    built = {**env.task_environment({}, ["a:1", "b:2"], 1, "r", "/d"),
             **env.task_environment({}, ["a:1", "b:2"], 1, "r", "/d", backend=env.Backend.JAX, cpu_devices=2)}
    owned = {name for name, _ in OWNED} - {"CUDA_VISIBLE_DEVICES"}  # from `gpus`: launcher.plan, the engines
    assert owned - {*built, "KERAS_DISTRIBUTION_JOB_ADDRESSES"} == set() and env.XLA_CPU_DEVICES in built["XLA_FLAGS"]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("name,value", OWNED, ids=[n for n, _ in OWNED])
def test_an_owned_variable_is_refused_in_every_env_table_naming_the_key_to_use(where, name, value):
    with pytest.raises(SpecError) as refused:
        parse_spec({**WHERE[where]({name: value, "MINE": "kept"}), "training": COMMAND})
    said = str(refused.value)
    assert f"{name}: mgpu-cluster sets" in said and "Remove it from env and use " in said, said
    use = env.owner(name, value)[1]
    assert use in said and said.count("\n") == 1, said


def test_the_users_own_variables_and_xla_flags_stay_theirs():
    for where in WHERE:
        parse_spec({**WHERE[where]({"XLA_FLAGS": "--xla_cpu_enable_fast_math=false", "MGPU_DATA": "/d",
                                    "TF_CPP_MIN_LOG_LEVEL": "2"}), "training": COMMAND})


def test_a_jax_command_gets_its_cpu_devices_from_local_replicas_not_from_env():
    from launcher.plan import plan_tasks

    hosts = [{"address": "localhost", "port": 20000 + i, "gpus": "none"} for i in range(2)]
    spec = parse_spec({"hosts": hosts, "training": {"backend": "jax", "command": ["x"], "local_replicas": 2}})
    assert {p.env["XLA_FLAGS"] for p in plan_tasks(spec, "r")} == {f"{env.XLA_CPU_DEVICES}=2"}
    with pytest.raises(SpecError, match="settings of the built-in runner"):  # TensorFlow: the command's own strategy
        parse_spec({"hosts": hosts, "training": {"command": ["x"], "local_replicas": 2}})


def test_check_and_dry_run_refuse_each_owned_variable_in_one_paragraph(cli, tmp_path):
    for i, (name, value) in enumerate(OWNED):
        spec = write_spec(tmp_path, 'command = ["x"]', n=1, env=f'{name} = {json.dumps(value)}', name=f"s{i}.toml")
        for verb in (("check",), ("up", "--dry-run")) if i < 2 else (("check",),):
            r = cli(*verb, spec, timeout=60)
            assert r.returncode == 2 and f"defaults.env: {name}: mgpu-cluster sets" in r.stderr, r.stdout + r.stderr
            assert "Traceback" not in r.stdout + r.stderr and not r.stdout.strip(), r.stdout + r.stderr
    assert not (cli.home / "runs").exists() or not list((cli.home / "runs").iterdir())  # nothing started


# --------------------------------------------------------------------------- the group a task finds

def _runner_check(extra: dict) -> subprocess.CompletedProcess:
    """The TensorFlow runner's strategy, as a command's script or the runner builds it, in a real process; its
    group check comes before TensorFlow is imported."""
    code = ("import sys\nfrom worker.training.errors import WorkerError\nfrom worker.tensorflow.strategy import strategy_from_env\n"
            "try:\n    strategy_from_env()\nexcept WorkerError as exc:\n    print(exc); sys.exit(2)\n")
    environ = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "MGPU_NUM_WORKERS")}
    return subprocess.run([PY, "-c", code], cwd=REPO, env={**environ, **extra}, capture_output=True, text=True,
                          timeout=120)


def test_a_tensorflow_task_in_a_group_of_another_size_stops_naming_both():
    one = json.dumps(env.tf_config(["localhost:1"], 0))
    r = _runner_check({"TF_CONFIG": one, "MGPU_NUM_WORKERS": "2"})
    assert r.returncode == 2 and "group of 1 worker(s) (TF_CONFIG)" in r.stdout and "planned 2" in r.stdout, \
        r.stdout + r.stderr
    r = _runner_check({"MGPU_NUM_WORKERS": "3"})  # no TF_CONFIG at all
    assert r.returncode == 2 and "group of 1 worker(s) (no TF_CONFIG)" in r.stdout and "planned 3" in r.stdout


def test_a_run_whose_tasks_see_another_backend_stops_at_once_naming_both_sizes(cli, tmp_path):
    """KERAS_BACKEND=jax from the launcher's own environment (where no spec check can see it): each task would
    train alone under keras.distribution and the run 'succeed'; the first task to see it stops the run."""
    pytest.importorskip("jax")
    spec = write_spec(tmp_path, 'entrypoint = "worker.examples.digits:task"\nepochs = 1\nsteps_per_epoch = 2')
    r = subprocess.run(cli.argv("up", spec), cwd=cli.cwd, env={**cli.env, "KERAS_BACKEND": "jax"},
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "is in a group of 1 worker(s) (keras.distribution: KERAS_DISTRIBUTION_NUM_PROCESSES unset), but " \
           "mgpu-cluster planned 2 (MGPU_NUM_WORKERS)" in r.stderr, out
    assert "succeeded" not in r.stderr.splitlines()[-1] and "model saved" not in out, out
