"""Host-side file faults on real disks (a small tmpfs that is full, or fills mid-run), a task folder
deleted mid-run, a notice before TensorFlow is up: the exit code always reaches the launcher, a
failed write is one paragraph naming the path and the free space, and nothing is left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import IN_CI, Cli, latest_state, reap, run_processes, tmpfs, wait_for, wait_gone, write_spec

needs_root = pytest.mark.skipif(os.geteuid() != 0 and not IN_CI,
                                reason="needs root to mount a small tmpfs (never skipped under CI=true)")
PY = sys.executable


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs at tmp_path/disk, unmounted afterwards."""
    with tmpfs(tmp_path / "disk", "2m") as disk:
        yield disk


def fill(disk: Path) -> None:
    subprocess.run(["dd", "if=/dev/zero", f"of={disk}/filler", "bs=64k"], capture_output=True)


def command(script: str) -> str:
    return f"command = {json.dumps([PY, '-c', script])}"


def no_traceback(out: str) -> bool:
    return not any(line.startswith("Traceback") for line in out.splitlines())


@needs_root
def test_task_folder_on_a_full_disk_still_reports_its_exit(cli, tmp_path, small_disk):
    (small_disk / "wd").mkdir()
    fill(small_disk)
    spec = write_spec(tmp_path, command("import time; print('training', flush=True); time.sleep(1)"), n=1,
                      extra=f'workdir = "{small_disk}/wd"\n')
    r = cli("up", spec, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and no_traceback(out), out  # the task exited 0: the run succeeded
    assert "cannot write" in out and "MiB free" in out and str(small_disk) in out, out
    assert latest_state(cli)["tasks"][0]["state"] == "succeeded"
    assert not wait_gone(cli.home, 5)


@needs_root
def test_a_disk_that_fills_mid_run_or_a_deleted_folder_loses_no_exit_code(cli, tmp_path, small_disk):
    (small_disk / "wd").mkdir()
    script = ("import os, shutil, subprocess, sys, time; i = int(os.environ['MGPU_TASK_INDEX']); time.sleep(0.5)\n"
              f"if i == 0: subprocess.run(['dd', 'if=/dev/zero', 'of={small_disk}/filler', 'bs=64k'], "
              "capture_output=True)\n"
              "else: shutil.rmtree(os.environ['MGPU_RUN_DIR'])\n"
              "print('x' * 1000, flush=True); time.sleep(1); sys.exit(3 if i == 1 else 0)")
    spec = write_spec(tmp_path, command(script), extra=f'workdir = "{small_disk}/wd"\n')
    r = cli("up", spec, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and no_traceback(out), out
    st = latest_state(cli)
    failure = st["failure"]
    assert (failure["task"], failure["kind"], failure["exit_code"]) == (1, "exited", 3), failure  # not "lost"
    assert "exited with code 3" in failure["message"], failure
    assert not wait_gone(cli.home, 5)


@pytest.mark.cluster
@needs_root
def test_mgpu_home_filling_mid_run_is_said_once_and_status_still_answers(tmp_path, small_disk):
    cli = Cli(small_disk / "home", tmp_path)
    script = (f"import subprocess, time; time.sleep(1); subprocess.run(['dd', 'if=/dev/zero', "
              f"'of={small_disk}/filler', 'bs=64k'], capture_output=True); time.sleep(2); print('done', flush=True)")
    spec = write_spec(tmp_path, command(script))
    try:
        r = cli("up", spec, timeout=120)
        out = r.stdout + r.stderr
        assert r.returncode == 0 and no_traceback(out), out
        assert out.count("cannot write the run record") == 1 and "MiB free" in out, out
        st = cli("status", timeout=60)
        assert st.returncode in (0, 1) and no_traceback(st.stdout + st.stderr), st.stdout + st.stderr
    finally:
        left = reap(run_processes(cli.home))
    assert not left


def test_notice_before_tensorflow_is_up_is_a_preemption(cli, tmp_path):
    """SIGTERM to a task's supervisor while the training still imports TensorFlow, with a short
    preempt_grace: the task is killed unsaved, and that is a preemption: the group starts again."""
    ckpt = tmp_path / "ckpt"
    # standby = false: no fork servers importing TensorFlow at the idle priority beside the run (starved on a
    # loaded machine, this test took 75 s there with them); standbys are test_standby.py's
    spec = write_spec(tmp_path, 'entrypoint = "worker.examples.digits:task"\nepochs = 1\nsteps_per_epoch = 5\n'
                      f'checkpoint_dir = "{ckpt}"', launch="preempt_grace = 0.5\nmax_preemptions = 1\nstandby = false")
    up = cli.popen("up", spec)
    try:
        st = wait_for(lambda: (s := latest_state(cli)) and s["state"] == "running" and s, 120, "both tasks started")
        os.kill(st["tasks"][1]["supervisor_pid"], signal.SIGTERM)  # TensorFlow is still importing here
        out, _ = up.communicate(timeout=240)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 0 and no_traceback(out), out
    assert "was preempted" in out and "out of memory" not in out, out
    st = latest_state(cli)
    assert st["preemptions"] == 1 and st["restarts"] == 0 and st["attempts"][0]["outcome"] == "preempted", st
    time.sleep(0.1)
