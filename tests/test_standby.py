"""Fork servers and standbys, for real: each task's host imports Python's and TensorFlow's start once, in its
task's fork server, and forks every attempt from it; a standby holds the server for the next attempt, so a
restart at any moment starts warm. The user's code runs once per attempt, as `python` runs it. A killed
server is replaced and fails nothing; `down`, Ctrl-C and a lost launcher leave none; `standby = false`, or a
run that cannot restart, starts cold."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import REPO, alive, latest_state, status_json, wait_for, wait_gone, write_spec
from test_preempt import HOOKS, assert_equal_weights, run_dir

SERVER = "worker.task.forkserver"
EPOCH_STEPS = 1437 // 64  # digits: training examples // global batch (2 workers x 32)


def standbys(cli, attempt: int = 1, tasks: int = 2) -> dict | None:
    """{task: its fork server's pid} once every task has a standby for `attempt` holding a ready server."""
    st = latest_state(cli)
    if not st or st["state"] != "running":
        return None
    found = {t["index"]: t.get("standby") for t in st["tasks"]}
    if len(found) == tasks and all(s and s["ready"] and s["attempt"] == attempt and alive(s["pid"])
                                   for s in found.values()):
        return {i: s["pid"] for i, s in found.items()}
    return None


def restarted_warm(cli, tmp_path, spec) -> tuple[str, Path]:
    """`up SPEC` of one task whose attempt 0 waits for a file `go` in its folder and then fails: `go` is written
    once the standby for attempt 1 holds a ready fork server, so that attempt 1 is forked. The run's output and
    the task's folder; the run succeeded with that one restart, forked."""
    with cli.running("up", spec) as up:
        wait_for(lambda: up.poll() is not None or standbys(cli, tasks=1), 240, "a ready standby")
        folder = tmp_path / latest_state(cli)["tasks"][0]["run_dir"]
        (folder / "go").write_text("")
        out, _ = up.communicate(timeout=300)
    assert up.returncode == 0, out
    st = latest_state(cli)
    assert st["restarts"] == 1 and st["tasks"][0]["warm"], st["tasks"]  # attempt 1 forked from its fork server
    return out, folder


def servers(home) -> list[psutil.Process]:
    """The fork servers (and what they forked) of the runs under `home`."""
    from conftest import run_processes

    return [p for p in run_processes(home) if SERVER in " ".join(p.cmdline())]


def test_a_crash_early_restarts_warm_at_the_saved_step_with_equal_weights(cli, tmp_path):
    """The built-in runner (TensorFlow), killed early in its first epoch: both tasks restart forked from their
    servers (no import paid), resume at the step they saved and end with equal weights."""
    (tmp_path / "hooks.py").write_text(HOOKS)
    weights = tmp_path / "weights"
    weights.mkdir()
    # HOOKS slows the first attempt's steps from step STEPS on: here every one of them
    spec = write_spec(tmp_path, 'entrypoint = "hooks:task"\nepochs = 2\ncheckpoint_every_steps = 5\n'
                      f'args = ["--save-weights", "{weights}/w-{{task}}.npz"]',
                      launch="max_restarts = 1", extra=f'workdir = "{tmp_path}"\n',
                      env='TF_CPP_MIN_LOG_LEVEL = "2", SLOW = "0.15", STEPS = "0"')

    def early():  # in the first epoch (22 steps of 0.15 s or more), each task with its standby
        st = latest_state(cli)
        if st and st["state"] == "running" and all(
                6 <= (t.get("progress") or {}).get("global_step", 0) < 18 and t.get("standby") for t in st["tasks"]):
            return st
        return None

    code, out = cli.up_while(spec, early, lambda _up, st: os.kill(st["tasks"][1]["pid"], signal.SIGKILL),
                             "early in the first epoch, a standby for each task", timeout=300)
    assert code == 0, out
    assert "(2 task(s) from standbys)" in out and "this attempt starts cold" not in out, out  # what it set, it had
    st = latest_state(cli)
    assert st["restarts"] == 1 and all(t["warm"] for t in st["tasks"]), st["tasks"]
    for t in st["tasks"]:
        p = t["progress"]
        assert p["global_step"] == 2 * EPOCH_STEPS and p["first_global_step"] in (5, 10, 15), p  # resumed at a save
    assert_equal_weights(tmp_path)
    assert not wait_gone(cli.home, 10)


LATE = """
import os, sys, time
from dataclasses import replace
from worker.examples.digits import task as digits


def task():
    folder = os.environ["MGPU_RUN_DIR"]
    with open(os.path.join(folder, "sklearn-at-start-" + os.environ["MGPU_ATTEMPT"]), "w") as f:
        f.write(str("sklearn" in sys.modules))  # digits imports it in its task(), late, as a data loader does
    import tf_keras

    class Hold(tf_keras.callbacks.Callback):  # attempt 0 stops at its third step until the test kills it
        def on_train_batch_end(self, batch, logs=None):
            while os.environ["MGPU_ATTEMPT"] == "0" and batch >= 2:
                time.sleep(0.1)

    return replace(digits(), callbacks=lambda: [Hold()])
"""


def maps(pid: int, needle: str) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_what_an_attempt_imports_late_its_server_imports_while_it_trains(cli, tmp_path):
    """The modules the attempt imported late (scikit-learn, by digits' task()) are imported by its task's fork
    server while the attempt still trains, not when the next standby connects (that comes with a restart, whose
    attempt would train beside those imports without having them): the restarted attempt starts with them."""
    (tmp_path / "late.py").write_text(LATE)
    spec = write_spec(tmp_path, 'entrypoint = "late:task"\nepochs = 1', n=1, launch="max_restarts = 1",
                      extra=f'workdir = "{tmp_path}"\n')
    with cli.running("up", spec) as up:
        held = wait_for(lambda: up.poll() is not None or standbys(cli, tasks=1), 240, "a ready standby")
        assert held is not True, up.communicate()[0]
        wait_for(lambda: maps(held[0], "/sklearn/"), 120, "scikit-learn in the fork server, attempt 0 training")
        st = latest_state(cli)
        assert st["attempt"] == 0 and alive(st["tasks"][0]["pid"]), st
        os.kill(st["tasks"][0]["pid"], signal.SIGKILL)
        out, _ = up.communicate(timeout=300)
    assert up.returncode == 0, out
    st = latest_state(cli)
    assert st["restarts"] == 1 and st["tasks"][0]["warm"], st["tasks"]
    folder = tmp_path / st["tasks"][0]["run_dir"]
    assert [(folder / f"sklearn-at-start-{i}").read_text() for i in (0, 1)] == ["False", "True"]
    assert not wait_gone(cli.home, 10)


PROBE = """
import os, sys, time
me = sys.modules[__name__]
folder = os.environ["MGPU_RUN_DIR"]
me.seen = os.sched_getscheduler(0)
open(os.path.join(folder, "importing"), "w").close()
deadline = time.time() + float(os.environ["HOLD_S"])  # held at the idle priority until a core heard its end
while os.sched_getscheduler(0) == os.SCHED_IDLE and not os.path.exists(os.path.join(folder, "heard")) \\
        and time.time() < deadline:
    time.sleep(0.01)
me.left = os.sched_getscheduler(0)
"""
SERVER_SIDE = """
import os, signal, socket, sys, time
from worker.task import forkserver
start, what, folder = sys.argv[1:4]
if start == "idle":
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(1 if what == "last" else 2)]
cores = []
for i, (ours, theirs) in enumerate(pairs):
    pid = os.fork()
    if pid == 0:  # a core connected to the server; the first acts once the import has begun, the other stays
        for _, t in pairs:
            t.close()
        if i == 0 and what != "stays":
            while not os.path.exists(os.path.join(folder, "importing")):
                time.sleep(0.01)
            if what == "asks":
                ours.sendall(b"a fork")
            else:  # goes: its end waited for, as warm.Server.release waits
                ours.shutdown(socket.SHUT_WR)
                ours.recv(1)
                open(os.path.join(folder, "heard"), "w").close()
                os._exit(0)
        time.sleep(120)
        os._exit(0)
    cores.append(pid)
for ours, _ in pairs:
    ours.close()
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind("\\0mgpu-test-late-%d" % os.getpid())
listener.listen(1)
forkserver._remembered([t for _, t in pairs], listener)
for pid in cores:
    os.kill(pid, signal.SIGKILL)
probe = sys.modules["worker_probe_policy"]
print(probe.seen, probe.left, os.sched_getscheduler(0), os.path.exists(os.path.join(folder, "heard")))
"""


@pytest.mark.parametrize("start, core, hold, seen", [
    ("normal", "stays", "1", "IDLE IDLE OTHER False"),  # imported at the idle priority, the server normal after
    ("idle", "stays", "1", "IDLE IDLE IDLE False"),  # a server started --idle stays there
    ("normal", "goes", "60", "IDLE IDLE OTHER True"),  # a core that goes is let go at once, the import goes on
    ("normal", "asks", "60", "IDLE OTHER OTHER False"),  # a core that asks for a fork hurries the server
    ("normal", "last", "60", "killed"),  # the last core gone: the server ends at once, as after its imports
])
def test_a_servers_late_imports_run_at_the_idle_priority_and_never_keep_a_core_waiting(tmp_path, start, core,
                                                                                        hold, seen):
    (tmp_path / "worker_probe_policy.py").write_text(PROBE)
    (tmp_path / "modules.txt").write_text("worker_probe_policy\n")
    environ = {**os.environ, "MGPU_RUN_DIR": str(tmp_path), "PYTHONPATH": f"{tmp_path}:{REPO}", "HOLD_S": hold}
    r = subprocess.run([sys.executable, "-c", SERVER_SIDE, start, core, str(tmp_path)], env=environ,
                       capture_output=True, text=True, timeout=120)
    if seen == "killed":
        assert r.returncode == -signal.SIGKILL and (tmp_path / "heard").exists(), r.stdout + r.stderr
        return
    names = {os.SCHED_IDLE: "IDLE", os.SCHED_OTHER: "OTHER"}
    assert [names.get(int(v), v) if v.isdigit() else v for v in r.stdout.split()] == seen.split(), r.stdout + r.stderr


SCRIPT = """
import json, logging, os, sys, time
d = os.environ["MGPU_RUN_DIR"]
logging.basicConfig(filename=os.path.join(d, "train.log"), filemode="w", level=logging.INFO, format="%(message)s")
logging.info("attempt %s began", os.environ["MGPU_ATTEMPT"])
here = os.path.dirname(__file__)
os.chdir("/")
print("script", __name__, __file__, sys.argv, sys.path[0], open(os.path.join(here, "beside.txt")).read().strip(),
      os.environ["MGPU_ATTEMPT"], flush=True)
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
    (tmp_path / "beside.txt").write_text("beside\n")
    return write_spec(tmp_path, f'command = ["{sys.executable}", "train.py", "--lr", "0.1"]', launch=launch,
                      extra=f'workdir = "{tmp_path}"\n', each=each, env=env)


def test_a_users_script_runs_forked_as_python_runs_it_and_a_killed_server_is_replaced(cli, tmp_path):
    """A user's `python train.py`: its module-level code runs once per attempt (its log, opened with
    filemode="w", is not truncated while the attempt runs), with `__file__`, sys.argv and sys.path[0] as
    `python train.py` gives them (it changes folder and reads a file beside itself), on its task's cores. A
    killed fork server is started again and fails nothing; the restart then forks from the new one."""
    spec = script_spec(tmp_path, each="cpus = [{i}]\n")
    with cli.running("up", spec) as up:
        first = wait_for(lambda: standbys(cli), 240, "a ready standby for every task")
        st = latest_state(cli)
        log0 = run_dir(tmp_path, st, 1) / "train.log"
        assert log0.read_text() == "attempt 0 began\n"  # the server imported nothing of the user's
        shown = cli("status", timeout=120).stdout
        assert "standbys for attempt 1: task 0 ready (" in shown and "MB in all" in shown, shown
        memory = [t["standby"]["memory"] for t in st["tasks"]]
        assert all(isinstance(m, int) and 0 < m < 400 * 2**20 for m in memory), memory
        os.kill(first[1], signal.SIGKILL)  # task 1's server: its trainer goes on, a new server is started
        second = wait_for(lambda: (s := standbys(cli)) and s[1] != first[1] and s, 240, "task 1's new server")
        assert second[0] == first[0]
        st = latest_state(cli)
        assert st["attempt"] == 0 and st["restarts"] == 0 and alive(st["tasks"][1]["pid"]), st
        os.kill(st["tasks"][1]["pid"], signal.SIGKILL)
        out, _ = up.communicate(timeout=300)
    assert up.returncode == 0, out
    st = latest_state(cli)
    assert st["restarts"] == 1 and all(t["warm"] for t in st["tasks"]), st["tasks"]
    assert not {t["pid"] for t in st["tasks"]} & {*first.values(), *second.values()}  # forked, not a server
    log = (run_dir(tmp_path, st, 1) / "worker.log").read_text()
    cold = f"script __main__ {tmp_path}/train.py ['train.py', '--lr', '0.1'] {tmp_path} beside"
    assert f"{cold} 0" in log and f"{cold} 1" in log, log[-2000:]  # warm is what cold is
    assert log.count("cores of every thread [1]") == 2, log[-2000:]
    assert (run_dir(tmp_path, st, 1) / "train.log").read_text() == "attempt 1 began\n"
    assert not wait_gone(cli.home, 10)


def test_a_fork_server_that_keeps_dying_is_told_and_the_run_starts_cold(cli, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(  # every fork server of this run dies at its start, saying why
        'import os\nif os.environ.get("MGPU_ATTEMPT") == "fork-server":\n'
        '    print("no fork server on this host", flush=True)\n    os._exit(3)\n')
    spec = script_spec(tmp_path, env=f'PYTHONPATH = "{site}"')
    told = ("its fork server ended with code 3 (no fork server on this host), 3 times in all: none is started "
            "again, so attempt 1 starts cold")

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
    assert st["restarts"] == 1 and not any(t["warm"] for t in st["tasks"]), st["tasks"]
    log = (run_dir(tmp_path, st, 1) / "worker.log").read_text()
    assert log.count(f"script __main__ {tmp_path}/train.py") == 2, log[-2000:]  # both attempts ran, cold
    assert not wait_gone(cli.home, 5)


def test_standby_false_or_a_run_that_cannot_restart_starts_cold(cli, tmp_path):
    """No fork server and no standby: with `standby = false` a restart starts cold; with no restart possible
    (max_restarts = 0, max_preemptions = 0) the supervisor is not even asked for one."""
    never = script_spec(tmp_path, launch="max_restarts = 0\nmax_preemptions = 0")
    shown = cli("up", never, "--dry-run", timeout=120).stdout
    assert "worker.task.supervised" in shown and "--warm" not in shown, shown
    assert "--warm" in cli("up", script_spec(tmp_path), "--dry-run", timeout=120).stdout
    spec = script_spec(tmp_path, launch="max_restarts = 1\nstandby = false")

    def training():
        st = latest_state(cli)
        ok = st and st["state"] == "running" and all(t.get("progress") for t in st["tasks"])
        return st if ok else None

    def kill(_up, st):
        assert not servers(cli.home), "a fork server with standby = false"
        os.kill(st["tasks"][1]["pid"], signal.SIGKILL)

    code, out = cli.up_while(spec, training, kill, "both tasks started", timeout=300)
    assert code == 0, out
    st = latest_state(cli)
    assert st["restarts"] == 1 and all(not t["warm"] and t["standby"] is None for t in st["tasks"]), st["tasks"]
    assert not (run_dir(tmp_path, st, 0) / "forkserver.log").exists()


def test_a_command_that_no_fork_can_run_says_why_it_restarts_cold(cli, tmp_path):
    """Not Python's form: said by `up` once; Python's, but another interpreter than the task core's (a `python3`
    on the PATH that is not it): said by each task's standby, once."""
    spec = write_spec(tmp_path, 'command = ["/bin/sh", "-c", "sleep 4"]', launch="max_restarts = 1")
    r = cli("up", spec, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("restarts start cold (no standbys): its command (/bin/sh) is not `python SCRIPT.py") == 1
    other = tmp_path / "bin" / "python3"
    other.parent.mkdir()
    other.symlink_to(sys.executable)  # the same Python, elsewhere: a fork of the core's could import other things
    (tmp_path / "train.py").write_text("import time\ntime.sleep(6)\n")
    spec = write_spec(tmp_path, f'command = ["{other}", "train.py"]', launch="max_restarts = 1", name="other.toml")
    r = cli("up", spec, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    told = [line for line in r.stdout.splitlines() if f"no standby: its command's Python ({other}) is not" in line]
    assert len(told) == 2 and all("a restart starts it cold" in line for line in told), r.stdout  # once per task
    assert not wait_gone(cli.home, 30)


def stop_and_see_none_left(cli, tmp_path, stop) -> None:
    spec = script_spec(tmp_path)
    with cli.running("up", spec, start_new_session=True) as up:
        wait_for(lambda: standbys(cli), 240, "a ready standby for every task")
        held = servers(cli.home)  # each task's server (a pid with its create time; a script's first attempt is cold)
        assert len(held) >= 2, held
        stop(up)
        up.wait(timeout=120)
    assert not wait_gone(cli.home, 30)
    _gone, left = psutil.wait_procs(held, timeout=30)  # an exiting process no longer shows its environment
    assert not [p for p in left if alive(p.pid)], left


def test_down_leaves_no_fork_server(cli, tmp_path):
    stop_and_see_none_left(cli, tmp_path, lambda _up: cli("down", timeout=120))
    assert status_json(cli)["state"] == "stopped"


def test_ctrl_c_leaves_no_fork_server(cli, tmp_path):
    stop_and_see_none_left(cli, tmp_path, lambda up: os.kill(up.pid, signal.SIGINT))


def test_a_lost_launcher_leaves_no_fork_server(cli, tmp_path):
    stop_and_see_none_left(cli, tmp_path, lambda up: os.kill(up.pid, signal.SIGKILL))


def test_a_task_that_fails_while_its_servers_import_stops_the_run_at_once(cli, tmp_path):
    """A script that fails at its start, while its task's fork server still imports TensorFlow at the idle
    priority (an import holds the interpreter for seconds): its core lets go of the server at once, so the
    failure is told, the run recorded and every server gone, without waiting for any import."""
    (tmp_path / "fail.py").write_text("import os, sys, time\nopen(os.environ['MGPU_RUN_DIR'] + '/failed-at', 'w')"
                                      ".write(repr(time.time()))\nsys.exit(3)\n")
    spec = write_spec(tmp_path, f'command = ["{sys.executable}", "fail.py"]', launch="max_preemptions = 1",
                      extra=f'workdir = "{tmp_path}"\n')
    r = cli("up", spec, timeout=120)
    assert r.returncode == 1 and "exited with code 3" in r.stdout + r.stderr, r.stdout + r.stderr
    st = latest_state(cli)
    marks = [run_dir(tmp_path, st, i) / "failed-at" for i in (0, 1)]  # the later one may be stopped before it writes
    failed_at = min(float(m.read_text()) for m in marks if m.exists())
    assert (run_dir(tmp_path, st, 0) / "forkserver.log").exists()  # its server was importing
    assert st["ended_at"] - failed_at < 4.0, st["ended_at"] - failed_at  # a server imports TensorFlow for 5-15 s here
    assert not wait_gone(cli.home, 5)
