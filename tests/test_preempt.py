"""Preemption through the launcher, for real: SIGTERM to a training process, the group saves at one
step, restarts without spending a restart, resumes at that step; and a plain failure still fails."""

import json
import os
import re
import signal
import sys
from pathlib import Path

import numpy as np

from conftest import latest_state, wait_gone, write_spec

STEPS, EPOCHS = 12, 3  # --steps-per-epoch (2 workers x 32 a step: digits has examples for 22)

HOOKS = '''
import os, sys, time
from dataclasses import replace
from worker.examples.digits import task as digits


def task():
    import tf_keras

    class Count(tf_keras.callbacks.Callback):
        """Steps this process trained (one file per process); in the first attempt every step from epoch 1's last
        on is slowed by SLOW, so that a test can aim within epoch 2 (a later attempt, which finds the first one's
        files, needs no aim: full speed)."""
        n = 0

        def __init__(self):
            super().__init__()
            later = any(f.startswith("trained-") for f in os.listdir(os.environ["MGPU_RUN_DIR"]))
            self.slow = 0.0 if later else float(os.environ.get("SLOW", "0.3"))

        def on_train_batch_end(self, batch, logs=None):
            self.n += 1
            with open(os.path.join(os.environ["MGPU_RUN_DIR"], "trained-%d" % os.getpid()), "w") as f:
                f.write(str(self.n))
            if os.environ.get("EXIT_AT") and self.n == int(os.environ["EXIT_AT"]):
                sys.exit(3)
            if self.n >= int(os.environ["STEPS"]):
                time.sleep(self.slow)

    return replace(digits(), callbacks=lambda: [Count()])
'''


def spec_for(tmp_path: Path, launch: str = "", env: str = "", every: int | None = None) -> Path:
    (tmp_path / "hooks.py").write_text(HOOKS)
    weights = tmp_path / "weights"
    weights.mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "worker", "--entrypoint", "hooks:task", "--epochs", str(EPOCHS),
            "--steps-per-epoch", str(STEPS),
            "--batch-size-per-replica", "32", "--save-weights", f"{weights}/w-{{task}}.npz"]
    if every:
        argv += ["--checkpoint-every-steps", str(every)]
    return write_spec(tmp_path, f"command = {json.dumps(argv)}", launch=launch,
                      extra=f'workdir = "{tmp_path}"\n',
                      env=f'TF_CPP_MIN_LOG_LEVEL = "2", MGPU_PROGRESS_INTERVAL = "0", STEPS = "{STEPS}"' + env)


def run_dir(tmp_path: Path, st: dict, i: int) -> Path:
    return tmp_path / st["tasks"][i]["run_dir"]


def trained(folder: Path) -> int:
    return sum(int(p.read_text() or 0) for p in folder.glob("trained-*"))


def in_epoch_2(cli, tmp_path):
    st = latest_state(cli)
    if not st or st["state"] != "running":
        return None
    p = [json.loads((run_dir(tmp_path, st, i) / "progress.json").read_text())
         if (run_dir(tmp_path, st, i) / "progress.json").exists() else {} for i in range(2)]
    return st if all(x.get("epoch") == 2 and (x.get("step") or 0) >= 4 for x in p) else None


def assert_equal_weights(tmp_path: Path) -> None:
    w0, w1 = np.load(tmp_path / "weights" / "w-0.npz"), np.load(tmp_path / "weights" / "w-1.npz")
    assert w0.files and max(float(np.max(np.abs(w0[k] - w1[k]))) for k in w0.files) <= 1e-6


def test_sigterm_to_a_training_process_saves_restarts_and_resumes_at_that_step(cli, tmp_path):
    spec = spec_for(tmp_path, launch="max_restarts = 0")
    code, out = cli.up_while(spec, lambda: in_epoch_2(cli, tmp_path),
                             lambda _up, st: os.kill(st["tasks"][1]["pid"], signal.SIGTERM), "epoch 2",
                             timeout=300)
    assert code == 0, out
    assert "was preempted" in out and "not counted against max_restarts" in out
    snap = json.loads(cli("status", "--json", timeout=60).stdout)
    assert snap["state"] == "succeeded" and snap["preemptions"] == 1 and snap["restarts"] == 0, snap
    assert [a["outcome"] for a in snap["attempts"]] == ["preempted", "succeeded"]
    st = latest_state(cli)
    saved = []
    for i in range(2):
        log = (run_dir(tmp_path, st, i) / "worker.log").read_text()
        saved += [int(s) for s in re.findall(r"notice \(SIGTERM\) at global step (\d+)", log)]
        assert trained(run_dir(tmp_path, st, i)) == EPOCHS * STEPS, f"task {i} trained a step twice or skipped one"
        p = json.loads((run_dir(tmp_path, st, i) / "progress.json").read_text())
        assert p["global_step"] == EPOCHS * STEPS and STEPS < p["first_global_step"] < 2 * STEPS, p
    assert saved and len(set(saved)) == 1, f"the workers did not agree on one step: {saved}"
    assert_equal_weights(tmp_path)
    assert not wait_gone(cli.home, 10)


def test_a_plain_failure_still_fails_the_run(cli, tmp_path):
    spec = spec_for(tmp_path, launch="max_restarts = 0", env=', EXIT_AT = "3"')
    r = cli("up", spec, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "exited with code 3" in out and "was preempted" not in out
    snap = json.loads(cli("status", "--json", timeout=60).stdout)
    assert snap["state"] == "failed" and snap["preemptions"] == 0
    assert not wait_gone(cli.home, 10)


def test_grace_too_short_for_the_save_kills_and_resumes_from_the_periodic_checkpoint(cli, tmp_path):
    """preempt_grace shorter than a step: the task is killed at the grace; the run resumes from the
    last checkpoint taken every 5 steps, and still succeeds as a preemption."""
    spec = spec_for(tmp_path, launch="max_restarts = 0\npreempt_grace = 0.3", env=', SLOW = "0.6"', every=5)
    code, out = cli.up_while(spec, lambda: in_epoch_2(cli, tmp_path),
                             lambda _up, st: os.kill(st["tasks"][1]["pid"], signal.SIGTERM), "epoch 2",
                             timeout=400)
    assert code == 0, out
    assert "(preempt_grace) after its notice: killed" in out
    snap = json.loads(cli("status", "--json", timeout=60).stdout)
    assert snap["state"] == "succeeded" and snap["preemptions"] == 1 and snap["restarts"] == 0, snap
    st = latest_state(cli)
    for i in range(2):
        p = json.loads((run_dir(tmp_path, st, i) / "progress.json").read_text())
        assert p["global_step"] == EPOCHS * STEPS and p["first_global_step"] % 5 == 0, p
        assert STEPS < p["first_global_step"] < 2 * STEPS, p
    assert_equal_weights(tmp_path)
