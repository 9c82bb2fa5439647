"""Real runs shared by every test that only reads them (a pytest plugin, loaded by conftest.py): each is started
once per test session, when a test first asks for it, and then read by the report, the page, /metrics, `status`,
the record and the figures' tests alike.

- `digits_run`: two local tasks train the digits CNN for DIGITS_EPOCHS epochs and succeed (TensorFlow's C++ log
  on, a secret in the env), with a run its preflight refused beside it;
- `restart_run`: the same with a checkpoint every 3 steps, task 1 killed with SIGKILL in epoch 2 and the group
  restarted from the checkpoint (standbys on).

Each task trains at least PACE_S a step (a callback's pause), so a run's epochs last long enough on a fast
machine for its progress to be read several times an epoch and for a kill to land where it is meant to."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import Cli, latest_state, reap, run_processes, wait_gone, write_spec

PACE_S = 0.05
DIGITS_EPOCHS = 4
SECRET = "hunter2-not-for-the-page"
RESTART_EPOCHS, RESTART_STEPS, CHECKPOINT_EVERY, KILL_AFTER_STEP = 3, 12, 3, 15


def paced_source(pace_s: float) -> str:
    """A module whose `task` is the digits example pausing `pace_s` after each step."""
    return f'''
import time
from dataclasses import replace

from worker.examples.digits import task as digits


def task():
    import tf_keras as keras

    class Paced(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep({pace_s})

    return replace(digits(), callbacks=lambda: [Paced()])
'''


PACED = paced_source(PACE_S)


@dataclass(frozen=True)
class SharedRun:
    cli: Cli
    code: int  # up's exit code
    out: str  # up's console output
    run_id: str
    folder: Path  # the spec's folder: the local hosts' workdir

    @property
    def record(self) -> Path:
        return self.cli.home / "runs" / self.run_id


def paced_spec(folder: Path, training: str, **kw) -> Path:
    """A two-task spec of the paced digits example, each task pinned to a core of its own."""
    (folder / "paced.py").write_text(PACED)
    return write_spec(folder, 'entrypoint = "paced:task"\n' + training, each="cpus = [{i}]\n", **kw)


def refused_run(cli: Cli, folder: Path) -> str:
    """A run its preflight refused (its port held by this process): its id."""
    spec = write_spec(folder, 'command = ["python3", "-c", "pass"]', n=1, name="refused.toml")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", int(spec.read_text().split("port = ")[1].split()[0])))
        holder.listen()
        r = cli("up", spec, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    return json.loads(cli("ls", "--json", timeout=60).stdout)[0]["run_id"]


def _progress(task: dict) -> dict:
    try:
        return json.loads((Path(task["run_dir"]) / "progress.json").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _past(cli: Cli, step: int):
    st = latest_state(cli)
    if st and st["state"] == "running" and all(_progress(t).get("global_step", 0) > step for t in st["tasks"]):
        return st
    return None


def _once(tmp_path_factory, name: str, make):
    """make(folder) -> a JSON value, made once per test session: under pytest-xdist each worker has a session of
    its own, so the first worker that asks makes it in the workers' common folder and the others wait for it and
    read it. (value, made here): only the worker that made it checks what it left behind."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make(tmp_path_factory.mktemp(name)), True
    common = tmp_path_factory.getbasetemp().parent  # this session's folder, beside each worker's own
    with open(common / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if make() fails
        made = common / f"{name}.json"
        if made.exists():
            value = json.loads(made.read_text())
            if isinstance(value, dict) and "failed" in value:
                pytest.fail(f"the shared {name}, made by another worker, failed: {value['failed']}")
            return value, False
        try:
            value = make(common / name)
        except BaseException as e:
            made.write_text(json.dumps({"failed": f"{type(e).__name__}: {e}"[:4000]}))
            raise
        made.write_text(json.dumps(value))
        return value, True


def _shared(tmp_path_factory, name: str, start):
    """For a session fixture (`yield from`): start(cli, folder) -> SharedRun, then nothing of it left."""

    def make(folder: Path) -> dict:
        folder.mkdir(parents=True, exist_ok=True)
        run = start(Cli(folder / "mgpu-home", folder), folder)
        return {"folder": str(run.folder), "code": run.code, "out": run.out, "run_id": run.run_id}

    value, mine = _once(tmp_path_factory, name, make)
    folder = Path(value["folder"])
    cli = Cli(folder / "mgpu-home", folder)
    try:
        yield SharedRun(cli, value["code"], value["out"], value["run_id"], folder)
    finally:
        left = reap(run_processes(cli.home)) if mine else []
        assert not left, f"processes of the shared run {name} left running: {left}"


def _digits(cli: Cli, folder: Path) -> SharedRun:
    spec = paced_spec(folder, f"epochs = {DIGITS_EPOCHS}",
                      env=f'TF_CPP_MIN_LOG_LEVEL = "0", MGPU_PROGRESS_INTERVAL = "0.25", MY_API_TOKEN = "{SECRET}"')
    r = cli("up", spec, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    run = SharedRun(cli, r.returncode, r.stdout, latest_state(cli)["run_id"], folder)
    assert not wait_gone(cli.home, 10)
    return run


def restarted(cli: Cli, folder: Path, standby: bool) -> SharedRun:
    """The restart run: task 1 killed with SIGKILL past step KILL_AFTER_STEP (a checkpoint saved at it), in
    epoch 2, and the group restarted from that checkpoint."""
    spec = paced_spec(folder, f"epochs = {RESTART_EPOCHS}\nsteps_per_epoch = {RESTART_STEPS}\n"
                      f"batch_size_per_replica = 8\ncheckpoint_every_steps = {CHECKPOINT_EVERY}",
                      launch=f"max_restarts = 1\nstandby = {str(standby).lower()}",
                      env='TF_CPP_MIN_LOG_LEVEL = "2", MGPU_PROGRESS_INTERVAL = "0.1"')
    code, out = cli.up_while(spec, lambda: _past(cli, KILL_AFTER_STEP),
                             lambda _up, st: os.kill(st["tasks"][1]["pid"], signal.SIGKILL),
                             f"both tasks past step {KILL_AFTER_STEP}", ready_timeout=300, timeout=300)
    assert code == 0, out
    run = SharedRun(cli, code, out, latest_state(cli)["run_id"], folder)
    assert not wait_gone(cli.home, 10)
    return run


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory) -> SharedRun:
    yield from _shared(tmp_path_factory, "digits-run", _digits)


@pytest.fixture(scope="session")
def refused_run_id(digits_run, tmp_path_factory) -> str:
    """A run refused in its preflight, recorded beside digits_run (under the same MGPU_HOME)."""
    return _once(tmp_path_factory, "refused-run", lambda _: refused_run(digits_run.cli, digits_run.folder))[0]


@pytest.fixture(scope="session")
def restart_run(tmp_path_factory) -> SharedRun:
    yield from _shared(tmp_path_factory, "restart-run", lambda cli, folder: restarted(cli, folder, standby=True))
