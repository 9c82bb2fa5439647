"""States the launcher shows after its own end, with real processes through the real CLI: a task preempted
and killed at the end of its grace stays preempted whatever its host's exit code says; a finished run's
heartbeat age stops at its end; `stacks` after a kill -9 of the launcher touches no process that merely
holds a task's old pid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from conftest import latest_state, wait_for, wait_gone, write_spec

PY = sys.executable


def command(script: str) -> str:
    return f"command = {json.dumps([PY, '-c', script])}"


def no_traceback(out: str) -> bool:
    return not any(line.startswith("Traceback") for line in out.splitlines())


def status_json(cli, *args) -> dict:
    r = cli("status", "--json", *args, timeout=60)
    assert r.returncode == 0 and no_traceback(r.stderr), r.stdout + r.stderr
    return json.loads(r.stdout)


# task 0 ignores its notice (killed at the end of preempt_grace), and says when it does; task 1 waits
DEAF_TO_NOTICE = """
import os, signal, sys, time
if os.environ["MGPU_TASK_INDEX"] == "0":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(sys.argv[1], "w").close()
time.sleep(600)
"""


def test_a_task_killed_at_the_end_of_its_grace_stays_preempted(cli, tmp_path):
    deaf = tmp_path / "deaf"
    spec = write_spec(tmp_path, f"command = {json.dumps([PY, '-c', DEAF_TO_NOTICE, str(deaf)])}",
                      launch="preempt_grace = 2\nstop_grace = 1")
    up = cli.popen("up", spec)
    try:
        st = wait_for(lambda: (s := latest_state(cli)) and s["state"] == "running" and deaf.exists() and s, 60,
                      "both tasks to run, task 0 deaf to its notice")
        os.kill(st["tasks"][0]["supervisor_pid"], signal.SIGTERM)  # the notice
        # the agent records the preemption at once, then gives the others preempt_grace: the launcher dies there
        wait_for(lambda: (s := latest_state(cli)) and s["tasks"][0]["state"] == "preempted", 30, "task 0 preempted")
        up.kill()
        up.wait()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert not wait_gone(cli.home, 30)
    for args in (["--probe"], []):  # the host's exit code is -9 (SIGKILL): the record knows it was a preemption
        snap = status_json(cli, *args)
        assert snap["state"] == "lost", snap
        assert (snap["tasks"][0]["state"], snap["tasks"][0]["exit_code"]) == ("preempted", -9), snap["tasks"]
    assert latest_state(cli)["tasks"][0]["state"] == "preempted"


PROGRESSES = """
import json, os, time
now = time.time()
with open(os.path.join(os.environ["MGPU_RUN_DIR"], "progress.json"), "w") as f:
    json.dump({"time": now, "state": "training", "epoch": 1, "epochs": 1, "step": 3, "global_step": 3}, f)
time.sleep(2.5)
"""


def test_a_finished_runs_heartbeat_age_stops_at_its_end(cli, tmp_path):
    assert cli("up", write_spec(tmp_path, command(PROGRESSES), n=1), timeout=120).returncode == 0
    first = status_json(cli)
    time.sleep(1.5)
    second = status_json(cli)
    ages = [s["tasks"][0]["heartbeat_age"] for s in (first, second)]
    assert ages[0] is not None and ages[0] == ages[1] and ages[0] < 10, ages  # frozen, not counting on
    st = latest_state(cli)
    assert abs(ages[0] - (st["ended_at"] - st["tasks"][0]["progress"]["time"])) < 0.2, (ages, st)


SLEEPS = "import time\ndef task_sleeps_here():\n    time.sleep(600)\ntask_sleeps_here()\n"
BYSTANDER = "import time\ndef bystander_here():\n    time.sleep(600)\nbystander_here()\n"


def test_stacks_after_the_launcher_is_killed_read_no_process_that_took_a_tasks_pid(cli, tmp_path):
    up = cli.popen("up", write_spec(tmp_path, command(SLEEPS), n=1))
    try:
        st = wait_for(lambda: (s := latest_state(cli)) and s["state"] == "running" and s, 60, "the task to run")
    finally:
        up.kill()  # kill -9: the record still says running; the supervisor stops the task
        up.wait()
    assert not wait_gone(cli.home, 30)
    bystander = subprocess.Popen([PY, "-c", BYSTANDER])
    try:
        # the task's pid now names another process (pids are reused): only its create time tells them apart
        path = cli.home / "runs" / st["run_id"] / "state.json"
        record = json.loads(path.read_text())
        record["tasks"][0]["pid"] = bystander.pid
        path.write_text(json.dumps(record))
        r = cli("stacks", timeout=120)
        out = r.stdout + r.stderr
        assert r.returncode == 1 and no_traceback(out), out
        assert "bystander_here" not in out and "has no running task (run state: lost)" in r.stderr, out

        # on the host itself: a pid whose create time is not the task's is not read (py-spy never attaches)
        task_created = st["tasks"][0]["create_time"]
        r = subprocess.run([PY, "-m", "worker.host.stacks", "--pid", str(bystander.pid), "--create-time",
                            repr(task_created), "--json"], capture_output=True, text=True, timeout=60)
        found = json.loads(r.stdout)
        assert r.returncode == 1 and not found["threads"] and "has ended" in found["error"], r.stdout + r.stderr
        assert psutil.Process(bystander.pid).status() != psutil.STATUS_STOPPED and bystander.poll() is None
        own = psutil.Process(bystander.pid).create_time()
        r = subprocess.run([PY, "-m", "worker.host.stacks", "--pid", str(bystander.pid), "--create-time", repr(own),
                            "--json"], capture_output=True, text=True, timeout=60)
        assert "bystander_here" in r.stdout or "py-spy" in json.loads(r.stdout)["error"], r.stdout + r.stderr
    finally:
        bystander.kill()
        bystander.wait()
