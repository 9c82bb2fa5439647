"""Stacks, hangs and stragglers: pure parts, then real TensorFlow runs on this machine (the report: test_report.py)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import DIGITS, latest_state, wait_for, wait_gone, write_spec
from launcher.diagnose import stacks
from launcher.diagnose.straggler import find
from worker.host.stacks import dump, parse


# --------------------------------------------------------------------------- pure

def test_straggler_named_at_1_25x_the_median_of_the_others():
    assert find({0: 10.0, 1: 10.5, 2: 9.8}) is None  # balanced
    s = find({0: 10.0, 1: 13.0, 2: 10.2, 3: 9.9})
    assert s.task == 1 and s.ratio == pytest.approx(13.0 / 10.0)
    assert find({0: 10.0, 1: 12.4}) is None  # 1.24x: not yet
    assert find({0: 4.0, 1: 5.0}).to_json() == {"task": 1, "ratio": 1.25}
    assert find({0: 10.0, 1: None, 2: "x"}) is None  # one task with figures: no one to compare with
    assert find({}) is None


def test_py_spy_json_parsed_innermost_frame_last():
    text = json.dumps([{"pid": 7, "thread_name": "MainThread", "os_thread_id": 7, "active": True, "frames": [
        {"name": "inner", "short_filename": "a.py", "line": 3}, {"name": "outer", "short_filename": "b.py", "line": 9}]}])
    st = parse(text, 7)
    assert [f.function for f in st.threads[0].frames] == ["outer", "inner"]
    assert st.innermost(1) == ["inner (a.py:3)"]
    assert 'thread 7 "MainThread" (active):' in st.text()
    # py-spy may list a thread twice, once without frames (a process stopped as it read it: seen in the suite)
    twice = json.dumps([{"pid": 7, "thread_name": "MainThread", "os_thread_id": 7, "active": False, "frames": []},
                        *json.loads(text)])
    st = parse(twice, 7)
    assert st.innermost(1) == ["inner (a.py:3)"] and st.text().count('thread 7 "MainThread"') == 1, st.text()


def test_stacks_of_a_live_and_of_a_stopped_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time\ndef waits_here():\n    time.sleep(60)\nwaits_here()"])
    try:
        wait_for(lambda: "waits_here" in str(dump(proc.pid).innermost(1)), 20, "a stack with waits_here")
        os.kill(proc.pid, signal.SIGSTOP)
        st = dump(proc.pid)
        assert st.ok and st.innermost(1) == ["waits_here (<string>:3)"], st.text()
    finally:
        proc.kill()
        proc.wait()
    assert "no process" in dump(proc.pid).error


class _Engine:
    """Answers `call` as a host would, noting the time it was given."""

    def __init__(self):
        self.plan = {i: SimpleNamespace(python="py", run_dir=f"/r/task-{i}") for i in (0, 1)}
        self.calls = []

    def call(self, index, argv, timeout):
        self.calls.append((index, argv, timeout))
        if index == 1:  # a cut-off host: its command does not finish within the time given
            return 124, "", f"did not finish within {timeout:g} s"
        return 0, json.dumps({"pid": 7, "threads": []}) + "\n", ""


def test_stacks_at_a_hang_are_given_seconds_not_the_commands_40():
    """At a hang the peers wait for these stacks: each host gets HANG_TIMEOUT_S, py-spy half of it."""
    engine, said = _Engine(), []
    out = SimpleNamespace(logline=said.append, say=said.append)
    assert stacks.at_hang(engine, [(0, "h0", 7), (1, "h1", 8)], 1, out) == []
    assert stacks.HANG_TIMEOUT_S <= 10 and sorted(c[2] for c in engine.calls) == [stacks.HANG_TIMEOUT_S] * 2
    for _index, argv, timeout in engine.calls:
        assert float(argv[argv.index("--timeout") + 1]) == timeout / 2 and "--out" in argv, argv
    assert "task 1: python -m worker.host.stacks failed on its host: did not finish within" in said[-1], said
    engine.calls.clear()
    stacks.take(engine, [(0, "h0", 7)])  # `mgpu-cluster stacks`: someone waits for them, longer
    assert engine.calls[0][2] == stacks.CALL_TIMEOUT_S


# --------------------------------------------------------------------------- real runs

def spec_pinned(tmp_path: Path, epochs: int, launch: str = "", cpus: str = "[{i}]", interval: float = 0.5,
                training: str = "") -> Path:
    """Task i on core i (`cpus`: the cores of each task, {i} its index); progress every `interval` s."""
    return write_spec(tmp_path, f"{DIGITS}\nepochs = {epochs}\n{training}", launch=launch, each=f"cpus = {cpus}\n",
                      env=f'TF_CPP_MIN_LOG_LEVEL = "2", MGPU_PROGRESS_INTERVAL = "{interval}"')


def training(cli):
    st = latest_state(cli)
    if st and st["state"] == "running" and all((t.get("progress") or {}).get("global_step", 0) > 5 for t in st["tasks"]):
        return st
    return None


def test_stacks_of_a_live_run_then_sigstop_is_hung_with_every_stack(cli, tmp_path):
    """`stacks` shows both tasks in fit; then task 1 frozen: the run fails, task 1 hung, stacks logged first."""
    spec = spec_pinned(tmp_path, 300, launch="heartbeat_timeout = 5")
    seen = {}

    def act(_up, st):
        seen["stacks"] = cli("stacks", timeout=120)
        os.kill(st["tasks"][1]["pid"], signal.SIGSTOP)

    code, out = cli.up_while(spec, lambda: training(cli), act, "both tasks training")
    r = seen["stacks"]
    assert r.returncode == 0, r.stdout + r.stderr
    for i, t in enumerate(latest_state(cli)["tasks"]):
        section = r.stdout.split(f"task {i} (")[1].split("\ntask ")[0]
        assert section.startswith(f"{t['host']}) pid {t['pid']}\n"), r.stdout
        assert "fit (" in section, section  # a frame in Keras' fit
    assert code == 1, out
    run = latest_state(cli)
    failure = run["failure"]
    assert failure["task"] == 1 and failure["kind"] == "hung", failure
    assert "innermost frame last" in failure["message"], failure["message"]
    log = (cli.home / "runs" / run["run_id"] / "launcher.log").read_text()
    assert "stacks at the hang: task 0 (" in log and "stacks at the hang: task 1 (" in log, log
    assert log.count("fit (") >= 2, log
    for t in run["tasks"]:
        assert list(Path(t["run_dir"]).glob("stacks-*.txt")), t["run_dir"]
    assert not wait_gone(cli.home, 10)
    r = cli("stacks", timeout=60)  # the run has ended: nothing live to read
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"run {run['run_id']} has no running task (run state: failed): stacks are read" in r.stderr, r.stderr


def progress_step(task: dict) -> dict:
    """The task's progress.json as its training wrote it last: its global_step and state."""
    try:
        p = json.loads((Path(task["run_dir"]) / "progress.json").read_text())
        return {"global_step": p.get("global_step") or 0, "state": p.get("state")}
    except (OSError, ValueError, AttributeError):
        return {"global_step": 0, "state": None}


