"""Preemption on the worker side, for real: SIGTERM -> every worker saves at one step, exit 75.

Two `python -m worker` processes with TF_CONFIG on free localhost ports train digits (3 epochs
of 10 steps); hooks set by environment variables slow steps down, pause, or fail at a global
step, and count the steps each process trained (`trained-<attempt>` in its task folder).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from test_worker import REPO, Workers, assert_prompt_end, run_ok
from worker.training.progress import read_progress
from worker.host.protocol import EXIT_PREEMPTED

STEPS = 10  # --steps-per-epoch (a global batch of 64: digits has examples for 22)
EPOCHS = 3

HOOKS = '''
"""digits with test hooks: SLOW (seconds per step from epoch 1's last step on: aim within epoch 2),
PAUSE_AT / EXIT_AT (a global step), GATE0 (a file: task 0 waits on import until it exists, while task 1
waits for it)."""
import os
import sys
import time

from worker.examples.digits import task as digits

if os.environ["MGPU_TASK_INDEX"] == "0" and os.environ.get("GATE0"):
    deadline = time.time() + 120
    while not os.path.exists(os.environ["GATE0"]) and time.time() < deadline:
        time.sleep(0.05)


def task():
    import tf_keras

    env = os.environ

    class Hooks(tf_keras.callbacks.Callback):
        trained = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            self.trained += 1
            path = os.path.join(env["MGPU_RUN_DIR"], "trained-" + env["ATTEMPT"])
            with open(path, "w") as out:
                out.write(str(self.trained))
            step = self.epoch * self.params["steps"] + int(batch) + 1
            if step == int(env.get("EXIT_AT", 0)):
                sys.exit(3)
            if step == int(env.get("PAUSE_AT", 0)):
                time.sleep(120)
            if step >= self.params["steps"]:
                time.sleep(float(env.get("SLOW", 0)))

    t = digits()
    t.callbacks = lambda: [Hooks()]
    return t
'''


@pytest.fixture
def run(tmp_path):
    (tmp_path / "hooks.py").write_text(HOOKS)  # found through the cwd
    return tmp_path / "run"


def start(run, attempt: int, *extra: str, n: int = 2, **env: str) -> Workers:
    args = ["--entrypoint", "hooks:task", "--epochs", str(EPOCHS), "--steps-per-epoch", str(STEPS),
            "--save-weights", str(run / "weights-{task}.npz"), *extra]
    return Workers(run, args, n=n, cwd=run.parent, attempt=attempt,
                   env={"ATTEMPT": str(attempt), "MGPU_PROGRESS_INTERVAL": "0", **env})


def progress(workers: Workers, i: int) -> dict:
    return read_progress(str(workers.task_dir(i))) or {}


def trained(workers: Workers, i: int, attempt: int) -> int:
    return int((workers.task_dir(i) / f"trained-{attempt}").read_text())


def wait_until(workers: Workers, ready, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not ready():
        assert time.time() < deadline, workers.tails()
        assert all(p.poll() is None for p in workers.procs), workers.tails()
        time.sleep(0.01)


def mid_epoch_2(workers: Workers, i: int) -> bool:
    p = progress(workers, i)
    return p.get("epoch") == 2 and (p.get("step") or 0) >= 3


def assert_same_weights(run) -> None:
    weights = [np.load(run / f"weights-{i}.npz") for i in range(2)]
    assert max(float(np.abs(weights[0][k] - weights[1][k]).max()) for k in weights[0].files) <= 1e-6


def assert_resumed_at(workers: Workers, attempt: int, saved: int) -> None:
    """Attempt `attempt` started at global step `saved` and trained only the rest."""
    for i in range(workers.n):
        done = saved - STEPS * (saved // STEPS)
        line = f"resuming at epoch {saved // STEPS + 1}" + (f" step {done + 1}" if done else "")
        assert line in workers.log(i), workers.log(i)
        p = progress(workers, i)
        assert (p["state"], p["first_epoch"], p["epoch"], p["step"]) == \
            ("done", saved // STEPS + 1, EPOCHS, STEPS), p
        assert (p["first_global_step"], p["global_step"]) == (saved, EPOCHS * STEPS), p
        assert trained(workers, i, attempt) == EPOCHS * STEPS - saved  # no step twice


@pytest.mark.cluster
def test_sigterm_to_one_worker_saves_on_both_at_one_step_and_resumes_there(run):
    with start(run, 0, SLOW="0.2") as first:
        wait_until(first, lambda: mid_epoch_2(first, 1))
        sent = time.time()
        os.killpg(first.procs[1].pid, signal.SIGTERM)  # as a supervisor does: its group
        codes = first.wait(60)
        took = time.time() - sent
    assert codes == [EXIT_PREEMPTED] * 2, first.tails()
    print(f"SIGTERM to both workers exited {EXIT_PREEMPTED}: {took:.2f} s")
    assert took < 20, first.tails()
    saved = progress(first, 0)["global_step"]
    assert STEPS < saved < 2 * STEPS, saved  # mid-epoch 2
    for i in range(2):
        p = progress(first, i)
        assert (p["state"], p["epoch"], p["step"], p["global_step"]) == \
            ("preempted", 2, saved - STEPS, saved), p
        assert f"saved a checkpoint at global step {saved} on notice" in first.log(i)
        assert trained(first, i, 0) == saved
    assert "notice (SIGTERM)" in first.log(1) and "notice (SIGTERM)" not in first.log(0)

    second = run_ok(start(run, 1))
    assert_resumed_at(second, 1, saved)
    assert_same_weights(run)
    assert (run / "model.keras").exists()
    assert_prompt_end(second)


@pytest.mark.cluster
def test_sigterm_to_both_at_once_agrees_on_one_step(run):
    # Slurm and `down` signal every task: both claim a step, the first claim stands
    with start(run, 0, SLOW="0.2") as workers:
        wait_until(workers, lambda: mid_epoch_2(workers, 0))
        for proc in workers.procs:
            os.killpg(proc.pid, signal.SIGTERM)
        codes = workers.wait(60)
    assert codes == [EXIT_PREEMPTED] * 2, workers.tails()
    steps = {progress(workers, i)["global_step"] for i in range(2)}
    assert len(steps) == 1, workers.tails()
    assert {progress(workers, i)["state"] for i in range(2)} == {"preempted"}


def tensorflow_loaded(pid: int) -> bool:
    return any("libtensorflow" in m.path for m in psutil.Process(pid).memory_maps())


def listening(pid: int) -> bool:
    proc = psutil.Process(pid)
    conns = proc.net_connections() if hasattr(proc, "net_connections") else proc.connections()
    return any(c.status == psutil.CONN_LISTEN for c in conns)


@pytest.mark.cluster
def test_sigterm_while_waiting_for_peers_is_kept(run):
    # TensorFlow's own SIGTERM handler, in place while the strategy waits for its peers, drops
    # the signal; the runner holds it back until its handler is in place
    # the chief comes late: task 0 waits on import until the test opens its gate, once task 1 has TensorFlow loaded
    # (task 1 then waits for the chief's port: worker.tensorflow.strategy.wait_for_chief); the signal goes to task 1 as soon
    # as it listens, in the strategy's start
    with start(run, 0, GATE0=str(run / "gate")) as workers:
        wait_until(workers, lambda: tensorflow_loaded(workers.procs[1].pid))
        (run / "gate").touch()
        wait_until(workers, lambda: listening(workers.procs[1].pid))
        workers.procs[1].send_signal(signal.SIGTERM)
        codes = workers.wait(90)
    assert codes == [EXIT_PREEMPTED] * 2, workers.tails()
    assert all(progress(workers, i)["global_step"] == 2 for i in range(2)), workers.tails()
    assert "SIGTERM caught" not in workers.log(1)


@pytest.mark.cluster
def test_periodic_checkpoint_is_where_a_killed_group_resumes(run):
    with start(run, 0, "--checkpoint-every-steps", "5", PAUSE_AT="17") as first:
        wait_until(first, lambda: all(progress(first, i).get("global_step") == 17
                                      for i in range(2)))
        first.kill(1)  # no notice: SIGKILL ...
        first.kill(0)  # ... and the peer is stopped too
    second = run_ok(start(run, 1, "--checkpoint-every-steps", "5"))
    assert_resumed_at(second, 1, 15)  # the last multiple of 5 before 17 (mid-epoch 2: not an epoch end)
    assert_same_weights(run)


@pytest.mark.cluster
def test_one_worker_saves_at_once_on_sigterm(run):
    with start(run, 0, n=1, SLOW="0.2") as workers:
        wait_until(workers, lambda: mid_epoch_2(workers, 0))
        workers.procs[0].send_signal(signal.SIGTERM)
        assert workers.wait(60) == [EXIT_PREEMPTED], workers.tails()
    p = progress(workers, 0)
    assert p["state"] == "preempted" and p["epoch"] == 2 and 0 < p["step"] < p["steps_per_epoch"]
    assert f"saved a checkpoint at global step {p['global_step']} on notice" in workers.log(0)


@pytest.mark.cluster
def test_a_failure_is_not_a_preemption(run, tmp_path):
    (tmp_path / "broken.py").write_text("def task():\n    raise RuntimeError('boom')\n")
    # two runs at once, each of its own processes: a pair that fails at a step, one worker whose entrypoint raises
    with start(run, 0, EXIT_AT="5") as workers, \
            Workers(tmp_path / "broken", ["--entrypoint", "broken:task"], n=1, cwd=tmp_path) as bad:
        assert workers.wait(90) == [3, 3], workers.tails()
        assert bad.wait(90) == [1], bad.tails()
    assert {progress(workers, i)["state"] for i in range(2)} == {"training"}
    assert "RuntimeError: boom" in bad.log(0)


def test_help_documents_checkpoint_every_steps():
    out = subprocess.run([sys.executable, "-m", "worker", "--help"], capture_output=True,
                         text=True, cwd=REPO, timeout=60).stdout
    assert "--checkpoint-every-steps N" in out and "exits 75" in out
    bad = subprocess.run([sys.executable, "-m", "worker", "--entrypoint", "x:y",
                          "--checkpoint-every-steps", "0"], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert bad.returncode == 2 and "at least 1" in bad.stderr
