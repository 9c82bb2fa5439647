"""Every number of the spec is finite and at most what its consumer takes: inf, nan and huge values are
refused by key (exit 2, one paragraph, never a traceback), before `render` or `up --dry-run` turn them into
text; the largest value taken renders as Kubernetes and Slurm read it."""

from __future__ import annotations

import pytest
import yaml

from launcher.engines.kubernetes.render import manifest
from launcher.engines.kubernetes.validate import validate
from launcher.engines.slurm.script import batch_script, sbatch_options, srun_argv
from launcher.errors import SpecError
from launcher.spec.base import CPUS_MAX, DEVICES_MAX, INT32_MAX, RESTARTS_MAX, WEEK_S
from launcher.spec.file import load_spec

RUN = "20261124-120000-abcd"
ENGINES = {
    "hosts": {"hosts": {"address": '"localhost"', "port": "20000"}},
    "slurm": {"slurm": {"nodes": "2", "workdir": '"/tmp"'}},
    "kubernetes": {"kubernetes": {"image": '"registry/x:1"', "workers": "1", "volume_claim": '"runs"'}},
}
# (engine, table, key, the largest value taken); gpus and cpus hold theirs in a list
KEYS = [
    ("hosts", "hosts", "port", 65535),
    ("hosts", "hosts", "ssh_port", 65535),
    ("hosts", "defaults", "ssh_port", 65535),
    ("hosts", "hosts", "gpus", DEVICES_MAX - 1),
    ("hosts", "hosts", "cpus", CPUS_MAX - 1),
    ("hosts", "training", "epochs", INT32_MAX),
    ("hosts", "training", "steps_per_epoch", INT32_MAX),
    ("hosts", "training", "batch_size_per_replica", INT32_MAX),
    ("hosts", "training", "checkpoint_every_steps", INT32_MAX),
    ("hosts", "training", "learning_rate", 1000.0),
    ("hosts", "training", "local_replicas", DEVICES_MAX),
    ("hosts", "launch", "max_restarts", RESTARTS_MAX),
    ("hosts", "launch", "max_preemptions", RESTARTS_MAX),
    ("hosts", "launch", "connect_timeout", WEEK_S),
    ("hosts", "launch", "start_timeout", WEEK_S),
    ("hosts", "launch", "heartbeat_timeout", WEEK_S),
    ("hosts", "launch", "stop_grace", WEEK_S),
    ("hosts", "launch", "preempt_grace", 65535),
    ("hosts", "launch", "min_hosts", 1),  # at most the hosts listed
    ("hosts", "launch", "rejoin_cooldown_max", WEEK_S),
    ("hosts", "launch", "regroup_share", 1.0),
    ("slurm", "slurm", "nodes", 65533),
    ("slurm", "slurm", "gpus_per_node", DEVICES_MAX),
    ("slurm", "slurm", "port", 65535),
    ("kubernetes", "kubernetes", "workers", 100000),
    ("kubernetes", "kubernetes", "gpus_per_worker", DEVICES_MAX),
    ("kubernetes", "kubernetes", "port", 65535),
]
BAD = ["inf", "-inf", "nan", "1e300", str(10**12), str(10**30)]


def toml(engine: str, *settings: tuple[str, str, str]) -> str:
    """A spec of `engine` with the built-in runner and each (table, key, TOML value) set."""
    tables = {**ENGINES[engine], "training": {"entrypoint": '"worker.examples.digits:task"'}}
    for table, key, value in settings:
        value = f"[{value}]" if key in ("gpus", "cpus") else value
        tables[table] = {**tables.get(table, {}), key: value}
    return "".join(("[[hosts]]" if name == "hosts" else f"[{name}]") + "\n" +
                   "".join(f"{k} = {v}\n" for k, v in keys.items()) for name, keys in tables.items())


def named(table: str, key: str) -> str:
    return f"{'hosts[0]' if table == 'hosts' else table}.{key}"


def load(tmp_path, text: str):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return load_spec(path)


@pytest.mark.parametrize("engine,table,key,largest", KEYS, ids=[f"{t}.{k}" for _, t, k, _ in KEYS])
def test_each_number_is_refused_by_key_past_its_bound_and_taken_at_it(tmp_path, engine, table, key, largest):
    above = largest + 1 if isinstance(largest, int) else largest * 1.001
    for value in [*BAD, repr(above)]:
        with pytest.raises(SpecError) as exc:
            load(tmp_path, toml(engine, (table, key, value)))
        assert f"\n  {named(table, key)}" in str(exc.value), (value, str(exc.value))
    spec = load(tmp_path, toml(engine, (table, key, repr(largest))))
    got = getattr(spec.hosts[0] if table == "hosts" else getattr(spec, table), key)
    assert got == ([largest] if key in ("gpus", "cpus") else largest)


def test_slurm_time_is_at_most_a_year(tmp_path):
    for time in ("525600", "365-00:00:00", "8760:00:00", "INFINITE", "UNLIMITED", "30"):
        assert load(tmp_path, toml("slurm", ("slurm", "time", f'"{time}"'))).slurm.time == time
    for time in ("525601", "365-00:00:01", "8760:00:01", "9999999999", "1" * 400 + "-00", "1-" + "9" * 5000):
        with pytest.raises(SpecError, match=r"slurm\.time: .* at most 365 days"):
            load(tmp_path, toml("slurm", ("slurm", "time", f'"{time}"')))