BUSY_STEPS = 24


def busy_on_core_1(n: int) -> list[subprocess.Popen]:
    # a shell's loop: busy within a millisecond (a Python's start took longer than the steps left, under load)
    return [subprocess.Popen(["nice", "-n", "-10", "taskset", "-c", "1", "sh", "-c", "while :; do :; done"])
            for _ in range(n)]


def held_back(pid: int, stop: threading.Event) -> None:
    """Process `pid` runs a tenth of the time (SIGSTOP, SIGCONT): slower than its peer whatever else loads the
    machine (a busy loop's share of a core is the kernel's to give: under the full suite's load it gave the
    others as much, and task 1 came out at 1.2x task 0's own work per step)."""
    try:
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            stop.wait(0.045)
            os.kill(pid, signal.SIGCONT)
            stop.wait(0.005)
    except ProcessLookupError:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("busy", [1, 0])
def test_busy_core_makes_its_task_the_straggler_and_a_balanced_run_names_none(cli, tmp_path, busy):
    # No standbys: on these 2 cores each imports TensorFlow for the whole run in its task's idle moments,
    # which slows one task or the other by up to 1.5x (docs/faults.md): a load of ours, not the test's.
    # The core turns busy once both tasks train: TensorFlow's import on a busy core took minutes, and the
    # straggler is named from the last seconds of steps (worker/tensorflow/steptime.py), busy ones here.
    # Balanced: both tasks share core 0, so that load from outside the test (other programs on this machine)
    # slows both alike. Busy: task 0 on core 0, task 1 on core 1 under a busy loop at nice -10 and held back
    # to a tenth of the time (held_back: the loops alone left it 1.2x the other's under the full suite's load),
    # both from as soon as the tasks' own progress files (written every 0.1 s) show both past their first step
    # (the one the step clock leaves out), so that most of the run's 24 steps are busy (a busy step takes ~10x
    # as long), and ends with the steps, before the validation (on a busy core, each took ~10 s here).
    spec = spec_pinned(tmp_path, 1 if busy else 10, launch="standby = false", cpus="[{i}]" if busy else "[0]",
                       interval=0.1 if busy else 0.5, training=f"steps_per_epoch = {BUSY_STEPS}" if busy else "")
    loops: list[subprocess.Popen] = []
    at: list[int] = []

    def stepping():  # read from the tasks' own files, not the record the agent saves every second
        st = latest_state(cli)
        steps = [progress_step(t)["global_step"] for t in st["tasks"]] if st and st["state"] == "running" else [0]
        return min(steps) > (2 if busy else 5) and (st, steps)

    def busy_now(up, found):
        st, steps = found
        loops.extend(busy_on_core_1(busy))
        at.append(max(steps))
        if not busy:
            return
        # the core is busy while they step, and task 1 held back; once both have taken their last step (their
        # figures written), the loops end: the validation and TensorFlow's exit are no steps
        stop = threading.Event()
        holding = threading.Thread(target=held_back, args=(st["tasks"][1]["pid"], stop), daemon=True)
        holding.start()
        try:
            wait_for(lambda: up.poll() is not None or all(
                (p := progress_step(t))["state"] == "done" or p["global_step"] >= BUSY_STEPS for t in st["tasks"]),
                300, "both tasks past their last step")
        finally:
            stop.set()
            holding.join(5)
        for p in loops:
            p.kill()
            p.wait()

    try:
        code, out = cli.up_while(spec, stepping, busy_now, "both tasks training", timeout=300)
    finally:
        for p in loops:
            p.kill()
            p.wait()
    assert code == 0, out
    snap = json.loads(cli("status", "--json", timeout=60).stdout)
    split = [(t["compute_ms"], t["wait_ms"]) for t in snap["tasks"]]
    print("busy loops", busy, "compute/wait ms", split, "straggler", snap["straggler"], "from step", at,
          "of", [t["global_step"] for t in snap["tasks"]])
    assert all(c and c > 0 and w is not None for c, w in split), split
    if busy:
        assert snap["straggler"] and snap["straggler"]["task"] == 1, (split, snap["straggler"])
        assert "task 1 is a straggler" in out, out
        png = tmp_path / "report.png"
        rep = cli("report", "-o", png, timeout=120)
        assert rep.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG", rep.stderr
        history = (cli.home / "runs" / snap["run_id"] / "progress.jsonl").read_text().splitlines()
        assert any("compute_ms" in line for line in history)
    else:
        assert snap["straggler"] is None, split
        assert "straggler" not in out


