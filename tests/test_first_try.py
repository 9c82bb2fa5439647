"""Your own code on the first try (issue #30, 4): `check` imports the entrypoint, a user's worker.py never
shadows our package, `sync` under a table is placed for you, arguments after `--` reach the training, and
`up --resume` goes on from a stopped run's checkpoint. Real runs, real processes, real sshds."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import pytest

from conftest import launcher_traceback, namespace_hosts, reap, status_json, wait_for, wait_gone, write_spec
from test_ssh import SSHCli
from test_ssh import write_spec as write_ssh_spec
from launcher.errors import SpecError
from launcher.spec.file import load_spec

PY = sys.executable
BAD = ('import sys\nprint("\\x1b[31mloud at import", flush=True)\nraise RuntimeError("boom at import")\n'
       'def task():\n    pass\n')
SLOW = '''import os
import time

from worker.examples.digits import task as digits

FLAG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow")  # steps slowed while it exists


def task():
    from worker.tensorflow.strategy import import_keras

    keras = import_keras()
    trained = []

    def end(batch, logs):
        trained.append(batch)
        if len(trained) > 10 and os.path.exists(FLAG):  # from epoch 3 on (5 steps an epoch): where a test aims
            time.sleep(0.2)

    t = digits()
    t.callbacks = lambda: [keras.callbacks.LambdaCallback(on_train_batch_end=end)]
    return t
'''


def one_line(r) -> str:
    return " ".join((r.stdout + r.stderr).split())


def workdir_spec(tmp_path: Path, entrypoint: str, files: dict[str, str], training: str = "", n: int = 2) -> Path:
    wd = tmp_path / "wd"
    wd.mkdir(exist_ok=True)
    for name, text in files.items():
        (wd / name).write_text(text)
    return write_spec(tmp_path, f'entrypoint = "{entrypoint}"\n{training}', n=n, each='workdir = "wd"\n')


# --------------------------------------------------------------------------- the entrypoint imported by check

def test_check_imports_the_entrypoint_and_refuses_one_that_raises(cli, tmp_path):
    spec = workdir_spec(tmp_path, "bad:task", {"bad.py": BAD, "exits.py": "import sys\nsys.exit(3)\n"})
    r = cli("check", spec, timeout=120)
    out = one_line(r)
    assert r.returncode == 2, out
    assert "entrypoint 'bad:task' cannot be imported: RuntimeError: boom at import at bad.py:3." in out, out
    assert f"-c 'import bad'` in {tmp_path / 'wd'} to see the whole traceback" in out, out
    assert "\x1b" not in r.stdout + r.stderr and not launcher_traceback(r.stdout + r.stderr)
    assert not (tmp_path / "wd" / ".mgpu").exists()  # nothing was started

    spec = workdir_spec(tmp_path, "exits:task", {})
    r = cli("check", spec, timeout=120)
    assert r.returncode == 2 and "cannot be imported" in one_line(r) and "SystemExit: 3" in one_line(r), one_line(r)


RAISES = 'import os\n\ndata = os.environ["MY_DATA_PATH"]\n\n\ndef task():\n    pass\n'


def test_check_tells_an_import_error_once_at_the_users_line(cli, tmp_path):
    """Two hosts whose interpreter is a wrapper (not this one): the KeyError is told once, at raises.py:3 (not
    in os), for both tasks and hosts, its hint naming the spec's interpreter; each table cell stays one line."""
    python = tmp_path / "py"
    python.write_text(f"#!/bin/sh\nexec {PY} \"$@\"\n")
    python.chmod(0o755)
    spec = workdir_spec(tmp_path, "raises:task", {"raises.py": RAISES}, n=3)
    spec.write_text(spec.read_text().replace('workdir = "wd"\n', f'workdir = "wd"\npython = "{python}"\n'))
    spec.write_text(spec.read_text().replace('address = "localhost"', 'address = "127.0.0.1"', 1)
                    .replace('port =', 'name = "second"\nport =', 2).replace('name = "second"\n', '', 1))
    r = cli("check", spec, timeout=120)
    out, text = one_line(r), r.stdout + r.stderr
    assert r.returncode == 2, out
    assert text.count("MY_DATA_PATH") == 1 and text.count("cannot be imported") == 1, text
    assert ("[1] tasks 0-2 (hosts 127.0.0.1, second, localhost): entrypoint 'raises:task' cannot be imported: "
            "KeyError: 'MY_DATA_PATH' at raises.py:3. "
            f"Run `{python} -c 'import raises'` in {tmp_path / 'wd'} to see the whole traceback") in out, out
    assert "<frozen" not in out and out.count("entrypoint 'raises:task'") == 4, out  # 3 table cells, 1 paragraph
    assert sum(line.startswith("│") for line in r.stdout.splitlines()) == 3, r.stdout  # a line per task