def test_kubernetes_quantities_are_bounded(tmp_path):
    for key, value in (("cpu", "1000000"), ("cpu", "1M"), ("cpu", "500m"), ("memory", "1Ei"), ("memory", "1e18"),
                       ("memory", "16Gi")):
        assert getattr(load(tmp_path, toml("kubernetes", ("kubernetes", key, f'"{value}"'))).kubernetes, key) == value
    for key, value in (("cpu", "1e300"), ("cpu", "1000001"), ("cpu", "2G"), ("memory", "8Ei"), ("memory", "1e300"),
                       ("memory", "1e" + "9" * 5000), ("memory", "2E")):
        with pytest.raises(SpecError, match=rf"kubernetes\.{key}: .* more than any pod gets"):
            load(tmp_path, toml("kubernetes", ("kubernetes", key, f'"{value}"')))


def largest(engine: str, *extra: tuple[str, str, str]) -> str:
    keys = [(t, k, repr(v)) for e, t, k, v in KEYS if e in (engine, "hosts") and t not in ("hosts", "defaults")]
    keys = [s for s in keys if not (engine == "kubernetes" and s[1] in (  # [launch] keys a JobSet does not use
        "connect_timeout", "start_timeout", "heartbeat_timeout", "max_preemptions", "rejoin_cooldown_max",
        "regroup_share"))]
    keys = [s for s in keys if s[1] not in ("min_hosts", "local_replicas")]  # hosts only; GPUs are the replicas
    return toml(engine, *keys, *extra)


def test_the_largest_values_render_a_jobset_kubernetes_takes(tmp_path):
    spec = load(tmp_path, largest("kubernetes"))
    m = manifest(spec)
    assert validate(m) == m
    pod = m["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 65535 + 10 <= INT32_MAX
    assert m["spec"]["failurePolicy"]["maxRestarts"] == RESTARTS_MAX
    command = pod["containers"][0]["command"]
    assert command[command.index("--preempt-grace") + 1] == "65535"
    assert command[command.index("--grace") + 1] == str(WEEK_S)


def test_the_largest_values_make_a_job_slurm_takes(tmp_path):
    spec = load(tmp_path, largest("slurm", ("slurm", "time", '"365-00:00:00"')))
    opts = sbatch_options(spec, RUN)
    assert "--signal=USR1@65535" in opts and "--nodes=65533" in opts and "--gpus-per-node=1024" in opts
    argv = srun_argv(spec, RUN, 0)
    assert argv[argv.index("--grace") + 1] == str(WEEK_S) and argv[argv.index("--epochs") + 1] == str(INT32_MAX)
    assert "#SBATCH --signal=USR1@65535" in batch_script(spec, RUN, 0)


def test_check_refuses_each_number_by_key_in_one_paragraph(cli, tmp_path):
    for engine in ENGINES:
        keys = [(t, k) for e, t, k, _ in KEYS if e == engine]
        for value in ("inf", "nan", "1e300", str(10**12)):
            spec = tmp_path / f"{engine}.toml"
            spec.write_text(toml(engine, *[(t, k, value) for t, k in keys]))
            r = cli("check", spec, timeout=60)
            err = r.stderr.strip()
            assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr and "\n\n" not in err, r.stderr
            assert str(spec) in err and all(f"\n  {named(t, k)}" in err for t, k in keys), (value, err)


@pytest.mark.parametrize("value", ["inf", "nan", "1e300", str(10**12)])
def test_render_and_dry_run_refuse_a_grace_past_its_bound(cli, tmp_path, value):
    k8s, slurm = tmp_path / "k8s.toml", tmp_path / "slurm.toml"
    k8s.write_text(toml("kubernetes", ("launch", "preempt_grace", value)))
    slurm.write_text(toml("slurm", ("launch", "preempt_grace", value), ("launch", "stop_grace", value)))
    for args, needles in ((("render", k8s), ["launch.preempt_grace"]),
                          (("up", "--dry-run", k8s), ["launch.preempt_grace"]),
                          (("up", "--dry-run", slurm), ["launch.preempt_grace", "launch.stop_grace"])):
        r = cli(*args, timeout=60)
        out = r.stdout + r.stderr
        assert r.returncode == 2 and "Traceback" not in out and "\n\n" not in r.stderr.strip(), out
        assert all(f"  {n}: " in r.stderr for n in needles) and "terminationGracePeriodSeconds" not in out, out


def test_rendered_grace_is_the_spec_grace_read_back(cli, tmp_path):
    spec = tmp_path / "k8s.toml"
    spec.write_text(toml("kubernetes", ("launch", "preempt_grace", "65535"), ("launch", "stop_grace", "0.5")))
    r = cli("render", spec, timeout=60)
    assert r.returncode == 0, r.stderr
    pod = yaml.safe_load(r.stdout)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 65545
