"""Warm standbys, for real: once a task trains, its host keeps a process for the next attempt with Python and
TensorFlow imported; a restart starts there. A standby that dies is replaced and fails nothing; `down`,
Ctrl-C and a lost launcher leave none; `standby = false` restarts cold."""

import json
import os
import signal
import sys

from conftest import alive, latest_state, status_json, wait_for, wait_gone, write_spec
from test_preempt import HOOKS, STEPS, assert_equal_weights, run_dir

EPOCHS = 6


def spec_for(tmp_path, launch: str, slow: str = "0.2"):
    """Digits through a user's `python -m worker` (the hooks slow each step so a test can aim), weights saved."""
    (tmp_path / "hooks.py").write_text(HOOKS)
    weights = tmp_path / "weights"
    weights.mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "worker", "--entrypoint", "hooks:task", "--epochs", str(EPOCHS),
            "--batch-size-per-replica", "32", "--checkpoint-every-steps", "5",
            "--save-weights", f"{weights}/w-{{task}}.npz"]
    return write_spec(tmp_path, f"command = {json.dumps(argv)}", launch=launch, extra=f'workdir = "{tmp_path}"\n',
                      env=f'TF_CPP_MIN_LOG_LEVEL = "2", SLOW = "{slow}"')


def standbys(cli, attempt: int = 1, tasks: int = 2) -> dict | None:
    """{task: its standby's pid} once every task has a ready standby for `attempt` (a live process)."""
    st = latest_state(cli)
    if not st or st["state"] != "running":
        return None
    found = {t["index"]: t.get("standby") for t in st["tasks"]}
    if len(found) == tasks and all(s and s["ready"] and s["attempt"] == attempt and alive(s["pid"])
                                   for s in found.values()):
        return {i: s["pid"] for i, s in found.items()}
    return None


def test_a_kill_9_restarts_from_the_standbys_and_a_dead_standby_is_replaced(cli, tmp_path):
    spec = spec_for(tmp_path, "max_restarts = 1")
    with cli.running("up", spec) as up:
        first = wait_for(lambda: standbys(cli), 240, "a ready standby for every task")
        os.kill(first[0], signal.SIGKILL)  # the standby itself dies: replaced, and no failure
        second = wait_for(lambda: (s := standbys(cli)) and s[0] != first[0] and s, 180, "task 0's new standby")
        assert second[1] == first[1]
        st = latest_state(cli)
        assert st["attempt"] == 0 and st["restarts"] == 0, "a standby's death counted against the run"
        os.kill(st["tasks"][1]["pid"], signal.SIGKILL)
        out, _ = up.communicate(timeout=400)
    assert up.returncode == 0, out
    assert "(2 task(s) from standbys)" in out, out
    snap = status_json(cli)
    assert snap["state"] == "succeeded" and snap["restarts"] == 1 and len(snap["attempts"]) == 2, snap
    st = latest_state(cli)
    for t in st["tasks"]:
        assert t["pid"] == second[t["index"]] and t["warm"], f"task {t['index']} did not start from its standby: {t}"
        assert t["standby"] is None
        p = json.loads((run_dir(tmp_path, st, t["index"]) / "progress.json").read_text())
        saved = p["first_global_step"] % 5 == 0 or p["first_global_step"] % STEPS == 0  # every 5 steps, each epoch
        assert saved and p["first_global_step"] > 0, p  # resumed at a saved step
    assert_equal_weights(tmp_path)
    assert not wait_gone(cli.home, 5)


def test_standby_false_restarts_cold(cli, tmp_path):
    spec = spec_for(tmp_path, "max_restarts = 1\nstandby = false", slow="0.05")

    def training():
        st = latest_state(cli)
        ok = st and st["state"] == "running" and all(
            (json.loads(p.read_text()) if (p := run_dir(tmp_path, st, i) / "progress.json").exists() else {})
            .get("global_step", 0) >= 10 for i in range(2))
        return st if ok else None

    code, out = cli.up_while(spec, training, lambda _up, st: os.kill(st["tasks"][1]["pid"], signal.SIGKILL),
                             "both tasks past step 10", timeout=400)
    assert code == 0, out
    st = latest_state(cli)
    assert st["restarts"] == 1 and all(not t["warm"] and t["standby"] is None for t in st["tasks"]), st["tasks"]
    log = (run_dir(tmp_path, st, 0) / "worker.log").read_text()
    assert "worker.task.standby" not in log


SCRIPT = """
import json, os, sys, time
d = os.environ["MGPU_RUN_DIR"]
print("script", __name__, sys.argv[1:], "tensorflow" in sys.modules, os.environ["MGPU_ATTEMPT"], flush=True)
print("cores of every thread", sorted({c for t in os.listdir("/proc/self/task") for c in os.sched_getaffinity(int(t))}),
      flush=True)
with open(os.path.join(d, ".p"), "w") as f:
    json.dump({"state": "training", "global_step": 1, "time": time.time()}, f)
os.replace(os.path.join(d, ".p"), os.path.join(d, "progress.json"))
if os.environ["MGPU_ATTEMPT"] == "0":  # the first attempt waits for the test (which kills task 1, or stops all)
    time.sleep(300)
"""


def script_spec(tmp_path, launch: str = "max_restarts = 1", each: str = "", env: str = 'TF_CPP_MIN_LOG_LEVEL = "2"'):
    (tmp_path / "train.py").write_text(SCRIPT)
    return write_spec(tmp_path, f'command = ["{sys.executable}", "train.py", "--lr", "0.1"]', launch=launch,
                      extra=f'workdir = "{tmp_path}"\n', each=each, env=env)