NEEDS_ENV = ('import os\nif os.environ["MY_SETTING"] != "yes":\n    raise ValueError("not set")\n'
             'def task():\n    pass\n')


def test_check_imports_with_the_tasks_environment(cli, tmp_path):
    spec = workdir_spec(tmp_path, "needs_env:task", {"needs_env.py": NEEDS_ENV})
    spec.write_text(spec.read_text().replace('env = { TF_CPP', 'env = { MY_SETTING = "yes", TF_CPP'))
    r = cli("check", spec, timeout=120)
    assert r.returncode == 0, one_line(r)
    spec.write_text(spec.read_text().replace('MY_SETTING = "yes"', 'MY_SETTING = "no"'))
    r = cli("check", spec, timeout=120)
    assert r.returncode == 2 and "ValueError: not set" in one_line(r), one_line(r)


@pytest.fixture(scope="module")
def th(tmp_path_factory):
    """Two hosts in network namespaces with real sshds, for this module's check over SSH."""
    yield from namespace_hosts(2, tmp_path_factory.mktemp("sshhosts"))


@pytest.fixture
def ssh_cli(tmp_path, th):
    c = SSHCli(tmp_path / "mgpu-home", tmp_path, th)
    yield c
    left = reap(wait_gone(tmp_path, 30))
    assert not left, f"processes of the run left on the hosts: {[(p.pid, p.info['cmdline']) for p in left]}"


def test_check_imports_the_entrypoint_on_each_ssh_host(ssh_cli, th, tmp_path):
    """Over SSH the doctor imports it on each host, with the task's environment (sent on stdin, a secret
    too), in the workdir, past a worker.py there."""
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "worker.py").write_text('raise SystemExit("the user\'s worker.py")\n')
    (wd / "needs_env.py").write_text(NEEDS_ENV)
    spec = write_ssh_spec(tmp_path, th.addresses[:2], {"entrypoint": "needs_env:task"},
                          defaults={"env": {"MY_SETTING": "yes", "API_TOKEN": "s3cret"}})
    r = ssh_cli("check", spec, timeout=180)
    assert r.returncode == 0, one_line(r)
    (wd / "needs_env.py").write_text(BAD.replace("boom at import", "boom over ssh"))
    r = ssh_cli("check", spec, timeout=180)
    out = one_line(r)
    assert r.returncode == 2, out
    assert (f"[1] tasks 0-1 (hosts {th.addresses[0]}, {th.addresses[1]}): entrypoint 'needs_env:task' cannot be "
            "imported: RuntimeError: boom over ssh at needs_env.py:3.") in out, out  # told once for both hosts
    assert out.count("boom over ssh") == 1 and f"-c 'import needs_env'` in {wd} to see" in out, out
    assert "RuntimeError: boom over ssh" in out and "s3cret" not in out and not launcher_traceback(out)


# --------------------------------------------------------------------------- a user's worker.py

