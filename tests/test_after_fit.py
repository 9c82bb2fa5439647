"""A crash after training ended (in fit's end, the model's save, the exit) never trains the run again: the
backup stays until every task has saved, and a restart of the same run that finds the run finished trains
nothing. Real processes: the launcher with two digits workers, and the worker alone."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import IN_CI, latest_state, wait_gone, write_spec
from test_jax import keras3_on_jax

EPOCHS = 3
EPOCH_LINE = re.compile(r"^task[\d,-]+[^|]* \| epoch (\d+)/\d+ loss=", re.M)

# task 1 of the first attempt holds in fit's end (after the backup's on_train_end) until it is killed
HOLDS = '''
import os, time
from dataclasses import replace
from worker.examples.{example} import task as digits


def task():
    import {keras} as keras

    class Hold(keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            if os.environ.get("MGPU_TASK_INDEX") == "1" and os.environ.get("MGPU_ATTEMPT") == "0":
                print("holding after fit", flush=True)
                time.sleep(120)

    return replace(digits(), callbacks=lambda: [Hold()])
'''
BACKENDS = {  # the backend's spec lines, its digits example, its Keras, its backup's folder
    "tensorflow": ("", "digits", "tf_keras", "chief"),
    "jax": ('backend = "jax"\nlocal_replicas = 2\nbatch_size_per_replica = 16\n', "digits_keras3", "keras", "keras3"),
}


def holding(cli, workdir: Path):
    st = latest_state(cli)
    if not st or st["state"] != "running" or not st["tasks"][1].get("run_dir"):
        return None
    log = workdir / st["tasks"][1]["run_dir"] / "worker.log"  # the task folder, under its host's workdir
    try:
        return st if "holding after fit" in log.read_text(errors="replace") else None
    except OSError:
        return None


@pytest.mark.parametrize("backend", [
    "tensorflow", pytest.param("jax", marks=pytest.mark.skipif(not keras3_on_jax() and not IN_CI,
                                                               reason="needs jax and keras >= 3.13 (always under CI)"))])
def test_a_kill_after_fit_ended_restarts_with_nothing_left_to_train(cli, tmp_path, backend):
    lines, example, keras, backup = BACKENDS[backend]
    (tmp_path / "hooks.py").write_text(HOLDS.format(example=example, keras=keras))
    spec = write_spec(tmp_path, f'{lines}entrypoint = "hooks:task"\nepochs = {EPOCHS}', launch="max_restarts = 1",
                      extra=f'workdir = "{tmp_path}"\n')
    code, out = cli.up_while(spec, lambda: holding(cli, tmp_path), lambda _up, st: os.kill(st["tasks"][1]["pid"],
                                                                                  signal.SIGKILL),
                             "task 1 to hold after fit", ready_timeout=120, timeout=240)
    assert code == 0, out
    assert "restarting the whole group" in out, out
    shown = [int(n) for n in EPOCH_LINE.findall(out)]
    assert shown == list(range(1, EPOCHS + 1)), f"an epoch was trained again after the kill: {shown}\n{out}"
    snap = latest_state(cli)
    assert snap["state"] == "succeeded" and snap["attempt"] == 1, snap
    folder = tmp_path / Path(snap["tasks"][0]["run_dir"]).parent
    assert (folder / "model.keras").is_file()
    assert not (folder / "checkpoint" / backup).exists(), "the backup outlived the run's success"
    assert not wait_gone(cli.home, 5)


def worker(tmp_path: Path, run: str, checkpoints: Path, *more: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MGPU_RUN_ID": run, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "worker", "--entrypoint", "worker.examples.digits:task",
                           "--epochs", "2", "--steps-per-epoch", "3", "--checkpoint-dir", str(checkpoints),
                           "--model-dir", str(tmp_path / "model"), *more],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


@pytest.mark.cluster  # three real trainings
def test_a_restart_of_a_finished_run_trains_nothing_and_another_run_is_refused_unless_asked(tmp_path):
    checkpoints = tmp_path / "checkpoint"
    first = worker(tmp_path, "run-a", checkpoints)
    assert first.returncode == 0, first.stdout + first.stderr
    assert json.loads((checkpoints / "finished.json").read_text())["run"] == "run-a"
    assert not (checkpoints / "chief").exists()

    again = worker(tmp_path, "run-a", checkpoints)  # the same run, restarted after its last save
    assert again.returncode == 0, again.stdout + again.stderr
    assert "nothing left to train" in again.stdout and "epoch 1/2" not in again.stdout, again.stdout

    other = worker(tmp_path, "run-b", checkpoints)  # another run does not train into run-a's folder unasked
    assert other.returncode == 2 and "holds run run-a's finished training" in other.stderr, other.stderr
    other = worker(tmp_path, "run-b", checkpoints, "--resume-run", "run-a")  # asked: nothing is left to train
    assert other.returncode == 2 and "nothing is left to train" in other.stderr, other.stderr

    (checkpoints / "finished.json").unlink()  # the folder given up: another run trains in full
    other = worker(tmp_path, "run-b", checkpoints)
    assert other.returncode == 0, other.stdout + other.stderr
    assert "epoch 1/2" in other.stdout and "epoch 2/2" in other.stdout, other.stdout
    assert json.loads((checkpoints / "finished.json").read_text())["run"] == "run-b"
