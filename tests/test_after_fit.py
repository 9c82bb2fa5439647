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

EPOCHS, STEPS = 3, 3  # a few steps an epoch: what is tested is the end of fit, not the training
EPOCH_LINE = re.compile(r"^task([\d,-]+)[^|]* \| epoch (\d+)/\d+ loss=", re.M)


def epochs_shown(out: str, tasks: int = 2) -> list[list[int]]:
    """Each task's epoch lines on the console, in order: a line alike on several tasks (`task0-1 | ...`) counts for
    each of them; one task's line may come alone when its peers' came later (a kill between them)."""
    shown: list[list[int]] = [[] for _ in range(tasks)]
    for who, epoch in EPOCH_LINE.findall(out):
        for part in who.split(","):
            first, _, last = part.partition("-")
            for task in range(int(first), int(last or first) + 1):
                shown[task].append(int(epoch))
    return shown

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
    """The run's state once task 1 holds after fit and task 0 has said its last epoch (so that both say it
    before the kill, as one line)."""
    st = latest_state(cli)
    if not st or st["state"] != "running" or not all(t.get("run_dir") for t in st["tasks"]):
        return None
    logs = [workdir / t["run_dir"] / "worker.log" for t in st["tasks"]]  # task folders, under their host's workdir
    try:
        said = [log.read_text(errors="replace") for log in logs]
    except OSError:
        return None
    return st if "holding after fit" in said[1] and f"epoch {EPOCHS}/{EPOCHS} loss=" in said[0] else None


@pytest.mark.parametrize("backend", [
    "tensorflow", pytest.param("jax", marks=pytest.mark.skipif(not keras3_on_jax() and not IN_CI,
                                                               reason="needs jax and keras >= 3.13 (always under CI)"))])
def test_a_kill_after_fit_ended_restarts_with_nothing_left_to_train(cli, tmp_path, backend):
    lines, example, keras, backup = BACKENDS[backend]
    (tmp_path / "hooks.py").write_text(HOLDS.format(example=example, keras=keras))
    spec = write_spec(tmp_path, f'{lines}entrypoint = "hooks:task"\nepochs = {EPOCHS}\nsteps_per_epoch = {STEPS}',
                      launch="max_restarts = 1",
                      extra=f'workdir = "{tmp_path}"\n')
    code, out = cli.up_while(spec, lambda: holding(cli, tmp_path), lambda _up, st: os.kill(st["tasks"][1]["pid"],
                                                                                  signal.SIGKILL),
                             "task 1 to hold after fit", ready_timeout=120, timeout=240)
    assert code == 0, out
    assert "restarting the whole group" in out, out
    shown = epochs_shown(out)
    assert shown == [list(range(1, EPOCHS + 1))] * 2, f"an epoch was trained again after the kill: {shown}\n{out}"
    snap = latest_state(cli)
    assert snap["state"] == "succeeded" and snap["attempt"] == 1, snap
    folder = tmp_path / Path(snap["tasks"][0]["run_dir"]).parent
    assert (folder / "model.keras").is_file()
    assert not (folder / "checkpoint" / backup).exists(), "the backup outlived the run's success"
    assert not wait_gone(cli.home, 5)


def start_worker(tmp_path: Path, run: str, checkpoints: Path, *more: str) -> subprocess.Popen:
    env = {**os.environ, "MGPU_RUN_ID": run, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    return subprocess.Popen([sys.executable, "-m", "worker", "--entrypoint", "worker.examples.digits:task",
                             "--epochs", "2", "--steps-per-epoch", "3", "--checkpoint-dir", str(checkpoints),
                             "--model-dir", str(tmp_path / "model"), *more],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)


def ended(*procs: subprocess.Popen) -> list[subprocess.CompletedProcess]:
    """Each worker's result once it exited (every one reaped, also when one of them runs too long)."""
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def worker(tmp_path: Path, run: str, checkpoints: Path, *more: str) -> subprocess.CompletedProcess:
    return ended(start_worker(tmp_path, run, checkpoints, *more))[0]


@pytest.mark.cluster  # three real trainings
def test_a_restart_of_a_finished_run_trains_nothing_and_another_run_is_refused_unless_asked(tmp_path):
    checkpoints = tmp_path / "checkpoint"
    first = worker(tmp_path, "run-a", checkpoints)
    assert first.returncode == 0, first.stdout + first.stderr
    assert json.loads((checkpoints / "finished.json").read_text())["run"] == "run-a"
    assert not (checkpoints / "chief").exists()
    held = sorted((p.relative_to(checkpoints), p.read_bytes()) for p in checkpoints.rglob("*") if p.is_file())

    # each of these three only reads the folder that holds run-a's finished training: they run at once
    again, other, asked = ended(
        start_worker(tmp_path, "run-a", checkpoints),  # the same run, restarted after its last save
        start_worker(tmp_path, "run-b", checkpoints),  # another run does not train into run-a's folder unasked
        start_worker(tmp_path, "run-b", checkpoints, "--resume-run", "run-a"))  # asked: nothing is left to train
    assert again.returncode == 0, again.stdout + again.stderr
    assert "nothing left to train" in again.stdout and "epoch 1/2" not in again.stdout, again.stdout
    assert other.returncode == 2 and "holds run run-a's finished training" in other.stderr, other.stderr
    assert asked.returncode == 2 and "nothing is left to train" in asked.stderr, asked.stderr
    assert sorted((p.relative_to(checkpoints), p.read_bytes()) for p in checkpoints.rglob("*") if p.is_file()) == held

    (checkpoints / "finished.json").unlink()  # the folder given up: another run trains in full
    other = worker(tmp_path, "run-b", checkpoints)
    assert other.returncode == 0, other.stdout + other.stderr
    assert "epoch 1/2" in other.stdout and "epoch 2/2" in other.stdout, other.stdout
    assert json.loads((checkpoints / "finished.json").read_text())["run"] == "run-b"