def test_a_users_worker_py_never_shadows_ours(cli, tmp_path):
    """The workdir holds worker.py (which would end any process that imports it) and the user's own
    entrypoint module: check passes, and the run trains with the arguments given after --."""
    mine = "from worker.examples.digits import task as digits\n\ndef task():\n    return digits()\n"
    spec = workdir_spec(tmp_path, "mine:task", {"worker.py": 'raise SystemExit("the user\'s worker.py")\n',
                                                "mine.py": mine}, training="epochs = 1\nsteps_per_epoch = 2")
    r = cli("check", spec, timeout=120)
    assert r.returncode == 0, one_line(r)
    r = cli("up", spec, "--", "--epochs", "2", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    st = status_json(cli)
    assert st["state"] == "succeeded" and [(t["epoch"], t["epochs"]) for t in st["tasks"]] == [(2, 2), (2, 2)], st

    # a user's entrypoint that wants its own worker.py is told why it gets ours
    (tmp_path / "wd" / "theirs.py").write_text("from worker import helper\ndef task():\n    pass\n")
    r = cli("check", workdir_spec(tmp_path, "theirs:task", {}), timeout=120)
    assert r.returncode == 2 and "has the name of mgpu-cluster's package 'worker'" in one_line(r), one_line(r)


# --------------------------------------------------------------------------- sync under a table

@pytest.mark.parametrize("table", ["[defaults]", "[training]", "[[hosts]]", "[launch]"])
def test_sync_under_a_table_says_where_it_belongs(tmp_path, table):
    spec = write_spec(tmp_path, 'entrypoint = "worker.examples.digits:task"', n=1)
    text = spec.read_text()
    spec.write_text(text.replace(table + "\n", table + '\nsync = ["train.py"]\n', 1))
    with pytest.raises(SpecError) as err:
        load_spec(spec)
    assert "sync: unknown key: 'sync' belongs at the top of the file, above the first [table] line" in str(err.value)
    assert f"every key after {table} belongs to that table" in str(err.value)


# --------------------------------------------------------------------------- arguments after --

def test_arguments_after_dashes_reach_the_training(cli, tmp_path):
    show = "import json, sys; open('argv.json', 'w').write(json.dumps(sys.argv[1:]))"
    spec = write_spec(tmp_path, f"command = {json.dumps([PY, '-c', show, 'own'])}", n=1)
    r = cli("up", spec, "--", "--epochs", "1", "two words", "--", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "argv.json").read_text()) == ["own", "--epochs", "1", "two words", "--"]
    r = cli("up", spec, "stray", timeout=60)
    assert r.returncode == 2 and "the training's own arguments go after --" in one_line(r), one_line(r)


# --------------------------------------------------------------------------- up --resume

def test_resume_goes_on_from_a_stopped_runs_checkpoint(cli, tmp_path):
    spec = workdir_spec(tmp_path, "slow:task", {"slow.py": SLOW, "slow": ""},
                        training="epochs = 6\nsteps_per_epoch = 5")
    up, lines = cli.popen("up", spec), []
    reader = threading.Thread(target=lambda: [lines.append(line) for line in up.stdout], daemon=True)
    reader.start()
    try:
        wait_for(lambda: any("epoch 3/6" in line for line in lines), 240, "the third epoch")
        up.send_signal(signal.SIGINT)
        up.wait(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    reader.join(10)
    assert up.returncode == 130
    first = status_json(cli)
    assert first["state"] == "stopped", first
    old = tmp_path / "wd" / ".mgpu" / "runs" / first["run_id"] / "checkpoint"
    saved = sorted(p.name for p in (old / "chief").iterdir())

    # a spec that differs is refused, naming the key
    changed = spec.parent / "changed.toml"
    changed.write_text(spec.read_text().replace("epochs = 6", "epochs = 7"))
    r = cli("up", changed, "--resume", first["run_id"], timeout=60)
    assert r.returncode == 2 and "training.epochs: 6 then, 7 now" in one_line(r), one_line(r)

    (tmp_path / "wd" / "slow").unlink()  # no aim needed from here: full speed
    r = cli("up", spec, "--resume", timeout=300)  # the newest run of this spec
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert f"resuming run {first['run_id']} from its checkpoint" in out
    resumed_at = [int(line.split("resuming at epoch ")[1].split()[0]) for line in out.splitlines()
                  if "resuming at epoch" in line]
    assert resumed_at and resumed_at[0] >= 3, out  # the epochs done before the stop are not trained again
    second = status_json(cli)
    assert second["run_id"] != first["run_id"] and second["state"] == "succeeded"
    assert sorted(p.name for p in (old / "chief").iterdir()) == saved  # the stopped run keeps its own

    r = cli("up", spec, "--resume", second["run_id"], timeout=60)
    assert r.returncode == 2 and "that run succeeded" in one_line(r), one_line(r)


def test_resume_refused_plainly_where_it_cannot_apply(cli, tmp_path):
    spec = write_spec(tmp_path, 'command = ["python3", "-c", "pass"]', n=1)
    r = cli("up", spec, "--resume", timeout=60)
    assert r.returncode == 2 and "your command keeps its own" in one_line(r), one_line(r)
    spec = write_spec(tmp_path, 'entrypoint = "worker.examples.digits:task"', n=1)
    r = cli("up", spec, "--resume", timeout=60)
    assert r.returncode == 2 and "no earlier run of" in one_line(r), one_line(r)
