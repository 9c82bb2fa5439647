"""Keras 3 on JAX through the real launcher (`[training] backend = "jax"`): real JAX processes on CPU, two local
tasks with two devices each (XLA's host-platform device count), gloo collectives between them.

Digits trains to the TensorFlow runner's accuracy with equal weights on both tasks, and that run's status and
report read as on TensorFlow; a kill -9 fails the run naming the task and leaves nothing; a group restart resumes
after the last saved epoch; a notice (SIGTERM) stops both at one epoch end with exit 75 and the run goes on from
there; a frozen task is named hung with the stacks py-spy read from both JAX processes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import psutil
import pytest

from conftest import (IN_CI, REPO, Cli, launcher_traceback, latest_state, need, reap, run_processes, status_json,
                      wait_gone, write_spec)
from within_probe import assert_within_epochs_are_means, copied_to


def keras3_on_jax() -> bool:
    """jax and Keras >= 3.13 installed (looked up, not imported: Keras alone would import TensorFlow)."""
    try:
        return find_spec("jax") is not None and int(version("keras").split(".")[0]) * 100 + \
            int(version("keras").split(".")[1]) >= 313
    except (PackageNotFoundError, ValueError):
        return False


# under CI=true never skipped: .ci/run installs them (the test extra), and their absence fails the tests
pytestmark = pytest.mark.skipif(not keras3_on_jax() and not IN_CI,
                                reason="needs jax and keras >= 3.13: pip install 'mgpu-cluster[jax]'")

ENTRY = "worker.examples.digits_keras3:task"
EPOCH_LINE = re.compile(r"^task([\d,-]+)[^|]* \| epoch (\d+)/\d+ loss=", re.M)


def jax_spec(tmp_path: Path, epochs: int, launch: str = "", args: tuple[str, ...] = (), entry: str = ENTRY,
             steps: int | None = None, env: str = "") -> Path:
    """Two local tasks x 2 CPU devices, global batch 64 (16/replica), base learning rate 0.001 (x4 after warm-up);
    progress.json written on every update, so that a test sees each epoch begin; `steps` a epoch if given."""
    training = (f'backend = "jax"\nentrypoint = "{entry}"\nlocal_replicas = 2\nbatch_size_per_replica = 16\n'
                f"learning_rate = 0.001\nepochs = {epochs}\nargs = {json.dumps(list(args))}"
                + (f"\nsteps_per_epoch = {steps}" if steps else ""))
    return write_spec(tmp_path, training, launch=launch, env='MGPU_PROGRESS_INTERVAL = "0"' + env)


# the digits example with the first attempt's steps slowed by SLOW seconds, so that a test aims at an epoch of a run
# of few steps an epoch; a later attempt (a restart, which needs no aim) at full speed
PACED = '''
import os
import time
from dataclasses import replace

from worker.examples.digits_keras3 import task as digits


def task():
    import keras

    class Paced(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if os.environ.get("MGPU_ATTEMPT") == "0":
                time.sleep(float(os.environ["SLOW"]))

    return replace(digits(), callbacks=lambda: [Paced()])
'''
PACED_STEPS = 6


def paced_spec(tmp_path: Path, epochs: int, slow: float, launch: str = "", args: tuple[str, ...] = ()) -> Path:
    """jax_spec of the paced digits (paced.py in the local tasks' workdir), PACED_STEPS steps an epoch."""
    (tmp_path / "paced.py").write_text(PACED)
    return jax_spec(tmp_path, epochs, launch=launch, args=args, entry="paced:task", steps=PACED_STEPS,
                    env=f', SLOW = "{slow}"')


def progress(task: dict) -> dict:
    try:
        return json.loads((Path(task["run_dir"]) / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def in_epoch(cli, epoch: int):
    """The run's state once every task trains in `epoch` or later (so every earlier epoch was backed up)."""
    st = latest_state(cli)
    if st and st["state"] == "running" and all(progress(t).get("epoch", 0) >= epoch for t in st["tasks"]):
        return st
    return None


def epochs_shown(out: str, task: int) -> list[int]:
    """The epochs of a task's epoch lines in `up`'s output (`task0-1 | ...`: a line both printed alike)."""
    def tasks(named: str) -> set[int]:
        ends = [part.split("-") for part in named.split(",")]
        return {i for e in ends for i in range(int(e[0]), int(e[-1]) + 1)}

    return [int(m.group(2)) for m in EPOCH_LINE.finditer(out) if task in tasks(m.group(1))]


def start_alone(tmp_path_factory) -> tuple[subprocess.Popen, Path]:
    """One process with one device at the same global batch (64) and the rate the pair reaches after warm-up,
    started: (the process, its task folder)."""
    run_dir = tmp_path_factory.mktemp("alone") / "task-0"
    env = {**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": str(REPO)}
    for name in ("KERAS_DISTRIBUTION_NUM_PROCESSES", "KERAS_DISTRIBUTION_PROCESS_ID", "XLA_FLAGS"):
        env.pop(name, None)
    with open(run_dir.parent / "out.txt", "w") as out, open(run_dir.parent / "err.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "worker", "--entrypoint", ENTRY, "--epochs", "5",
                                 "--batch-size-per-replica", "64", "--learning-rate", "0.004", "--run-dir",
                                 str(run_dir)], cwd=run_dir.parent, env=env, stdout=out, stderr=err)
    return proc, run_dir


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two tasks x 2 devices train digits for 5 epochs, weights saved: (the CLI of its MGPU_HOME, `up`'s result,
    the weights' folder, the `alone` run), one run for every test that reads it. The one-process run (`alone`)
    trains meanwhile: a third process beside the pair's two, which wait for each other at every step."""
    tmp_path = tmp_path_factory.mktemp("pair")
    cli = Cli(tmp_path / "mgpu-home", tmp_path)
    weights = tmp_path / "weights"
    copied_to(tmp_path)  # the digits example, each batch's progress copied (within_probe)
    single, _run_dir = started = start_alone(tmp_path_factory)
    try:
        r = cli("up", jax_spec(tmp_path, 5, args=("--save-weights", f"{weights}/w-{{task}}.npz"),
                               entry="within_probe:task"), timeout=300)
        yield cli, r, weights, started
    finally:
        if single.poll() is None:
            single.kill()
            single.wait()
    left = reap(run_processes(cli.home))
    assert not left, f"processes left running after the run: {left}"


@pytest.fixture(scope="module")
def alone(pair) -> float:
    """The one-process run's final validation accuracy (started beside the pair's)."""
    single, run_dir = pair[3]
    single.wait(timeout=300)
    out, err = ((run_dir.parent / name).read_text() for name in ("out.txt", "err.txt"))
    assert single.returncode == 0, out + err
    assert "task 0 of 1 (chief): DataParallel (jax), 1 replica(s) in sync, global batch 64 (64/replica)" in out
    return json.loads((run_dir / "progress.json").read_text())["metrics"]["val_accuracy"]


@pytest.mark.cluster
def test_two_tasks_with_two_devices_each_train_digits_in_step(pair, alone):
    cli, r, weights, _alone = pair
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count("DataParallel (jax), 4 replica(s) in sync, global batch 64 (16/replica)") == 2, out
    assert "task0-1 | epoch 5/5 loss=" in out and epochs_shown(out, 1) == [1, 2, 3, 4, 5], out  # alike: in step
    assert "[Gloo]" not in out, out  # gloo's start-up chatter stays in worker.log
    snap = status_json(cli)
    assert snap["state"] == "succeeded"
    for t in snap["tasks"]:
        accuracy = t["metrics"]["val_accuracy"]
        assert t["epoch"] == t["epochs"] == 5 and accuracy >= 0.90 and abs(accuracy - alone) <= 0.02, (t, alone)
    w0, w1 = np.load(weights / "w-0.npz"), np.load(weights / "w-1.npz")
    assert w0.files and sorted(w0.files) == sorted(w1.files)
    assert all(np.array_equal(w0[k], w1[k]) for k in w0.files), "the tasks ended with different weights"
    assert not wait_gone(cli.home, 5)


@pytest.mark.cluster
def test_status_and_the_report_of_a_jax_run_read_as_on_tensorflow(pair):
    """The same run: status (its JSON and its table) has each task's steps, samples/s and replicas from the Keras 3
    runner's progress.json; `report` draws it (the PNG, exit 0) with every epoch of both tasks."""
    need("matplotlib")
    from launcher.diagnose import series

    cli, r, _weights, _alone = pair
    assert r.returncode == 0, r.stdout + r.stderr
    snap = status_json(cli)
    for t in snap["tasks"]:
        assert (t["step"], t["steps_per_epoch"], t["global_step"], t["replicas"]) == (22, 22, 110, 4), t
        assert t["samples_per_sec"] > 0 and t["loss"] > 0, t
        assert_within_epochs_are_means(t["run_dir"], 5)  # loss and metrics within epochs: means, as on TensorFlow
    table = cli("status", timeout=120)
    assert table.returncode == 0, table.stderr
    rows = [line.split() for line in table.stdout.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert len(rows) == 2 and all("5/5" in row and "22/22" in row for row in rows), table.stdout
    assert "replicas in sync: 4 over 2 worker(s)" in table.stdout, table.stdout
    png = cli("report", timeout=120)
    folder = cli.home / "runs" / snap["run_id"]
    assert png.returncode == 0 and png.stdout.strip() == str(folder / "report.png"), png.stdout + png.stderr
    assert (folder / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = series.load(folder)
    assert {(e["task"], e["epoch"]) for e in data["epochs"]} == {(t, n) for t in (0, 1) for n in range(1, 6)}
    assert all(e["samples_per_s"] > 0 for e in data["epochs"]) and data["attempts"][0]["outcome"] == "succeeded"
    from test_report import console_rates  # one throughput on JAX too: the console's lines are the report's bars

    shown = console_rates(r.stdout)
    assert {e["epoch"]: round(e["samples_per_s"]) for e in data["group"]["epochs"]} == shown, (shown, data["group"])
    assert round(snap["group"]["samples_per_sec"]) == shown[5] and snap["group"]["task"] == 0, snap["group"]


def test_kill_9_of_a_task_fails_the_run_naming_it(cli, tmp_path):
    def kill_task_1(_up, st):
        survivors = [psutil.Process(st["tasks"][0]["pid"]), psutil.Process(st["tasks"][0]["supervisor_pid"])]
        os.kill(st["tasks"][1]["pid"], signal.SIGKILL)
        killed_at = time.time()
        _gone, alive = psutil.wait_procs(survivors, timeout=10)
        took = time.time() - killed_at  # its peer waits in a gloo collective: the task core stops it
        assert not alive and took < 5.0, f"task 0 still there {took:.1f} s after task 1 was killed"

    code, out = cli.up_while(jax_spec(tmp_path, 200), lambda: in_epoch(cli, 1), kill_task_1, "both tasks training")
    assert code == 1, out
    assert "task 1" in out and "SIGKILL" in out and not launcher_traceback(out)
    failure = status_json(cli)["failure"]
    assert (failure["task"], failure["kind"], failure["signal"]) == (1, "killed", "SIGKILL"), failure
    assert not wait_gone(cli.home, 5)


def test_a_group_restart_resumes_after_the_last_saved_epoch(cli, tmp_path):
    spec = paced_spec(tmp_path, 5, 0.1, launch="max_restarts = 1",
                      args=("--checkpoint-dir", str(tmp_path / "checkpoint")))
    code, out = cli.up_while(spec, lambda: in_epoch(cli, 3),
                             lambda _up, st: os.kill(st["tasks"][1]["pid"], signal.SIGKILL), "epoch 3 to begin")
    assert code == 0, out
    assert "restarting the whole group" in out and "this attempt starts cold" not in out, out  # warm as it was
    resumed = [int(n) for n in re.findall(r"resuming at epoch (\d+)", out)]
    assert resumed and resumed[0] >= 3, out  # not from epoch 1
    for i in range(2):
        assert epochs_shown(out, i) == list(range(1, 6)), f"task {i} trained an epoch twice or skipped one"
    snap = status_json(cli)
    assert snap["state"] == "succeeded" and snap["attempt"] == 1
    assert all(t["warm"] for t in snap["tasks"]), snap["tasks"]  # forked from its fork server (Keras 3, JAX imported)
    assert [progress(t)["first_epoch"] for t in snap["tasks"]] == [resumed[0]] * 2
    ends = [progress(t)["metrics"] for t in snap["tasks"]]
    assert ends[0] and ends[0] == ends[1], ends  # one model: the same weights, the same figures on both
    assert not (tmp_path / "checkpoint" / "keras3").exists()  # the chief's backup, removed at a finished fit


def test_a_notice_stops_both_at_one_epoch_end_and_the_run_goes_on_from_there(cli, tmp_path):
    code, out = cli.up_while(paced_spec(tmp_path, 4, 0.15), lambda: in_epoch(cli, 2),
                             lambda _up, st: os.kill(st["tasks"][1]["pid"], signal.SIGTERM), "epoch 2 to begin")
    assert code == 0, out
    assert "was preempted" in out
    saved = [int(n) for n in re.findall(r"saved a checkpoint at the end of epoch (\d+) on notice", out)]
    resumed = [int(n) for n in re.findall(r"resuming at epoch (\d+)", out)]
    assert saved and resumed == [saved[0] + 1], out
    for i in range(2):
        assert epochs_shown(out, i) == list(range(1, 5)), f"task {i} trained an epoch twice or skipped one"
    snap = status_json(cli)
    assert snap["state"] == "succeeded" and snap["preemptions"] == 1 and snap["restarts"] == 0, snap
    assert not wait_gone(cli.home, 5)


def stepping(cli, steps: int):
    """The run's state once its record has every task at `steps` steps or more (what status reads)."""
    st = latest_state(cli)
    if st and st["state"] == "running" and all((t.get("progress") or {}).get("global_step", 0) >= steps
                                               for t in st["tasks"]):
        return st
    return None


def test_a_frozen_task_is_named_hung_with_the_stacks_of_both_jax_processes(cli, tmp_path):
    """While both train, status shows their steps and samples/s and `stacks` reads both JAX processes in fit
    (py-spy); then task 1 frozen (SIGSTOP), task 0 waits in a gloo collective: task 1 is named hung, every
    task's stacks are logged before anything is stopped, its innermost frames are in the failure, exit 1."""
    seen = {}

    def act(_up, st):
        seen["status"], seen["stacks"] = status_json(cli), cli("stacks", timeout=120)
        os.kill(st["tasks"][1]["pid"], signal.SIGSTOP)

    code, out = cli.up_while(jax_spec(tmp_path, 200, launch="heartbeat_timeout = 6"), lambda: stepping(cli, 5), act,
                             "both tasks training")
    for t in seen["status"]["tasks"]:  # the live view of a jax run
        assert t["state"] == "running" and t["steps_per_epoch"] == 22 and t["step"] is not None, t
        assert t["replicas"] == 4 and t["samples_per_sec"] > 0, t
    r = seen["stacks"]
    assert r.returncode == 0, r.stdout + r.stderr
    for i in (0, 1):
        section = r.stdout.split(f"task {i} (")[1].split("\ntask ")[0]
        assert "fit (" in section and "no stacks" not in section, r.stdout  # a frame in Keras 3's fit
    assert code == 1 and not launcher_traceback(out), out
    run = latest_state(cli)
    failure = run["failure"]
    assert (failure["task"], failure["kind"]) == (1, "hung") and "SIGSTOP" in failure["message"], failure
    assert "innermost frame last" in failure["message"], failure["message"]
    assert "task 1 (" in out and "hung" in out, out
    log = (cli.home / "runs" / run["run_id"] / "launcher.log").read_text()
    assert "stacks at the hang: task 0 (" in log and "stacks at the hang: task 1 (" in log, log[-3000:]
    assert log.count("fit (") >= 2 and "no stacks" not in log, log[-3000:]
    for t in run["tasks"]:
        assert list(Path(t["run_dir"]).glob("stacks-*.txt")), t["run_dir"]
    assert not wait_gone(cli.home, 10)


# --------------------------------------------------------------------------- pure: no JAX process

def test_each_task_feeds_an_equal_slice_cut_to_whole_batches():
    from worker.training.entrypoint import Task, WorkerError
    from worker.keras3.data import feeds
    from worker.keras3.group import Group

    def task(train=lambda ctx: (np.arange(1437), np.arange(1437) % 10)) -> Task:
        return Task(model=lambda: None, train_data=train, val_data=lambda ctx: (np.arange(360), np.arange(360)))

    fed = [feeds(task(), Group(index=i, size=2, local_devices=2, devices=4), 16, None) for i in range(2)]
    for i, (train, val) in enumerate(fed):  # 1437 // 2 = 718 each, 22 whole batches of 2 x 16
        assert (train.batch, train.steps, len(train.x), int(train.x[0])) == (32, 22, 704, 718 * i)
        assert (val.batch, val.steps, len(val.x)) == (32, 5, 160)
    assert not set(fed[0][0].x) & set(fed[1][0].x)
    with pytest.raises(WorkerError, match="not a tf.data.Dataset"):
        feeds(task(train=lambda ctx: object()), Group(index=0, size=1, local_devices=1, devices=1), 16, None)


def test_the_cpu_is_split_into_devices_unless_xla_flags_names_a_count():
    from worker.keras3.group import split_host

    env: dict[str, str] = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}
    split_host(2, env)
    assert env["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=2"
    given = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    split_host(2, given)
    assert given == {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    one: dict[str, str] = {}
    split_host(1, one)
    assert one == {}