PARKED = ("import os, time\nif os.environ['MGPU_TASK_INDEX'] == '1':\n    raise SystemExit(0)\n"
          "def parked_here():\n    time.sleep(600)\nparked_here()\n")


def test_stacks_name_a_finished_task_and_an_ended_run_says_so_plainly(cli, tmp_path):
    """Task 1 exits at once, task 0 sleeps: `stacks` exits 0 with task 0's stack and task 1 named as not
    running, 1 for `--task 1`, 2 for a task that does not exist; after `down`, 1 in plain words."""
    spec = write_spec(tmp_path, f"command = {json.dumps([sys.executable, '-c', PARKED])}")
    up = cli("up", "--detach", spec, timeout=120)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        st = wait_for(lambda: (lambda s: s if s and [t["state"] for t in s["tasks"]] == ["running", "succeeded"]
                               else None)(latest_state(cli)), 60, "task 0 running and task 1 done")
        task0 = st["tasks"][0]
        # the interpreter may still be starting when the record says running: until it is in parked_here
        r = wait_for(lambda: (lambda r: r if "parked_here (<string>:" in r.stdout else None)(cli("stacks", timeout=120)),
                     60, "task 0's stack in parked_here")
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.startswith(f"task 0 ({task0['host']}) pid {task0['pid']}\n"), r.stdout
        assert r.stdout.rstrip().endswith(f"task 1 ({st['tasks'][1]['host']}): not running (state succeeded)"), r.stdout
        one = cli("stacks", "--task", "1", timeout=60)
        assert one.returncode == 1, one.stdout + one.stderr
        assert (f"task 1 of run {st['run_id']} is not running (task state: succeeded, run state: running): stacks are "
                "read from live processes;") in one.stderr, one.stderr
        none = cli("stacks", "--task", "99", timeout=60)
        assert none.returncode == 2 and "has no task 99" in none.stderr, none.stderr
    finally:
        down = cli("down", timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    r = cli("stacks", timeout=60)
    assert r.returncode == 1 and not r.stdout, r.stdout + r.stderr
    assert (f"run {st['run_id']} has no running task (run state: stopped): stacks are read from live processes; "
            f"'mgpu-cluster status {st['run_id']}' shows the tasks.") in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
