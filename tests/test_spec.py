"""Spec validation through the real CLI: every malformed spec exits 2, names the field, no traceback."""

import json
import os

import pytest

from launcher.spec.file import load_spec, parse_spec
from launcher.plan import plan_tasks

HOST0 = '[[hosts]]\naddress = "localhost"\nport = 20000\n'
HOST1 = '[[hosts]]\naddress = "localhost"\nport = 20001\n'
TRAIN = '[training]\nentrypoint = "worker.examples.digits:task"\n'
GOOD = HOST0 + HOST1 + TRAIN

# (id, file text, what the message must name)
BAD = [
    ("toml-syntax", GOOD + "epochs = = 3\n", "line"),
    ("toml-unclosed-string", 'x = "abc\n' + GOOD, "line"),
    ("toml-duplicate-table-key", HOST0 + 'port = 3\n' + TRAIN, "line"),
    ("no-hosts-key", TRAIN, "hosts"),
    ("empty-host-list", "hosts = []\n" + TRAIN, "hosts"),
    ("no-training", HOST0, "training"),
    ("missing-address", '[[hosts]]\nport = 20000\n' + TRAIN, "hosts[0].address"),
    ("missing-port", '[[hosts]]\naddress = "a"\n' + TRAIN, "hosts[0].port"),
    ("port-zero", HOST0 + '[[hosts]]\naddress = "b"\nport = 0\n' + TRAIN, "hosts[1].port"),
    ("port-too-big", HOST0 + '[[hosts]]\naddress = "b"\nport = 65536\n' + TRAIN, "hosts[1].port"),
    ("port-negative", '[[hosts]]\naddress = "a"\nport = -1\n' + TRAIN, "hosts[0].port"),
    ("port-string", '[[hosts]]\naddress = "a"\nport = "20000"\n' + TRAIN, "hosts[0].port"),
    ("port-float", '[[hosts]]\naddress = "a"\nport = 20000.5\n' + TRAIN, "hosts[0].port"),
    ("duplicate-host-port", HOST0 + HOST0 + TRAIN, "hosts[1]"),
    ("duplicate-host-name", HOST0 + 'name = "a"\n' + HOST1 + 'name = "a"\n' + TRAIN, "hosts[1]: name 'a'"),
    ("min-hosts-above-hosts", HOST0 + TRAIN + "[launch]\nmin_hosts = 2\n", "min_hosts = 2"),
    ("unknown-host-key", HOST0 + 'prot = 3\n' + TRAIN, "did you mean 'port'"),
    ("unknown-training-key", GOOD + "epoch = 3\n", "did you mean 'epochs'"),
    ("unknown-backend", GOOD + 'backend = "pytorch"\n', "training.backend: Input should be 'tensorflow' or 'jax'"),
    ("backend-not-a-string", GOOD + "backend = 1\n", "training.backend"),
    ("collective-with-jax", GOOD + 'backend = "jax"\ncollective = "ring"\n', "collective = 'ring' is a setting of"),
    ("unknown-section", GOOD + "[lanch]\nmax_restarts = 1\n", "did you mean 'launch'"),
    ("unknown-launch-key", GOOD + "[launch]\nheartbeat = 3\n", "launch.heartbeat"),
    ("unknown-defaults-key", "[defaults]\nusr = 'x'\n" + GOOD, "did you mean 'user'"),
    ("both-entrypoint-and-command", GOOD + 'command = ["python3", "t.py"]\n', "exactly one"),
    ("neither-entrypoint-nor-command", HOST0 + "[training]\nepochs = 2\n", "exactly one"),
    ("entrypoint-no-colon", HOST0 + '[training]\nentrypoint = "worker.examples.digits"\n', "training.entrypoint"),
    ("entrypoint-bad-chars", HOST0 + '[training]\nentrypoint = "a-b:c"\n', "training.entrypoint"),
    ("command-empty", HOST0 + "[training]\ncommand = []\n", "training.command"),
    ("command-not-list", HOST0 + '[training]\ncommand = "python3 t.py"\n', "training.command"),
    ("epochs-zero", GOOD + "epochs = 0\n", "training.epochs"),
    ("epochs-negative", GOOD + "epochs = -2\n", "training.epochs"),
    ("batch-zero", GOOD + "batch_size_per_replica = 0\n", "training.batch_size_per_replica"),
    ("steps-zero", GOOD + "steps_per_epoch = 0\n", "training.steps_per_epoch"),
    ("lr-zero", GOOD + "learning_rate = 0.0\n", "training.learning_rate"),
    ("lr-string", GOOD + 'learning_rate = "fast"\n', "training.learning_rate"),
    ("mixed-precision-string", GOOD + 'mixed_precision = "yes"\n', "training.mixed_precision"),
    ("restarts-negative", GOOD + "[launch]\nmax_restarts = -1\n", "launch.max_restarts"),
    ("connect-timeout-zero", GOOD + "[launch]\nconnect_timeout = 0\n", "launch.connect_timeout"),
    ("start-timeout-negative", GOOD + "[launch]\nstart_timeout = -5\n", "launch.start_timeout"),
    ("heartbeat-timeout-zero", GOOD + "[launch]\nheartbeat_timeout = 0\n", "launch.heartbeat_timeout"),
    ("gpus-bad-word", HOST0 + 'gpus = "some"\n' + TRAIN, "hosts[0].gpus"),
    ("gpus-negative", HOST0 + "gpus = [-1]\n" + TRAIN, "hosts[0].gpus"),
    ("env-not-string", HOST0 + "env = { A = 1 }\n" + TRAIN, "hosts[0].env.A"),
    ("env-bad-name", HOST0 + 'env = { "A B" = "x" }\n' + TRAIN, "hosts[0].env"),
    ("ssh-port-too-big", HOST0 + "ssh_port = 70000\n" + TRAIN, "hosts[0].ssh_port"),
    ("address-with-space", '[[hosts]]\naddress = "a b"\nport = 1\n' + TRAIN, "hosts[0].address"),
    ("defaults-bad-gpus", '[defaults]\ngpus = "many"\n' + GOOD, "defaults.gpus"),
    ("hosts-not-table", 'hosts = ["localhost:20000"]\n' + TRAIN, "hosts[0]"),
    ("accept-keys-string", GOOD + '[launch]\naccept_new_host_keys = "yes"\n', "launch.accept_new_host_keys"),
]


