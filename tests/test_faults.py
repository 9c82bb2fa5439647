"""The launcher's promises under faults: real processes, real signals, real pipes (no mocks)."""

import contextlib
import functools
import json
import os
import select
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import (DIGITS, Cli, alive, command_lines_with, latest_state, launcher_traceback, reap, run_processes,
                      wait_for, wait_gone, write_spec)

SLEEP = 'command = ["python3", "-c", "import time; print(\'up\', flush=True); time.sleep(600)"]'


def script(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return f'command = ["python3", "{tmp_path / name}"]'


def state_of(cli, run_id: str) -> dict:
    return json.loads((cli.home / "runs" / run_id / "state.json").read_text())



def slow_python(tmp_path: Path, seconds: float) -> str:
    """An interpreter that takes `seconds` to start: a preflight that takes that long."""
    path = tmp_path / "slowpy"
    path.write_text(f"#!/bin/sh\nsleep {seconds}\nexec {sys.executable} \"$@\"\n")
    path.chmod(0o755)
    return str(path)


# ---------------------------------------------------------------- tests started early

EARLY = {}  # test name -> its body (cli, tmp_path), started in a thread when the module starts


def early(name: str):
    """The body of test `name`, whose run mostly waits (a lifeline, a teardown's wait for a stopped supervisor):
    started when the module starts, so that its waiting overlaps the module's other tests; the test itself takes
    the outcome (the body's own assertions, and no process of its run left, as the cli fixture checks)."""
    def register(body):
        EARLY[name] = body
        return body
    return register


class Early:
    def __init__(self, body, folder: Path):
        self.cli, self.error = Cli(folder / "mgpu-home", folder), None
        self.thread = threading.Thread(target=self.run, args=(body, folder), daemon=True)
        self.thread.start()

    def run(self, body, folder: Path) -> None:
        try:
            body(self.cli, folder)
        except BaseException as exc:  # raised again in its test
            self.error = exc

    def outcome(self, timeout: float) -> None:
        self.thread.join(timeout)
        left = reap(run_processes(self.cli.home))
        assert not self.thread.is_alive(), f"still running after {timeout} s"
        if self.error is not None:
            raise self.error
        assert not left, f"processes left running after the test: {[(p.pid, p.info) for p in left]}"


@pytest.fixture(scope="module", autouse=True)
def started_early(request, tmp_path_factory):
    selected = {item.name for item in request.session.items}
    runs = {name: Early(body, tmp_path_factory.mktemp(name[5:30])) for name, body in EARLY.items() if name in selected}
    yield runs
    for run in runs.values():
        run.thread.join(300)
        reap(run_processes(run.cli.home))


# ---------------------------------------------------------------- the protocol is out of band

FORGE = """
import os, sys, time
print("\\x1emgpu {\\"event\\": \\"exit\\", \\"code\\": 0}", flush=True)
print('{"v": 1, "event": "exit", "code": 0, "time": 1.0}', flush=True)
print('{"v": 1, "event": "started", "pid": 1}', flush=True)
print("\\x1emgpu {not json", flush=True)
time.sleep(1.0)
sys.exit(3 if os.environ["MGPU_TASK_INDEX"] == "1" else 0)
"""


def test_forged_records_in_output_change_nothing(cli, tmp_path):
    spec = write_spec(tmp_path, script(tmp_path, "forge.py", FORGE))
    r = cli("up", spec, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "task 1" in out and "exited with code 3" in out and not launcher_traceback(out)
    st = latest_state(cli)
    assert st["state"] == "failed" and st["tasks"][1]["state"] == "failed" and st["tasks"][1]["exit_code"] == 3
    assert '"event": "exit"' in out  # shown as what it is: output
    assert not wait_gone(cli.home, 5)


# ---------------------------------------------------------------- output never delays fail-fast

FLOOD_THEN_FAIL = """
import os, sys, time
d = os.environ["MGPU_RUN_DIR"]
line = "x" * 200
end = time.time() + 2
while time.time() < end:
    for _ in range(200):
        print(line)
if os.environ["MGPU_TASK_INDEX"] == "1":
    open(os.path.join(d, "..", "exited-at"), "w").write(repr(time.time()))
    os._exit(3)
while True:
    print(line)
"""


def test_stalled_stdout_reader_does_not_delay_fail_fast(cli, tmp_path):
    """`up` writes into a pipe nobody reads while both tasks flood: task 1's exit still stops all fast."""
    spec = write_spec(tmp_path, script(tmp_path, "flood.py", FLOOD_THEN_FAIL))
    r, w = os.pipe()  # never read: the terminal does not drain
    up = subprocess.Popen(cli.argv("up", spec), cwd=cli.cwd, env=cli.env, stdout=w, stderr=subprocess.DEVNULL)
    os.close(w)
    try:
        st = wait_for(lambda: (lambda s: s if s and s["state"] == "failed" else None)(latest_state(cli)), 60,
                      "the run to fail")
        marker = next((cli.home / "runs" / st["run_id"]).rglob("exited-at"))
        took = st["ended_at"] - float(marker.read_text())
        assert took < 3.0, f"fail-fast took {took:.2f} s behind a stalled terminal"
        print(f"\nfail-fast behind a stalled terminal, both tasks flooding: {took:.2f} s from task 1's exit")
        assert not wait_gone(cli.home, 10)
        assert up.wait(30) == 1
    finally:
        if up.poll() is None:
            up.kill()
        os.close(r)


HUGE = """
import os, sys
sys.stdout.write("y" * (20 * 2**20))  # one 20 MB line, no newline
sys.stdout.flush()
for i in range(300000):
    print("flood line", i)
sys.exit(0)
"""


def test_flood_and_a_20mb_line_keep_the_launcher_small(cli, tmp_path):
    spec = write_spec(tmp_path, script(tmp_path, "huge.py", HUGE))
    up = subprocess.Popen(cli.argv("up", spec), cwd=cli.cwd, env=cli.env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
    peak, tail = 0, b""
    proc = psutil.Process(up.pid)
    os.set_blocking(up.stdout.fileno(), False)
    while up.poll() is None:
        try:
            peak = max(peak, proc.memory_info().rss)
        except psutil.Error:
            break
        try:  # a slow reader: a little every tick
            chunk = os.read(up.stdout.fileno(), 65536)
            tail = (tail + chunk)[-5000:] if chunk else tail
        except BlockingIOError:
            pass
        time.sleep(0.05)
    assert up.wait(120) == 0, tail
    assert peak < 200 * 2**20, f"launcher RSS peaked at {peak / 2**20:.0f} MB"
    print(f"\nlauncher RSS peak with a 20 MB line and a 300k-line flood per task: {peak / 2**20:.0f} MB")
    st = latest_state(cli)
    log = Path(st["tasks"][0]["run_dir"]) / "worker.log"
    assert log.stat().st_size > 20 * 2**20  # the log keeps everything
    assert st["state"] == "succeeded"


def test_closed_stdout_keeps_supervising_and_records_the_run(cli, tmp_path):
    spec = write_spec(tmp_path, script(tmp_path, "talk.py", "import time\nfor i in range(30):\n    print(i, flush=True)\n"
                                                        "    time.sleep(0.05)\n"))
    up = subprocess.Popen(cli.argv("up", spec), cwd=cli.cwd, env=cli.env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
    up.stdout.readline()
    up.stdout.close()  # `up | head -1`
    assert up.wait(120) == 0, up.stderr.read()
    assert latest_state(cli)["state"] == "succeeded"
    assert b"Traceback" not in up.stderr.read()


# ---------------------------------------------------------------- one owner of run state

def test_run_is_recorded_before_preflight_and_down_stops_the_right_run(cli, tmp_path):
    first = write_spec(tmp_path, SLEEP, n=1, name="a.toml")
    r = cli("up", "--detach", first, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    run_a = latest_state(cli)["run_id"]
    second = write_spec(tmp_path, SLEEP, n=1, name="b.toml", extra=f'python = "{slow_python(tmp_path, 30)}"\n')
    up = cli.popen("up", second)
    try:
        st = wait_for(lambda: (lambda s: s if s and s["run_id"] != run_a else None)(latest_state(cli)), 30,
                      "the second run to be recorded")
        assert st["state"] == "preflight"
        snap = json.loads(cli("status", "--json", timeout=60).stdout)
        assert snap["run_id"] == st["run_id"] and snap["state"] == "preflight"
        d = cli("down", timeout=120)  # the latest run: the one in preflight, not run A
        assert d.returncode == 0, d.stdout + d.stderr
        assert up.wait(30) == 130
        assert state_of(cli, st["run_id"])["state"] == "stopped"
        assert state_of(cli, run_a)["state"] == "running"
    finally:
        if up.poll() is None:
            up.kill()
        cli("down", run_a, timeout=120)
    assert state_of(cli, run_a)["state"] == "stopped"
    assert not wait_gone(cli.home, 10)
    assert not command_lines_with("slowpy")


def test_run_ids_sort_in_start_order_within_one_second():
    # `down`/`status` without a run id act on the last id: a run started 0.1 s after another must sort after it
    from launcher.run.record import RUN_ID, new_run_id

    ids = []
    for _ in range(40):
        ids.append(new_run_id())
        time.sleep(0.003)
    assert all(RUN_ID.match(i) for i in ids) and ids == sorted(ids) and len(set(ids)) == len(ids)


@pytest.mark.parametrize("content", ["{not json", '{"version": 1, "run_id": "x"}', ""])
def test_corrupt_or_old_state_is_exit_2_and_other_runs_still_work(cli, tmp_path, content):
    spec = write_spec(tmp_path, 'command = ["python3", "-c", "pass"]', n=1)
    assert cli("up", spec, timeout=120).returncode == 0
    good = latest_state(cli)["run_id"]
    bad = "20991231-235959-dead"
    (cli.home / "runs" / bad).mkdir()
    (cli.home / "runs" / bad / "state.json").write_text(content)
    for args in (["status"], ["status", bad], ["logs", bad], ["down", bad]):
        r = cli(*args, timeout=60)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert bad in r.stderr and "Traceback" not in r.stderr + r.stdout, r.stderr
    ok = cli("status", "--json", good, timeout=60)
    assert ok.returncode == 0 and json.loads(ok.stdout)["state"] == "succeeded"


def test_two_concurrent_up_of_one_spec_one_runs_one_is_refused(cli, tmp_path):
    spec = write_spec(tmp_path, SLEEP)
    first = cli.popen("up", spec)
    try:
        wait_for(lambda: (lambda s: s if s and s["state"] == "running" else None)(latest_state(cli)), 60, "running")
        run_a = latest_state(cli)["run_id"]
        r = cli("up", spec, timeout=120)
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"held by run {run_a}" in r.stderr and "nothing was started" in r.stderr
        assert first.poll() is None and state_of(cli, run_a)["state"] == "running"
    finally:
        first.send_signal(signal.SIGINT)
        assert first.wait(60) == 130


def test_run_files_are_private(cli, tmp_path):
    spec = write_spec(tmp_path, 'command = ["python3", "-c", "pass"]', n=1, env='API_TOKEN = "hunter2"')
    assert cli("up", spec, timeout=120).returncode == 0
    st = latest_state(cli)
    folder = cli.home / "runs" / st["run_id"]
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for name in ("spec.toml", "state.json", "launcher.log"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600, name
    task = Path(st["tasks"][0]["run_dir"])
    assert stat.S_IMODE(task.stat().st_mode) == 0o700
    assert stat.S_IMODE(task.parent.stat().st_mode) == 0o700
    for name in ("worker.log", "task.json", "exit_code"):
        assert stat.S_IMODE((task / name).stat().st_mode) == 0o600, name


def test_env_is_not_on_any_command_line(cli, tmp_path):
    spec = write_spec(tmp_path, SLEEP, n=1, env='API_TOKEN = "hunter2"')
    seen = []

    def look(up, _st):
        seen.extend(command_lines_with("hunter2", "TF_CONFIG"))
        up.send_signal(signal.SIGINT)

    code, out = cli.up_while(spec, lambda: (lambda s: s if s and s["state"] == "running" else None)(latest_state(cli)),
                             look, "running")
    assert code == 130 and not seen, seen


# ---------------------------------------------------------------- nothing left behind

SETSID = """
import os, subprocess, sys, time
child = subprocess.Popen(["sleep", "600"], start_new_session=True)  # leaves the task's session
open(os.path.join(os.environ["MGPU_RUN_DIR"], "child.pid"), "w").write(str(child.pid))
print("child", child.pid, flush=True)
time.sleep(float(sys.argv[1]) if os.environ["MGPU_TASK_INDEX"] == "1" else 600)
sys.exit(3)
"""


def child_pids(st: dict) -> list[int]:
    return [int((Path(t["run_dir"]) / "child.pid").read_text()) for t in st["tasks"]]


def test_setsid_children_are_gone_after_teardown(cli, tmp_path):
    spec = write_spec(tmp_path, script(tmp_path, "setsid.py", SETSID) .replace("]", ', "2"]'))
    r = cli("up", spec, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    pids = child_pids(latest_state(cli))
    time.sleep(0.5)
    assert not [p for p in pids if alive(p)], "a setsid child outlived the teardown"


def test_setsid_children_are_gone_after_down(cli, tmp_path):
    spec = write_spec(tmp_path, script(tmp_path, "setsid.py", SETSID).replace("]", ', "600"]'))
    assert cli("up", "--detach", spec, timeout=120).returncode == 0
    st = wait_for(lambda: (lambda s: s if all((Path(t["run_dir"]) / "child.pid").exists() for t in s["tasks"])
                           else None)(latest_state(cli)), 60, "the children")
    pids = child_pids(st)
    assert all(alive(p) for p in pids)
    assert cli("down", timeout=120).returncode == 0
    time.sleep(0.5)
    assert not [p for p in pids if alive(p)], "a setsid child outlived down"


DAEMONS = """
import os, sys, time
folder, attempt = os.environ["MGPU_RUN_DIR"], os.environ["MGPU_ATTEMPT"]


def daemon(name, clean):  # the classic way: fork, setsid, fork; its parent ends at once, so it is nobody's child
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            with open(os.path.join(folder, f"{name}-{attempt}.pid"), "w") as f:
                f.write(str(os.getpid()))
            if clean:  # an environment that says nothing of the run
                os.execve("/bin/sleep", ["sleep", "600"], {})
            time.sleep(600)  # a data server forked without an exec: its environment is its parent's start-up one
        os._exit(0)
    os.wait()


daemon("server", clean=False)
daemon("clean", clean=True)
while attempt == "0" and not os.path.exists(os.path.join(folder, "go")):  # the test's word: a standby is ready
    time.sleep(0.1)
sys.exit(1 if attempt == "0" else 0)
"""


def test_daemons_of_a_cold_and_a_forked_attempt_are_gone_when_the_run_ends(cli, tmp_path):
    """Issue 54, class 2: each attempt double-forks two daemons, one whose environment is gone (exec'd with an
    empty one) and one forked without an exec (a forked attempt's: its fork server's start-up environment).
    Attempt 0 starts cold and fails, attempt 1 is forked from its standby's server and succeeds: all four daemons
    are gone when `up` returns, each attempt's told in its log."""
    from test_standby import restarted_warm

    (tmp_path / "daemons.py").write_text(DAEMONS)
    spec = write_spec(tmp_path, f'command = {json.dumps([sys.executable, "daemons.py"])}', n=1,
                      launch="max_restarts = 1", extra=f'workdir = "{tmp_path}"\n')
    out, folder = restarted_warm(cli, tmp_path, spec)
    pids = {name: int((folder / name).read_text()) for name in ("server-0.pid", "clean-0.pid", "server-1.pid",
                                                                 "clean-1.pid")}
    time.sleep(0.5)
    assert not {name: pid for name, pid in pids.items() if alive(pid)}, (pids, out)
    log = (folder / "worker.log").read_text()
    assert log.count("process(es) the task left behind") == 2, log


ORPHANS = """
import os, subprocess, time
for _ in range(20):  # each shell ends at once; its sleep, orphaned, is adopted by the task's core and ends
    subprocess.run(["sh", "-c", "sleep 0.2 &"])
time.sleep(1)  # every orphan has ended
open(os.path.join(os.environ["MGPU_RUN_DIR"], "orphaned"), "w").close()
time.sleep(600)
"""


def test_orphans_that_end_while_the_task_runs_leave_no_zombie(cli, tmp_path):
    """The task core adopts its task's orphans (to stop them with it): those that end while the task runs are
    collected, not left as zombies for the run's length."""
    spec = write_spec(tmp_path, script(tmp_path, "orphans.py", ORPHANS).replace("python3", sys.executable), n=1)
    with cli.running("up", spec) as up:
        st = wait_for(lambda: up.poll() is not None or (lambda s: s if s and s["state"] == "running" and (
            tmp_path / s["tasks"][0]["run_dir"] / "orphaned").exists() else None)(latest_state(cli)), 120,
                      "the orphans made")
        assert up.poll() is None, up.communicate()[0]
        core = psutil.Process(st["tasks"][0]["pid"]).parent()

        def zombies() -> list:
            found = []
            for child in core.children():
                with contextlib.suppress(psutil.NoSuchProcess):  # collected between the listing and the look
                    if child.status() == psutil.STATUS_ZOMBIE:
                        found.append(child.pid)
            return found

        try:
            assert wait_for(lambda: not zombies(), 30, "no zombie under the task's core"), zombies()
        finally:
            up.send_signal(signal.SIGINT)
            up.communicate(timeout=120)


def test_a_recycled_pid_is_never_signalled(tmp_path):
    """A task folder naming a live process that is not the one it started (other create time)."""
    from worker.task.probe import stop

    stranger = subprocess.Popen(["sleep", "600"])
    try:
        task = tmp_path / "task-0"
        task.mkdir()
        (task / "task.json").write_text(json.dumps({
            "pid": stranger.pid, "create_time": psutil.Process(stranger.pid).create_time() - 100,
            "supervisor_pid": stranger.pid, "supervisor_create_time": 1.0, "run_id": "r", "index": "0"}))
        stop(str(task), grace=0.5)
        assert stranger.poll() is None, "a process with a reused pid was signalled"
    finally:
        stranger.kill()
        stranger.wait()


# ---------------------------------------------------------------- signals and exit codes

def test_ctrl_c_during_check_is_130_and_leaves_nothing(cli, tmp_path):
    spec = write_spec(tmp_path, SLEEP, n=2, extra=f'python = "{slow_python(tmp_path, 30)}"\n')
    check = cli.popen("check", spec)
    wait_for(lambda: command_lines_with(str(tmp_path / "slowpy")), 30, "check's preflight in the slow interpreter")
    check.send_signal(signal.SIGINT)
    out, _ = check.communicate(timeout=30)
    assert check.returncode == 130, out
    assert "Traceback" not in out, out
    time.sleep(0.5)
    assert not command_lines_with("slowpy")


def test_ctrl_c_during_preflight_is_130_and_recorded(cli, tmp_path):
    spec = write_spec(tmp_path, SLEEP, n=2, extra=f'python = "{slow_python(tmp_path, 30)}"\n')
    up = cli.popen("up", spec)
    wait_for(lambda: (lambda s: s if s and s["state"] == "preflight" else None)(latest_state(cli)), 30, "preflight")
    time.sleep(1.0)
    up.send_signal(signal.SIGINT)
    out, _ = up.communicate(timeout=30)
    assert up.returncode == 130, out
    st = latest_state(cli)
    assert st["state"] == "stopped" and "preflight" in st["failure"]["message"] and st["failure"]["kind"] == "stopped"
    assert not wait_gone(cli.home, 5)


STUBBORN = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as TensorFlow blocked in a collective: only KILL ends it
print("ready", flush=True)
time.sleep(float(sys.argv[1]) if os.environ["MGPU_TASK_INDEX"] == "1" else 600)
sys.exit(3)
"""


def stubborn(tmp_path: Path, task_1_s: float) -> str:
    return script(tmp_path, "stubborn.py", STUBBORN).replace("]", f', "{task_1_s}"]')


def test_the_built_in_runners_peers_of_a_failed_task_are_killed_at_once_a_command_keeps_stop_grace(cli, tmp_path):
    """The built-in runner's TERM is a save with the whole group, which cannot land once a task failed: its
    peers get KILL at once, whatever stop_grace says (TensorFlow's survivor waits in the all-reduce
    for its dead peer). A `command` may clean up on TERM: it keeps stop_grace."""
    spec = write_spec(tmp_path, DIGITS + "\nepochs = 300", launch="stop_grace = 30")
    began = []

    def kill(_up, st):
        began.append(time.monotonic())
        # the survivor, stopped, cannot end by itself (TensorFlow aborts a peer's all-reduce too, and on a loaded
        # machine may do so before the launcher's stop comes): only a KILL ends it, so the stop is told each time
        os.kill(st["tasks"][0]["pid"], signal.SIGSTOP)
        os.kill(st["tasks"][1]["pid"], signal.SIGKILL)

    code, out = cli.up_while(spec, lambda: (st := latest_state(cli)) and st["state"] == "running" and all(
        (t.get("progress") or {}).get("global_step", 0) > 2 for t in st["tasks"]) and st, kill, "both tasks training")
    took = time.monotonic() - began[0]
    assert code == 1 and "SIGKILL" in out, out
    assert "stopping task (a peer failed: the launcher stops the group; KILL at once)" in out, out
    assert took < 20, f"{took:.1f} s: the survivor waited out stop_grace (30 s)"
    assert not wait_gone(cli.home, 5)

    spec = write_spec(tmp_path, stubborn(tmp_path, 1.0), launch="stop_grace = 2", name="command.toml")
    r = cli("up", spec, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "task 1 (localhost:" in out and "exited with code 3" in out, out
    assert "stopping task (the launcher stopped it, or went away; KILL after 2 s)" in out, out
    assert not wait_gone(cli.home, 5)


@pytest.mark.cluster
def test_ctrl_c_during_teardown_finishes_it_and_exits_130(started_early):
    """A teardown that waits: task 0's supervisor does not answer (stopped), so its stop is not confirmed."""
    started_early["test_ctrl_c_during_teardown_finishes_it_and_exits_130"].outcome(300)


@early("test_ctrl_c_during_teardown_finishes_it_and_exits_130")
def ctrl_c_during_teardown(cli, tmp_path):
    spec = write_spec(tmp_path, stubborn(tmp_path, 3.0))
    up = cli.popen("up", spec)
    lines, held = [], None
    try:
        for line in up.stdout:
            lines.append(line)
            if held is None and line.count("ready") and (st := latest_state(cli)) and st["tasks"][0].get("supervisor_pid"):
                held = st["tasks"][0]["supervisor_pid"]
                os.kill(held, signal.SIGSTOP)
            if "stopping 1 task(s)" in line:
                break
        up.send_signal(signal.SIGINT)
        up.send_signal(signal.SIGINT)  # twice: still no half-done teardown
        out, _ = up.communicate(timeout=60)
    finally:
        if held and alive(held):
            os.kill(held, signal.SIGCONT)
    out = "".join(lines) + out
    assert held, out
    assert up.returncode == 130, out
    assert "already stopping" in out and not launcher_traceback(out)
    st = latest_state(cli)
    assert st["state"] in ("failed", "stopped") and all(t["state"] != "running" for t in st["tasks"])
    assert not wait_gone(cli.home, 5)


def test_sighup_stops_every_task_and_records_it(cli, tmp_path):
    spec = write_spec(tmp_path, SLEEP)
    code, out = cli.up_while(spec, lambda: (lambda s: s if s and s["state"] == "running" else None)(latest_state(cli)),
                             lambda up, _st: up.send_signal(signal.SIGHUP), "running")
    assert code == 130, out
    st = latest_state(cli)
    assert st["state"] == "stopped" and "SIGHUP" in st["failure"]["message"] and st["failure"]["kind"] == "stopped"
    assert not wait_gone(cli.home, 5)


@pytest.mark.parametrize("args", [["status", "--task", "abc"], ["up", "--bogus", "x.toml"], ["logs", "--tail", "x"]])
def test_usage_errors_are_exit_2_without_traceback(cli, args):
    r = cli(*args, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and ("Usage" in r.stderr or "No such option" in r.stderr), r.stderr


def test_unwritable_mgpu_home_is_exit_2_naming_it(cli, tmp_path):
    spec = write_spec(tmp_path, SLEEP, n=1)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cli.env["MGPU_HOME"] = str(blocker / "home")
    r = cli("up", spec, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert str(blocker / "home") in r.stderr and "MGPU_HOME" in r.stderr and "Traceback" not in r.stderr


def test_spec_that_is_a_fifo_is_refused_at_once(cli, tmp_path):
    fifo = tmp_path / "cluster.toml"
    os.mkfifo(fifo)
    t0 = time.time()
    r = cli("check", fifo, timeout=30)
    assert r.returncode == 2 and "not a regular file" in r.stderr, r.stderr
    assert time.time() - t0 < 10


# ---------------------------------------------------------------- hangs, heartbeats, restarts

LOCKSTEP = """
import json, os, sys, time
d, i = os.environ["MGPU_RUN_DIR"], os.environ["MGPU_TASK_INDEX"]
peer = os.path.join(d, "..", "task-%d" % (1 - int(i)), "step")
for step in range(1, 100000):
    with open(os.path.join(d, "step"), "w") as f:
        f.write(str(step))
    with open(os.path.join(d, ".p"), "w") as f:
        json.dump({"state": "training", "global_step": step, "time": time.time()}, f)
    os.replace(os.path.join(d, ".p"), os.path.join(d, "progress.json"))
    waited = time.monotonic()
    while True:  # an all-reduce: wait for the peer to reach this step
        try:
            if int(open(peer).read() or 0) >= step:
                break
        except (OSError, ValueError):
            pass
        if ABORT_AFTER_S and time.monotonic() - waited > ABORT_AFTER_S:  # as TensorFlow 2.21 aborts it
            print(ABORT.replace("PEER", str(1 - int(i))), file=sys.stderr, flush=True)
            sys.exit(1)
        time.sleep(0.01)
    time.sleep(0.2)
"""
# What a peer's all-reduce prints when TensorFlow's coordination service aborts it (its own words, from a real
# run of two digits tasks, one SIGSTOPped), before the launcher's heartbeat_timeout would name the hang.
COORDINATION_ABORT = r"""
ABORT = '''E0000 00:00:1795819394.664028   14733 base_collective_executor.cc:252] BaseCollectiveExecutor::StartAbort UNAVAILABLE: Error reported from /job:worker/task:PEER: The following tasks are unhealthy (stopped sending heartbeats):
/job:worker/replica:0/task:PEER
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further.
Traceback (most recent call last):
  File "/usr/lib/python3/site-packages/tf_keras/src/engine/training.py", line 1853, in fit
tensorflow.python.framework.errors_impl.UnavailableError: Graph execution error:

Collective ops is aborted by: Error reported from /job:worker/task:PEER: The following tasks are unhealthy (stopped sending heartbeats):
/job:worker/replica:0/task:PEER'''
"""


ABORTS = {0: "launcher-finds-it", 3: "tensorflow-aborts-the-peer-first"}


@pytest.mark.cluster
@pytest.mark.parametrize("abort_after", list(ABORTS), ids=list(ABORTS.values()))
def test_sigstopped_task_is_the_one_named_not_its_waiting_peer(started_early, abort_after):
    started_early[f"test_sigstopped_task_is_the_one_named_not_its_waiting_peer[{ABORTS[abort_after]}]"].outcome(300)


def sigstopped_task(cli, tmp_path, abort_after):
    # the waiting peer: blocked in the all-reduce, or (as TensorFlow's coordination service does, its heartbeat
    # timeout before the launcher's) aborted 3 s into the wait, exiting 1 with the words that name task 1
    lockstep = f"ABORT_AFTER_S = {abort_after}\n{COORDINATION_ABORT}{LOCKSTEP}"
    spec = write_spec(tmp_path, script(tmp_path, "lockstep.py", lockstep), launch="heartbeat_timeout = 6")

    def training():
        st = latest_state(cli)
        return st if st and st["state"] == "running" and all((t.get("progress") or {}).get("global_step", 0) > 3
                                                            for t in st["tasks"]) else None

    code, out = cli.up_while(spec, training, lambda _up, st: os.kill(st["tasks"][1]["pid"], signal.SIGSTOP),
                             "both tasks stepping")
    assert code == 1, out
    failure = latest_state(cli)["failure"]
    assert failure["task"] == 1 and failure["kind"] == "hung", failure
    failure = failure["message"]
    assert failure.startswith("task 1 ") and "stopped" in failure, failure
    assert "Where its training was" in failure and "lockstep.py" in failure, failure  # its stacks, taken at once
    if abort_after:
        assert "the coordination service aborted the collective of task 0 " in failure, failure
        assert "exited with code 1" in failure and latest_state(cli)["tasks"][0]["exit_code"] == 1, failure
    else:
        assert "heartbeat_timeout" in failure, failure
    assert not wait_gone(cli.home, 5)


for _after, _id in ABORTS.items():
    early(f"test_sigstopped_task_is_the_one_named_not_its_waiting_peer[{_id}]")(
        functools.partial(sigstopped_task, abort_after=_after))


@pytest.mark.cluster
def test_a_silent_supervisor_is_lost_even_before_the_first_step(started_early):
    started_early["test_a_silent_supervisor_is_lost_even_before_the_first_step"].outcome(300)


@early("test_a_silent_supervisor_is_lost_even_before_the_first_step")
def silent_supervisor(cli, tmp_path):
    # no progress ever (so no heartbeat), but the supervisor's beats stop: a host cut off while
    # TensorFlow starts looks like this; its lifeline (heartbeat_timeout within 10 s .. 2 min) ends the wait
    spec = write_spec(tmp_path, SLEEP, launch="heartbeat_timeout = 4")
    stopped = []

    def stop_supervisor(_up, st):
        stopped.append(st["tasks"][1]["supervisor_pid"])
        os.kill(stopped[0], signal.SIGSTOP)

    t0 = time.time()
    code, out = cli.up_while(spec, lambda: (lambda s: s if s and s["state"] == "running" else None)(latest_state(cli)),
                             stop_supervisor, "both tasks running")
    assert code == 1, out
    failure = latest_state(cli)["failure"]
    assert failure["task"] == 1 and failure["kind"] == "lost", failure
    failure = failure["message"]
    assert failure.startswith("task 1 ") and "no sign of life" in failure and "heartbeat_timeout" in failure, failure
    assert "Traceback" not in out, out
    assert not wait_gone(cli.home, 10)
    assert not psutil.pid_exists(stopped[0]) or psutil.Process(stopped[0]).status() == psutil.STATUS_ZOMBIE
    print(f"\nsilent supervisor: up ended {time.time() - t0:.1f} s after both tasks ran")


LATE_START = """
import json, os, time
d = os.environ["MGPU_RUN_DIR"]
time.sleep(5)  # imports and set-up, longer than the heartbeat timeout: no hang
for step in range(1, 4):
    with open(os.path.join(d, ".p"), "w") as f:
        json.dump({"state": "training", "global_step": step, "time": time.time()}, f)
    os.replace(os.path.join(d, ".p"), os.path.join(d, "progress.json"))
    time.sleep(0.5)
"""


def test_heartbeat_counts_only_after_the_first_progress(cli, tmp_path):
    spec = write_spec(tmp_path, script(tmp_path, "late.py", LATE_START), launch="heartbeat_timeout = 2")
    r = cli("up", spec, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


FLAKY = """
import os, sys, time
d = os.environ["MGPU_RUN_DIR"]
marker = os.path.join(d, "..", "failed-once")
if os.environ["MGPU_TASK_INDEX"] == "1" and not os.path.exists(marker):
    open(marker, "w").close()
    print("disk on fire", flush=True)
    sys.exit(3)
time.sleep(1.5)
"""


def test_restart_report_names_the_failure_that_caused_it(cli, tmp_path):
    spec = write_spec(tmp_path, script(tmp_path, "flaky.py", FLAKY), launch="max_restarts = 1")
    r = cli("up", spec, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "attempt 0 failed: task 1" in out and "exited with code 3" in out and "disk on fire" in out
    snap = json.loads(cli("status", "--json", timeout=60).stdout)
    assert snap["state"] == "succeeded" and snap["attempt"] == 1
    first = snap["attempts"][0]
    assert first["outcome"] == "failed" and "exited with code 3" in first["reason"]
    assert "exited with code 3" in (cli.home / "runs" / snap["run_id"] / "launcher.log").read_text()
    assert "exited with code 3" in cli("status", timeout=60).stdout


# ---------------------------------------------------------------- ports

HOLD_PORT = """#!/bin/sh
# the task's interpreter: before the supervisor starts, something else takes the task's port
case "$*" in *worker.task.supervised*)
  port=$(echo "$*" | sed 's/.*--port \\([0-9]*\\).*/\\1/')
  {python} -c "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', $port)); s.listen(); time.sleep(60)" &
  echo $! > {pidfile}
  sleep 1;;
esac
exec {python} "$@"
"""


def test_port_taken_after_preflight_is_one_paragraph_naming_the_holder(cli, tmp_path):
    pidfile = tmp_path / "holder.pid"
    wrapper = tmp_path / "pywrap"
    wrapper.write_text(HOLD_PORT.format(python=sys.executable, pidfile=pidfile))
    wrapper.chmod(0o755)
    spec = write_spec(tmp_path, SLEEP, n=1, extra=f'python = "{wrapper}"\n')
    try:
        r = cli("up", spec, timeout=120)
        holder = int(pidfile.read_text())
        out = r.stdout + r.stderr
        assert r.returncode == 1, out
        assert f"was taken by pid {holder}" in r.stderr and "Traceback" not in out
    finally:
        if pidfile.exists():
            try:
                holder_proc = psutil.Process(int(pidfile.read_text()))
                holder_proc.kill()  # the test's own holder; gone (or a zombie) before the leftover check
                wait_for(lambda: holder_proc.status() == psutil.STATUS_ZOMBIE, 10, "the holder gone")
            except psutil.NoSuchProcess:
                pass


def test_logs_follow_ends_when_the_launcher_dies(cli, tmp_path):
    spec = write_spec(tmp_path, SLEEP, n=1)
    assert cli("up", "--detach", spec, timeout=120).returncode == 0
    st = latest_state(cli)
    follow = cli.popen("logs", "--follow")
    try:
        ready, _, _ = select.select([follow.stdout], [], [], 60)  # following: it has printed the task's line
        assert ready and follow.stdout.readline(), "logs --follow printed nothing in 60 s"
        os.kill(st["agent_pid"], signal.SIGKILL)
        follow.wait(20)
        assert follow.returncode == 0
    finally:
        if follow.poll() is None:
            follow.kill()
    assert not wait_gone(cli.home, 10)
    snap = json.loads(cli("status", "--json", timeout=60).stdout)
    assert snap["state"] == "lost" and snap["tasks"][0]["state"] != "running"
    assert latest_state(cli)["state"] == "lost"  # recorded, not only shown


@pytest.mark.parametrize("sent", [b"", b'{"MGPU_RUN_ID": "half a line'], ids=["nothing", "half-a-line"])
def test_a_supervisor_whose_launcher_goes_before_the_environment_starts_nothing(tmp_path, sent):
    """The launcher died between starting a supervisor and sending the task's environment: the task
    must not run at all (without its TF_CONFIG and run id it would train alone, unfindable)."""
    marker = tmp_path / "ran"
    proc = subprocess.Popen([sys.executable, "-m", "worker.task.supervised", "--run-dir", str(tmp_path / "task-0"),
                             "--env-stdin", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(sent, timeout=60)  # and then stdin ends: the launcher is gone
    assert proc.returncode == 1 and out == b""
    assert b"nothing was started" in err and b"Traceback" not in err
    assert not marker.exists() and not (tmp_path / "task-0" / "worker.log").exists()