def test_a_users_script_restarts_in_its_standby_as_main_with_its_arguments(cli, tmp_path):
    spec = script_spec(tmp_path, each="cpus = [{i}]\n")
    with cli.running("up", spec) as up:
        ready = wait_for(lambda: standbys(cli), 240, "a ready standby for every task")
        # a standby imports on any core (what idle time the host has), and takes its task's cores at go
        assert all(os.sched_getaffinity(pid) == os.sched_getaffinity(0) for pid in ready.values())
        shown = cli("status", timeout=120).stdout
        assert "standbys for attempt 1: task 0 ready (" in shown and "GB in all" in shown, shown
        os.kill(latest_state(cli)["tasks"][1]["pid"], signal.SIGKILL)
        out, _ = up.communicate(timeout=300)
    assert up.returncode == 0, out
    st = latest_state(cli)
    assert [t["pid"] for t in st["tasks"]] == [ready[0], ready[1]] and all(t["warm"] for t in st["tasks"])
    log = (run_dir(tmp_path, st, 1) / "worker.log").read_text()
    assert "script __main__ ['--lr', '0.1'] True 1" in log, log[-2000:]
    assert log.count("cores of every thread [1]") == 2, log[-2000:]  # the cold attempt's, and the warm one's
    assert "script __main__ ['--lr', '0.1'] False 0" in log  # the first attempt started cold, as ever


def test_a_standby_that_keeps_dying_is_told_and_the_restart_starts_cold(cli, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(  # every standby of this run dies at its start, saying why
        'import os\nif "MGPU_STANDBY_FD" in os.environ:\n    print("no standby on this host", flush=True)\n'
        "    os._exit(3)\n")
    spec = script_spec(tmp_path, env=f'PYTHONPATH = "{site}"')
    told = "its standby for attempt 1 ended with code 3 (no standby on this host), 3 times in all: none is started again"

    def said() -> bool:
        st = latest_state(cli)
        log = cli.home / "runs" / st["run_id"] / "launcher.log" if st else None
        return bool(log and log.exists() and log.read_text().count(told) == 2)

    with cli.running("up", spec) as up:
        wait_for(said, 120, "both tasks' standbys given up, in the launcher's log")
        os.kill(latest_state(cli)["tasks"][1]["pid"], signal.SIGKILL)
        out, _ = up.communicate(timeout=300)
    assert up.returncode == 0, out
    st = latest_state(cli)
    lines = (cli.home / "runs" / st["run_id"] / "launcher.log").read_text().splitlines()
    for i in range(2):  # the screen says it as the log does (a long line may wrap there)
        assert any(f"task {i} (localhost:" in line and told in line for line in lines), lines
    assert "no standby on this host" in out, out
    assert st["restarts"] == 1 and not any(t["warm"] for t in st["tasks"]), st["tasks"]
    assert not wait_gone(cli.home, 5)


def stop_and_see_none_left(cli, tmp_path, stop) -> None:
    spec = script_spec(tmp_path)
    with cli.running("up", spec, start_new_session=True) as up:
        ready = wait_for(lambda: standbys(cli), 240, "a ready standby for every task")
        stop(up)
        up.wait(timeout=120)
    assert not wait_gone(cli.home, 30)
    assert not [p for p in ready.values() if alive(p)]


def test_down_leaves_no_standby(cli, tmp_path):
    stop_and_see_none_left(cli, tmp_path, lambda _up: cli("down", timeout=120))
    assert status_json(cli)["state"] == "stopped"


def test_ctrl_c_leaves_no_standby(cli, tmp_path):
    stop_and_see_none_left(cli, tmp_path, lambda up: os.kill(up.pid, signal.SIGINT))


def test_a_lost_launcher_leaves_no_standby(cli, tmp_path):
    stop_and_see_none_left(cli, tmp_path, lambda up: os.kill(up.pid, signal.SIGKILL))


def test_the_built_in_runner_resumes_at_its_checkpoint_from_a_standby_still_importing(cli, tmp_path):
    """A crash soon after the standbys started: they may still import when the restart begins on them. The
    restarted attempt resumes at the saved step and trains to the end."""
    (tmp_path / "hooks.py").write_text(HOOKS)
    spec = write_spec(tmp_path, 'entrypoint = "hooks:task"\nepochs = 3\ncheckpoint_every_steps = 5',
                      launch="max_restarts = 1", extra=f'workdir = "{tmp_path}"\n',
                      env='TF_CPP_MIN_LOG_LEVEL = "2", SLOW = "0.15"')

    def early():  # mid-run (66 steps of 0.15 s or more), each task with a standby, ready or not
        st = latest_state(cli)
        if st and st["state"] == "running" and all(
                10 <= (t.get("progress") or {}).get("global_step", 0) < 50 and t.get("standby") for t in st["tasks"]):
            return st
        return None

    code, out = cli.up_while(spec, early, lambda _up, st: os.kill(st["tasks"][1]["pid"], signal.SIGKILL),
                             "mid-run, a standby for each task", timeout=300)
    assert code == 0, out
    st = latest_state(cli)
    assert st["restarts"] == 1 and all(t["warm"] for t in st["tasks"]), st["tasks"]
    for t in st["tasks"]:
        p = t["progress"]
        assert p["global_step"] == 3 * STEPS and 5 <= p["first_global_step"] < 3 * STEPS, p  # resumed, not from 0
    assert "resuming at epoch" in out, out