@pytest.mark.parametrize("name,text,needle", BAD, ids=[b[0] for b in BAD])
def test_malformed_spec_exits_2_and_names_the_field(cli, tmp_path, name, text, needle):
    spec = tmp_path / "cluster.toml"
    spec.write_text(text)
    r = cli("check", spec, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out, out
    assert str(spec) in out
    assert needle in out, out


def _file_problem(tmp_path, kind):
    if kind == "missing":
        return tmp_path / "nope.toml", "does not exist"
    if kind == "directory":
        d = tmp_path / "adir"
        d.mkdir()
        return d, "is a directory"
    if kind == "not-utf8":
        p = tmp_path / "latin1.toml"
        p.write_bytes(b"[[hosts]]\naddress = \"h\xe9\"\nport = 1\n")
        return p, "not UTF-8"
    if kind == "dangling-symlink":
        p = tmp_path / "link.toml"
        os.symlink(tmp_path / "gone.toml", p)
        return p, "does not exist"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing", "directory", "not-utf8", "dangling-symlink"])
def test_unreadable_spec_file(cli, tmp_path, kind):
    path, needle = _file_problem(tmp_path, kind)
    for command in (["check", path], ["tf-config", path, "--all"], ["up", path]):
        r = cli(*command, timeout=60)
        out = r.stdout + r.stderr
        assert r.returncode == 2, out
        assert "Traceback" not in out and needle in out and str(path) in out


def test_toml_syntax_error_gives_line_and_column(cli, tmp_path):
    spec = tmp_path / "c.toml"
    spec.write_text(GOOD + "epochs = = 3\n")
    r = cli("check", spec, timeout=60)
    assert "line 9, column 10" in r.stderr, r.stderr


def test_defaults_fill_hosts_and_env_merges(tmp_path):
    spec = parse_spec({
        "defaults": {"user": "u", "gpus": [0], "env": {"A": "1", "B": "2"}},
        "hosts": [{"address": "h1", "port": 1}, {"address": "h2", "port": 1, "user": "v", "env": {"B": "3"}}],
        "training": {"command": ["true"]},
    })
    assert [h.user for h in spec.hosts] == ["u", "v"]
    assert spec.hosts[1].env == {"A": "1", "B": "3"}
    env = plan_tasks(spec, "r1")[1].env
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["B"] == "3" and env["MGPU_TASK_INDEX"] == "1"
    assert env["TF_USE_LEGACY_KERAS"] == "1" and env["MGPU_NUM_WORKERS"] == "2"


def test_example_spec_is_valid():
    from conftest import REPO

    spec = load_spec(REPO / "cluster.example.toml")
    assert [h.port for h in spec.hosts] == [20000, 20001]
    assert spec.training.entrypoint == "worker.examples.digits:task"


SPECS = [
    [("localhost", 20000), ("localhost", 20001)],
    [("localhost", 20000)],
    [("10.0.0.1", 2222), ("10.0.0.2", 2222), ("gpu-a.example", 30000), ("127.0.0.1", 1)],
    [(f"198.18.0.{i}", 20000) for i in range(1, 9)],
]


@pytest.mark.parametrize("hosts", SPECS, ids=lambda h: f"{len(h)}-hosts")
def test_tf_config_round_trips_through_tensorflow(hosts, monkeypatch):
    import tensorflow as tf

    spec = parse_spec({"hosts": [{"address": a, "port": p} for a, p in hosts], "training": {"command": ["x"]}})
    expected = [f"{a}:{p}" for a, p in hosts]
    for i in range(len(hosts)):
        monkeypatch.setenv("TF_CONFIG", plan_tasks(spec, "r1")[i].env["TF_CONFIG"])
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        assert resolver.cluster_spec().as_dict() == {"worker": expected}
        assert resolver.task_type == "worker" and resolver.task_id == i


def test_tf_config_command(cli, tmp_path):
    spec = tmp_path / "c.toml"
    spec.write_text(GOOD)
    r = cli("tf-config", spec, "--task", 1, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"cluster": {"worker": ["localhost:20000", "localhost:20001"]},
                                    "task": {"type": "worker", "index": 1}}
    r = cli("tf-config", spec, "--all", timeout=60)
    assert [c["task"]["index"] for c in json.loads(r.stdout)] == [0, 1]
    r = cli("tf-config", spec, "--task", 5, timeout=60)
    assert r.returncode == 2 and "0..1" in r.stderr and "Traceback" not in r.stderr


def test_schema_lists_every_section(cli):
    r = cli("schema", timeout=60)
    assert r.returncode == 0
    schema = json.loads(r.stdout)
    kinds = [schema["$defs"][one["$ref"].rsplit("/", 1)[1]]["properties"] for one in schema["anyOf"]]
    # one kind per table that says where the tasks run, each with the sections every spec shares
    assert sorted(sorted({"hosts", "slurm", "kubernetes"} & set(props)) for props in kinds) == [
        ["hosts"], ["kubernetes"], ["slurm"]], kinds
    assert all({"defaults", "training", "launch", "sync"} <= set(props) for props in kinds), kinds
