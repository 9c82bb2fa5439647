"""Many hosts over SSH: `up`, `status`, `logs`, `down` against namespace hosts with real sshds.

Every host is a network namespace with its own address and sshd (deploy/testhosts.py); they
share this machine's file system and process table, so one venv serves all, and psutil sees
every process of every "host". The launcher runs as a subprocess with HOME=<testhosts home>
(its ssh config, key and known_hosts) and its own MGPU_HOME.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import (IN_CI, REPO, Cli, namespace_hosts, alive, command_lines_with, latest_state, need, reap, run_processes, status_json,
                      wait_for, wait_gone)

sys.path.insert(0, str(REPO / "deploy"))
from testhosts import TestHosts  # noqa: E402

from launcher.engines.supervised.sync import sync_files  # noqa: E402
from launcher.engines.supervised.shell import _cd, shell_command  # noqa: E402

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 and not IN_CI,
    reason="needs root to make network namespaces and run sshd (never skipped under CI=true)",
)
PY = sys.executable
N_HOSTS = 8
PORT = 20000

TICK = """
import json, os, sys, time
d = os.environ["MGPU_RUN_DIR"]
t0, step = time.time(), 0
while time.time() - t0 < float(sys.argv[1]):
    step += 1
    with open(os.path.join(d, ".p"), "w") as f:
        json.dump({"state": "training", "global_step": step, "time": time.time()}, f)
    os.replace(os.path.join(d, ".p"), os.path.join(d, "progress.json"))
    print("step", step, flush=True)
    time.sleep(0.3)
"""


# --------------------------------------------------------------------------- no root needed

def test_shell_command_keeps_every_value_a_plain_string(tmp_path):
    marker = tmp_path / "MARKER"
    hostile = ["; touch " + str(marker), f"$(touch {marker})", f"`touch {marker}`", "'", '"', "a\nb", "$HOME", "*"]
    folder = tmp_path / f"d; $(touch {marker}) `x` 'q' \"dq\"\nnl"
    folder.mkdir(parents=True)
    line = shell_command([PY, "-c", "import json, os, sys; print(json.dumps([sys.argv[1:], os.getcwd(), "
                                    "os.environ['V']]))", *hostile],
                         cwd=str(folder), env={"V": hostile[1] + hostile[5]})
    out = subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [hostile, str(folder), hostile[1] + hostile[5]]
    assert not marker.exists()
    assert _cd("~/a b") == "cd ~/'a b'" and _cd("~") == "cd ~" and _cd("/x;y") == "cd '/x;y'"


def test_sync_files_maps_relative_and_absolute_entries(tmp_path):
    base, outside = tmp_path / "proj", tmp_path / "elsewhere"
    (base / "data" / "sub").mkdir(parents=True)
    (base / "data" / "__pycache__").mkdir()
    outside.mkdir()
    for f in ("train.py", "data/a.csv", "data/sub/b.bin", "data/__pycache__/c.pyc"):
        (base / f).write_text(f)
    (outside / "lib.py").write_text("x")
    files, problems = sync_files(["train.py", "data", str(outside / "lib.py"), "missing.txt"], base)
    assert [rel for _src, rel in files] == ["train.py", "data/a.csv", "data/sub/b.bin", "lib.py"]
    assert len(problems) == 1 and "missing.txt" in problems[0]


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def th(tmp_path_factory):
    yield from namespace_hosts(N_HOSTS, tmp_path_factory.mktemp("sshhosts"))


class SSHCli(Cli):
    """The real CLI with the test hosts' HOME (ssh config, key, known_hosts) and a private MGPU_HOME."""

    def __init__(self, home: Path, cwd: Path, th: TestHosts, ssh_home: Path | None = None):
        super().__init__(home, cwd)
        self.env = th.env(self.env)
        if ssh_home is not None:
            self.env["HOME"] = str(ssh_home)


@pytest.fixture
def cli(tmp_path, th):
    c = SSHCli(tmp_path / "mgpu-home", tmp_path, th)
    yield c
    left = reap(wait_gone(tmp_path, 30))  # workdirs, run dirs and MGPU_HOME all live under tmp_path
    assert not left, f"processes of the run left on the hosts: {[(p.pid, p.info['cmdline']) for p in left]}"


def toml(value) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)  # strings, numbers, booleans and arrays read the same in TOML


def write_spec(tmp_path: Path, addresses: list[str], training: dict, launch: dict | None = None,
               defaults: dict | None = None, hosts: list[dict] | None = None, top: dict | None = None,
               folder: Path | None = None) -> Path:
    folder = folder or tmp_path
    workdir = tmp_path / "wd"
    workdir.mkdir(exist_ok=True)
    d = {"python": PY, "gpus": "none", "workdir": str(workdir), "env": {"TF_CPP_MIN_LOG_LEVEL": "2"},
         **(defaults or {})}
    lines = [f"{k} = {toml(v)}" for k, v in (top or {}).items()]
    lines += ["[defaults]", *(f"{k} = {toml(v)}" for k, v in d.items())]
    for i, address in enumerate(addresses):
        host = {"address": address, "port": PORT, **(hosts or [{}] * len(addresses))[i]}
        lines += ["[[hosts]]", *(f"{k} = {toml(v)}" for k, v in host.items())]
    lines += ["[training]", *(f"{k} = {toml(v)}" for k, v in training.items())]
    lines += ["[launch]", *(f"{k} = {toml(v)}" for k, v in {"connect_timeout": 5, **(launch or {})}.items())]
    path = folder / "cluster.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def tick(seconds: float = 600) -> dict:
    return {"command": [PY, "-c", TICK, str(seconds)]}






def task_dir(tmp_path: Path, state: dict, i: int) -> Path:
    return tmp_path / "wd" / ".mgpu" / "runs" / state["run_id"] / f"task-{i}"


def all_progressing(cli, tmp_path):
    st = latest_state(cli)
    if not st or st["state"] != "running":
        return None
    for i in range(len(st["tasks"])):
        try:
            if json.loads((task_dir(tmp_path, st, i) / "progress.json").read_text())["global_step"] < 2:
                return None
        except (OSError, ValueError, KeyError):
            return None
    return st




def nothing_started(tmp_path: Path, cli) -> None:
    """No task folder on any host, no process of a run."""
    assert not list((tmp_path / "wd").glob(".mgpu/runs/*/task-*")), "a task was started"
    assert not [p for p in run_processes(tmp_path) if "worker.task.supervised" in " ".join(p.info["cmdline"] or [])]


# --------------------------------------------------------------------------- acceptance

@needs_root
def test_digits_over_ssh_trains_with_identical_weights(cli, th, tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    spec = write_spec(tmp_path, th.addresses[:2], {"command": [
        PY, "-m", "worker", "--entrypoint", "worker.examples.digits:task", "--epochs", "3",
        "--batch-size-per-replica", "32", "--learning-rate", "0.002", "--save-weights", f"{weights}/w-{{task}}.npz"]},
        launch={"standby": False})  # no fork server importing TensorFlow beside each task: nothing restarts here
    t0 = time.time()
    r = cli("up", spec, timeout=600)
    took = time.time() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert f"task0 {th.addresses[0]} |" in out and f"task1 {th.addresses[1]} |" in out
    assert "connected to 2 host(s)" in out and "every worker reaches every other worker's port" in out
    snap = status_json(cli)
    assert snap["state"] == "succeeded"
    assert [(t["host"], t["port"], t["state"]) for t in snap["tasks"]] == [
        (th.addresses[0], PORT, "succeeded"), (th.addresses[1], PORT, "succeeded")]
    for t in snap["tasks"]:
        assert t["epoch"] == t["epochs"] == 3 and t["metrics"]["val_accuracy"] >= 0.90, t
    import numpy as np

    w0, w1 = np.load(weights / "w-0.npz"), np.load(weights / "w-1.npz")
    assert sorted(w0.files) == sorted(w1.files) and w0.files
    diff = max(float(np.max(np.abs(w0[k] - w1[k]))) for k in w0.files)
    assert diff <= 1e-6, f"workers ended with different weights (max abs diff {diff})"
    logs = cli("logs", "--task", "1", "--tail", "3", timeout=120)
    assert logs.returncode == 0 and len(logs.stdout.strip().splitlines()) == 3, logs.stdout + logs.stderr
    d = cli("down", timeout=120)
    assert d.returncode == 0, d.stdout + d.stderr
    print(f"\ndigits over SSH on 2 hosts: up {took:.1f} s, weights max abs diff {diff:g}")


@needs_root
def test_keras3_on_jax_over_ssh_trains_in_step(cli, th, tmp_path):
    """backend = "jax" on two SSH hosts x 2 CPU devices: the coordinator is host 0's address and port."""
    need("jax")
    weights = tmp_path / "weights"
    spec = write_spec(tmp_path, th.addresses[:2], {
        "backend": "jax", "entrypoint": "worker.examples.digits_keras3:task", "local_replicas": 2,
        "batch_size_per_replica": 16, "learning_rate": 0.001, "epochs": 3,
        "args": ["--save-weights", f"{weights}/w-{{task}}.npz"]},
        launch={"standby": False})  # no fork server importing Keras and JAX beside each task: nothing restarts here
    r = cli("up", spec, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count("DataParallel (jax), 4 replica(s) in sync, global batch 64 (16/replica)") == 2, out
    snap = status_json(cli)
    assert [(t["host"], t["state"]) for t in snap["tasks"]] == [(th.addresses[0], "succeeded"),
                                                               (th.addresses[1], "succeeded")]
    for t in snap["tasks"]:
        assert t["epoch"] == t["epochs"] == 3 and t["metrics"]["val_accuracy"] >= 0.90, t
    import numpy as np

    w0, w1 = np.load(weights / "w-0.npz"), np.load(weights / "w-1.npz")
    assert w0.files and sorted(w0.files) == sorted(w1.files)
    assert all(np.array_equal(w0[k], w1[k]) for k in w0.files), "the hosts ended with different weights"
    assert not wait_gone(tmp_path, 10)


@needs_root
def test_eight_hosts_start_in_parallel_and_answer_status(cli, th, tmp_path):
    spec = write_spec(tmp_path, th.addresses[:8], tick(300), launch={"heartbeat_timeout": 120})
    r = cli("up", "--detach", spec, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        wait_for(lambda: all_progressing(cli, tmp_path), 120, "8 tasks progressing")

        def answered(snap):  # the launcher's record trails the hosts by a second or two
            return snap["state"] == "running" and all(
                t["state"] == "running" and t["pid"] and t["rss"] and (t["global_step"] or 0) > 0 for t in snap["tasks"])

        wait_for(lambda: answered(status_json(cli)), 30, "status --json to show all 8 tasks running")
        t0 = time.time()
        snap = status_json(cli)
        status_s = time.time() - t0
        assert answered(snap), snap
        assert [t["host"] for t in snap["tasks"]] == th.addresses[:8]
        probed = status_json(cli, "--probe")  # asking every host directly gives the same picture
        assert answered(probed), probed
        logs = cli("logs", "--tail", "1", timeout=120)
        assert logs.returncode == 0 and all(f"task{i} " in logs.stdout for i in range(8)), logs.stdout
        phases = latest_state(cli)["phases"]
        spawn_s = phases["all_started"] - phases["spawn_started"]
    finally:
        t0 = time.time()
        d = cli("down", timeout=180)
        down_s = time.time() - t0
    assert d.returncode == 0, d.stdout + d.stderr
    assert not wait_gone(tmp_path, 30)
    assert status_json(cli)["state"] == "stopped"
    print(f"\n8 hosts: spawn {spawn_s:.2f} s, preflight {phases['preflight_s']:.2f} s, "
          f"status --json {status_s:.2f} s, down {down_s:.2f} s")


@needs_root
def test_crashed_host_stops_the_others_and_is_named(cli, th, tmp_path):
    victim = 1
    spec = write_spec(tmp_path, th.addresses[:3], tick(), launch={"heartbeat_timeout": 120})
    try:
        code, out = cli.up_while(spec, lambda: all_progressing(cli, tmp_path), lambda _up, _st: th.crash(victim),
                                 "3 tasks progressing", ready_timeout=120)
    finally:
        th.revive(victim)
    assert code == 1, out
    assert f"task {victim} ({th.addresses[victim]}:{PORT}) was lost" in out, out
    assert "Traceback" not in out, out
    assert not wait_gone(tmp_path, 30), "a process of the run survived on some host"
    snap = status_json(cli)
    assert snap["state"] == "failed" and snap["tasks"][victim]["state"] in ("lost", "failed")


@needs_root
def test_kill_9_of_a_remote_training_process_is_a_killed_failure(cli, th, tmp_path):
    spec = write_spec(tmp_path, th.addresses[:2], tick(), launch={"heartbeat_timeout": 120})
    code, out = cli.up_while(spec, lambda: all_progressing(cli, tmp_path),
                             lambda _up, st: os.kill(st["tasks"][1]["pid"], signal.SIGKILL), "2 tasks progressing",
                             ready_timeout=120)
    assert code == 1 and "Traceback" not in out, out
    failure = status_json(cli)["failure"]
    assert (failure["task"], failure["kind"], failure["signal"]) == (1, "killed", "SIGKILL"), failure
    assert failure["host"] == th.addresses[1] and "SIGKILL" in failure["message"], failure
    assert not wait_gone(tmp_path, 30), "a process of the run survived on some host"


# --------------------------------------------------------------------------- hosts cut off
# Three runs that each cut one host off: the launcher waits stop_grace + 8 s for the exit report the cut host
# never sends, then tries to reach it (connect_timeout), and the cut host's task stops by its lifeline (10 s
# at least). The waits are idle, so the three runs go at once (and nothing else meanwhile), each on two hosts
# of its own (the victim is task 1's host) with its own folder and MGPU_HOME; each test asserts on its run.


class CutRun:
    """One run with a host cut off: its CLI, folder, hosts and what it gave."""

    def __init__(self, th: TestHosts, folder: Path, hosts: tuple[int, int]):
        self.th, self.tmp, self.hosts = th, folder, hosts
        self.cli = SSHCli(folder / "mgpu-home", folder, th)
        self.addresses = [th.addresses[h] for h in hosts]
        self.victim = 1  # the task whose host is cut
        self.cut_pids: list[int] = []

    def spec(self, heartbeat_timeout: float) -> Path:
        return write_spec(self.tmp, self.addresses, tick(),
                          launch={"heartbeat_timeout": heartbeat_timeout, "connect_timeout": 3})

    def progressing(self):
        return all_progressing(self.cli, self.tmp)

    def cut(self, st: dict) -> None:
        self.cut_pids.extend([st["tasks"][self.victim]["pid"], st["tasks"][self.victim]["supervisor_pid"]])
        self.th.cut(self.hosts[self.victim])

    def wait_for_lifeline(self) -> None:
        # the cut host cannot hear the launcher: its supervisor's lifeline stops the task by itself
        wait_for(lambda: not any(alive(p) for p in self.cut_pids), 60, "the cut host's task to stop by itself")


def cut_off_heartbeat(run: CutRun) -> None:
    spec = run.spec(heartbeat_timeout=4)
    t0 = time.time()
    try:
        run.code, run.out = run.cli.up_while(spec, run.progressing, lambda _up, st: run.cut(st),
                                             "2 tasks progressing", ready_timeout=120, timeout=180)
        run.detected = time.time() - t0
        run.wait_for_lifeline()
    finally:
        run.th.restore(run.hosts[run.victim])


def cut_off_ctrl_c(run: CutRun) -> None:
    spec = run.spec(heartbeat_timeout=10)

    def cut_then_interrupt(up, st):
        run.cut(st)
        up.send_signal(signal.SIGINT)

    try:
        run.code, run.out = run.cli.up_while(spec, run.progressing, cut_then_interrupt, "2 tasks progressing",
                                             ready_timeout=120, timeout=180)
        run.wait_for_lifeline()
    finally:
        run.th.restore(run.hosts[run.victim])


def cut_off_down(run: CutRun) -> None:
    spec = run.spec(heartbeat_timeout=10)
    r = run.cli("up", "--detach", spec, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    st = wait_for(run.progressing, 120, "2 tasks progressing")
    try:
        run.cut(st)
        run.down = run.cli("down", timeout=180)
        run.wait_for_lifeline()
    finally:
        run.th.restore(run.hosts[run.victim])


CUT_OFF_RUNS = {"heartbeat": cut_off_heartbeat, "ctrl_c": cut_off_ctrl_c, "down": cut_off_down}
CUT_OFF_HOSTS = {"heartbeat": (2, 3), "ctrl_c": (4, 5), "down": (6, 7)}  # of the module's 8 hosts


@pytest.fixture(scope="module")
def cut_off(th, tmp_path_factory):
    """The three cut-off runs, started together, all ended: {name: Future of its CutRun}; a run's error is
    raised by its own test (Future.result()). Nothing of any run is left afterwards."""
    runs = {name: CutRun(th, tmp_path_factory.mktemp(f"cut-{name}"), CUT_OFF_HOSTS[name]) for name in CUT_OFF_RUNS}

    def go(name):
        CUT_OFF_RUNS[name](runs[name])
        return runs[name]

    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: pool.submit(go, name) for name in runs}
    yield futures
    left = [p for run in runs.values() for p in reap(wait_gone(run.tmp, 30))]
    assert not left, f"processes of the runs left on the hosts: {[(p.pid, p.info['cmdline']) for p in left]}"


@needs_root
def test_cut_off_host_fails_by_heartbeat_and_leaves_nothing(cut_off):
    run = cut_off["heartbeat"].result()
    code, out, victim = run.code, run.out, run.victim
    assert code == 1, out
    assert f"task {victim} ({run.addresses[victim]}:{PORT}) sent no progress" in out, out
    assert "heartbeat_timeout = 4" in out and "Traceback" not in out
    assert not wait_gone(run.tmp, 30)
    print(f"\ncut host: up ended {run.detected:.1f} s after the cut")


@needs_root
def test_ctrl_c_with_a_host_cut_off_says_which_tasks_were_stopped(cut_off):
    """A stop that cannot reach a host says so, on screen and in the record, and names the lifeline."""
    run = cut_off["ctrl_c"].result()
    code, out, victim = run.code, run.out, run.victim
    assert code == 130 and "Traceback" not in out, out
    failure = status_json(run.cli)["failure"]
    assert failure["kind"] == "stopped" and "every task was stopped" not in failure["message"], failure
    assert f"task {victim} ({run.addresses[victim]}:{PORT})" in failure["message"], failure
    assert "task(s) 0 were stopped" in failure["message"] and "lifeline" in failure["message"], failure
    assert "every task was stopped" not in out, out
    assert not wait_gone(run.tmp, 30)


@needs_root
def test_down_with_a_host_cut_off_records_what_it_could_not_reach(cut_off):
    """`down` of a detached run with one host cut off: the screen and the record say which tasks were
    stopped and which could not be reached (they stop by their lifeline), never "every task"."""
    run = cut_off["down"].result()
    down, victim = run.down, run.victim
    out = down.stdout + down.stderr
    assert down.returncode == 1 and "Traceback" not in out and "every task is stopped" not in out, out
    assert f"{run.addresses[victim]}:{PORT}" in out and "could not be reached" in out, out
    snap = status_json(run.cli)
    assert snap["state"] == "stopped" and snap["tasks"][victim]["state"] == "lost", snap
    failure = snap["failure"]
    assert failure["kind"] == "stopped" and "every task was stopped" not in failure["message"], failure
    assert "could not be reached" in failure["message"] and "lifeline" in failure["message"], failure
    assert not wait_gone(run.tmp, 30)


@needs_root
@pytest.mark.parametrize("fault", ["no host at the address", "sshd down", "unknown user"])
def test_unreachable_host_refused_at_preflight(cli, th, tmp_path, fault):
    addresses, hosts = [th.addresses[0], th.addresses[2]], [{}, {}]
    if fault == "no host at the address":
        addresses[1] = f"{th.subnet}.250"
    elif fault == "sshd down":
        hosts[1] = {"ssh_port": 2222}  # nothing listens there
    else:
        hosts[1] = {"user": "nosuchuser"}
    spec = write_spec(tmp_path, addresses, {"command": ["touch", str(tmp_path / "started")]},
                      launch={"connect_timeout": 2}, hosts=hosts)
    r = cli("up", spec, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "nothing was started" in out and "Traceback" not in out
    expect = {"no host at the address": [f"{addresses[1]}: no SSH answer within connect_timeout = 2 s",
                                         f"{addresses[1]}: cannot connect over SSH (No route to host)"],
              "sshd down": [f"{addresses[1]} port 2222: cannot connect over SSH (connection refused)"],
              "unknown user": [f"nosuchuser@{addresses[1]}: SSH authentication failed"]}[fault]
    assert any(e in " ".join(out.split()) for e in expect), out
    assert not (tmp_path / "started").exists()
    nothing_started(tmp_path, cli)


@needs_root
def test_host_problems_refused_at_preflight(cli, th, tmp_path):
    bare = tmp_path / "bare-venv"  # a Python without the worker package
    subprocess.run([PY, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    spec = write_spec(tmp_path, th.addresses[:3], {"command": ["touch", str(tmp_path / "started")]},
                      hosts=[{"python": "/nonexistent/python3"}, {"python": str(bare / "bin" / "python")},
                             {"workdir": str(tmp_path / "missing")}])
    r = cli("up", spec, timeout=120)
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2, out
    assert f"task 0 ({th.addresses[0]}:{PORT}): interpreter '/nonexistent/python3' cannot be run" in out, out
    assert f"task 1 ({th.addresses[1]}:{PORT}): host check failed: the 'worker' package is not importable" in out
    assert f"task 2 ({th.addresses[2]}:{PORT}): workdir '{tmp_path / 'missing'}' does not exist" in out
    assert not (tmp_path / "started").exists() and not (tmp_path / "missing").exists()
    nothing_started(tmp_path, cli)


@needs_root
def test_worker_port_held_refused_at_preflight(cli, th, tmp_path):
    holder = subprocess.Popen(th.netns_argv(1, PY, "-c", f"import socket, time; s = socket.socket(); "
                                            "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
                                            f"s.bind(('', {PORT})); s.listen(); print('ok', flush=True); "
                                            "time.sleep(300)"), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ok"
        spec = write_spec(tmp_path, th.addresses[:2], {"command": ["touch", str(tmp_path / "started")]})
        r = cli("up", spec, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2, out
    assert f"task 1 ({th.addresses[1]}:{PORT}): port {PORT} is in use by pid {holder.pid} (python" in out, out
    assert f"task 0 ({th.addresses[0]}:{PORT}): " not in out  # host 0's own port 20000 is free
    assert not (tmp_path / "started").exists()
    nothing_started(tmp_path, cli)


@needs_root
def test_unreachable_worker_pair_found_by_the_cluster_check(cli, th, tmp_path):
    a, b = th.hosts[0], th.hosts[1]
    subprocess.run(["ip", "-n", a.netns, "route", "add", "blackhole", f"{b.address}/32"], check=True)
    try:
        spec = write_spec(tmp_path, [a.address, b.address], {"command": ["touch", str(tmp_path / "started")]},
                          launch={"connect_timeout": 3})
        r = cli("up", spec, timeout=120)
    finally:
        subprocess.run(["ip", "-n", a.netns, "route", "del", "blackhole", f"{b.address}/32"], check=True)
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2, out
    assert f"task 0 ({a.address}:{PORT}): cannot reach task 1 at {b.address}:{PORT}" in out, out
    assert f"task 1 ({b.address}:{PORT}): cannot reach task 0 at {a.address}:{PORT}" in out, out
    assert not (tmp_path / "started").exists()
    nothing_started(tmp_path, cli)
    # the listeners of the check are gone: nothing listens on the port (SO_REUSEADDR: TIME_WAIT left
    # by TensorFlow in an earlier test does not count, it does not stop TensorFlow either)
    for h in (0, 1):
        probe = subprocess.run(th.netns_argv(h, PY, "-c", "import socket; s = socket.socket(); "
                                             "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
                                             f"s.bind(('', {PORT})); s.listen()"))
        assert probe.returncode == 0


@needs_root
def test_unknown_host_key_refused_then_accepted_and_changed_key_refused(th, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(th.home, home)
    known = home / ".ssh" / "known_hosts"
    config = home / ".ssh" / "config"
    config.write_text(config.read_text().replace(str(th.known_hosts), str(known)))
    target = th.addresses[3]
    lines = th.known_hosts.read_text().splitlines()
    known.write_text("".join(f"{line}\n" for line in lines if not line.startswith(target + " ")))
    cli = SSHCli(tmp_path / "mgpu-home", tmp_path, th, ssh_home=home)
    done = tmp_path / "done"

    spec = write_spec(tmp_path, [target], {"command": ["touch", str(done)]})
    r = cli("up", spec, timeout=120)
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2, out
    assert f"root@{target}: its SSH host key is not in known_hosts ({known})" in out, out
    assert "accept_new_host_keys = true" in out and "ssh-keyscan" in out and not done.exists()

    spec = write_spec(tmp_path, [target], {"command": ["touch", str(done)]}, launch={"accept_new_host_keys": True})
    r = cli("up", spec, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert done.exists()
    recorded = [line for line in known.read_text().splitlines() if line.startswith(target + " ")]
    assert len(recorded) == 1 and recorded[0].split()[2] in th.known_hosts.read_text()

    other_key = next(line for line in lines if line.startswith(th.addresses[4] + " ")).split(" ", 1)[1]
    known.write_text(known.read_text().replace(recorded[0], f"{target} {other_key}"))
    r = cli("up", spec, timeout=120)  # still accept_new_host_keys: a changed key is refused anyway
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2, out
    assert f"root@{target}: its SSH host key has CHANGED" in out and f"ssh-keygen -R {target}" in out, out
    assert not wait_gone(tmp_path, 10)


@needs_root
def test_hostile_values_stay_plain_strings(cli, th, tmp_path):
    marker = Path(f"/tmp/mgpu-injected-{os.getpid()}-{time.monotonic_ns()}")
    inject = [f"; touch {marker}", f"$(touch {marker})", f"`touch {marker}`", f"' ; touch {marker}; '",
              f'" ; touch {marker}; "', f"a\ntouch {marker}\nb", "$HOME", "*"]
    workdir = tmp_path / "wd" / f"x; $(touch {marker}) `touch {marker}` 'q' \"dq\"\nnl"
    workdir.mkdir(parents=True)
    env_value = "".join(inject)
    program = ("import json, os, sys; print('HOSTILE ' + json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd(), "
               "'env': os.environ['HOSTILE'], 'run_dir': os.environ['MGPU_RUN_DIR']}), flush=True)")
    spec = write_spec(tmp_path, th.addresses[:2], {"command": [PY, "-c", program, *inject]},
                      defaults={"workdir": str(workdir), "env": {"HOSTILE": env_value}})
    r = cli("up", spec, timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for i in range(2):
        log = next(workdir.glob(f".mgpu/runs/*/task-{i}/worker.log")).read_text()
        seen = json.loads(next(line for line in log.splitlines() if line.startswith("HOSTILE {"))[len("HOSTILE "):])
        assert seen["argv"] == inject and seen["env"] == env_value and seen["cwd"] == str(workdir)
        assert seen["run_dir"].startswith(str(workdir) + "/.mgpu/runs/")
    assert not marker.exists(), "a value from the spec was executed by a shell"
    assert cli("status", "--json", timeout=120).returncode == 0
    assert cli("logs", "--task", "0", timeout=120).returncode == 0
    assert not marker.exists()


@needs_root
def test_sync_keeps_private_files_private_while_it_copies(cli, th, tmp_path):
    """Another user on the host, reading all the while, never reads a 0600 file during its copy (over a
    slowed link), and a synced folder keeps its local mode (0700 stays 0700)."""
    user = f"mgpu-rt{os.getpid() % 100000}"
    subprocess.run(["useradd", "-M", user], check=True)
    shared = Path(f"/tmp/mgpu-sync-{os.getpid()}")  # traversable by others, unlike pytest's own folders
    veth = th.hosts[0].veth  # the host's side of the bridge: what flows to the host (the upload) is slowed
    shape = ["tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", "1mbit", "burst", "32kbit", "latency", "400ms"]
    try:
        proj, wd = shared / "proj", shared / "wd"
        (proj / "data").mkdir(parents=True)
        (proj / "private").mkdir(mode=0o700)
        wd.mkdir()
        for d in (shared, proj / "data", wd):
            d.chmod(0o755)
        secret = os.urandom(256 * 1024)
        for f in (proj / "data" / "key.bin", proj / "private" / "notes.txt"):
            f.write_bytes(secret)
            f.chmod(0o600)
        spec = write_spec(tmp_path, th.addresses[:1], {"command": ["true"]}, top={"sync": ["data", "private"]},
                          defaults={"workdir": str(wd)}, folder=proj)
        subprocess.run(shape, check=True)
        check = cli.popen("check", spec)
        read = b""
        while check.poll() is None:  # the other user tries every file below the workdir, all the while
            found = subprocess.run(["runuser", "-u", user, "--", "sh", "-c", f"find {wd} -type f -exec cat {{}} +"],
                                   capture_output=True)
            read += found.stdout
        out = check.communicate()[0]
        assert check.returncode == 0 and "2 file(s) copied" in out, out
        assert secret[:64] not in read, "another user read a private file while it was copied"
        assert (wd / "data" / "key.bin").read_bytes() == secret
        assert oct((wd / "data" / "key.bin").stat().st_mode & 0o777) == "0o600"
        assert oct((wd / "private").stat().st_mode & 0o777) == "0o700"  # as the local folder
        assert not list(wd.rglob(".mgpu-sync-*")), "a temporary folder was left behind"
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", veth, "root"], check=False)
        subprocess.run(["userdel", user], check=False)
        shutil.rmtree(shared, ignore_errors=True)


@needs_root
def test_sync_gives_folders_their_local_mode_and_borrows_none_above_the_workdir(cli, th, tmp_path):
    """A workdir that sync makes below a world-writable sticky folder (as /tmp) is not made world-writable
    (the workdir and its parents are the host's own, not copies of the spec folder's parents); a synced
    folder that exists takes its local mode; a file made private locally since the last sync (unchanged
    otherwise) is made private on the host."""
    sticky = Path(f"/tmp/mgpu-sticky-{os.getpid()}")
    try:
        sticky.mkdir()
        sticky.chmod(0o1777)
        proj, wd = sticky / "proj", sticky / "made" / "deep" / "wd"  # not there yet: sync makes them
        (proj / "private").mkdir(parents=True)
        (proj / "private").chmod(0o755)
        (proj / "private" / "key.txt").write_text("secret")
        (proj / "private" / "key.txt").chmod(0o644)
        spec = write_spec(tmp_path, th.addresses[:1], {"command": ["true"]}, top={"sync": ["private"]},
                          defaults={"workdir": str(wd)}, folder=proj)
        r = cli("check", spec, timeout=120)
        assert r.returncode == 0 and "1 file(s) copied" in r.stdout, r.stdout + r.stderr
        for made in (sticky / "made", sticky / "made" / "deep", wd):
            assert not made.stat().st_mode & 0o7002, f"{made} is {oct(made.stat().st_mode)}"
        assert oct((wd / "private").stat().st_mode & 0o7777) == "0o755"
        (proj / "private").chmod(0o700)
        (proj / "private" / "key.txt").chmod(0o600)
        r = cli("check", spec, timeout=120)
        assert r.returncode == 0 and "0 file(s) copied (0.0 MB), 1 unchanged" in r.stdout, r.stdout + r.stderr
        assert oct((wd / "private").stat().st_mode & 0o7777) == "0o700"
        assert oct((wd / "private" / "key.txt").stat().st_mode & 0o777) == "0o600"
    finally:
        shutil.rmtree(sticky, ignore_errors=True)


@needs_root
def test_sync_copies_to_each_workdir_and_skips_unchanged(cli, th, tmp_path):
    proj = tmp_path / "proj"
    (proj / "data" / "sub").mkdir(parents=True)
    (proj / "job.py").write_text("print('JOB', open('data/a.txt').read(), open('data/sub/b.txt').read(), flush=True)\n")
    (proj / "data" / "a.txt").write_text("alpha")
    (proj / "data" / "sub" / "b.txt").write_text("beta")
    wds = [tmp_path / "remote-0" / "wd", tmp_path / "remote-1" / "wd"]  # not there yet: sync makes them
    spec = write_spec(tmp_path, th.addresses[:2], {"command": [PY, "job.py"]}, top={"sync": ["job.py", "data"]},
                      hosts=[{"workdir": str(w)} for w in wds], folder=proj,
                      launch={"standby": False})  # no fork server importing TensorFlow for a job that never restarts
    r = cli("up", spec, timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    # both tasks read the synced files: their alike lines are shown once, naming both
    assert out.count("3 file(s) copied") == 2 and "task0-1 | JOB alpha beta" in out, out
    for w in wds:
        assert (w / "data" / "sub" / "b.txt").read_text() == "beta"
        assert int((w / "job.py").stat().st_mtime) == int((proj / "job.py").stat().st_mtime)
    r = cli("up", spec, timeout=180)
    assert r.returncode == 0 and r.stdout.count("0 file(s) copied (0.0 MB), 3 unchanged") == 2, r.stdout
    (proj / "data" / "a.txt").write_text("ALPHA!")
    r = cli("up", spec, timeout=180)
    assert r.returncode == 0 and r.stdout.count("1 file(s) copied") == 2, r.stdout
    assert "task0-1 | JOB ALPHA! beta" in r.stdout, r.stdout


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_stopped_or_killed_launcher_stops_remote_tasks(cli, th, tmp_path, sig):
    spec = write_spec(tmp_path, th.addresses[:2], tick(), launch={"heartbeat_timeout": 120})
    code, out = cli.up_while(spec, lambda: all_progressing(cli, tmp_path), lambda up, _st: up.send_signal(sig),
                             "2 tasks progressing", ready_timeout=120, timeout=60)
    assert not wait_gone(tmp_path, 30), "remote tasks outlived their launcher"
    if sig == signal.SIGINT:
        assert code == 130 and "interrupted" in out.lower() and "Traceback" not in out, out
        assert status_json(cli)["state"] == "stopped"
    else:
        assert status_json(cli)["state"] == "lost"


@pytest.mark.cluster
@needs_root
def test_more_tasks_on_one_host_than_sshd_allows_sessions(tmp_path):
    """sshd's MaxSessions (10 by default) caps sessions per connection: more connections take the rest."""
    with TestHosts(1, tmp_path / "th") as one:
        config = one.state_dir / "hosts" / "h0" / "sshd_config"  # layout: deploy/README.md
        config.write_text(config.read_text().replace("MaxSessions 64", "MaxSessions 2"))
        one.crash(0)
        one.revive(0)
        cli = SSHCli(tmp_path / "mgpu-home", tmp_path, one)
        spec = write_spec(tmp_path, [one.addresses[0]] * 5, tick(2), hosts=[{"port": PORT + i} for i in range(5)])
        r = cli("up", spec, timeout=180)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out
        assert out.count("succeeded") >= 5 and "Secsh" not in out
        assert not wait_gone(tmp_path / "wd", 30)  # (tmp_path also holds this host's sshd)


@needs_root
def test_jump_host_from_ssh_config(th, tmp_path):
    """ProxyJump in ~/.ssh/config is honoured, and the jump host's key is checked too."""
    jump, target = th.hosts[5], th.hosts[6]
    home = tmp_path / "home"
    shutil.copytree(th.home, home)
    config = home / ".ssh" / "config"
    known = home / ".ssh" / "known_hosts"
    config.write_text(f"Host {target.address}\n    ProxyJump root@{jump.address}\n\n"
                      + config.read_text().replace(str(th.known_hosts), str(known)))
    cli = SSHCli(tmp_path / "mgpu-home", tmp_path, th, ssh_home=home)
    log = th.sshd_log(target.index)
    before = log.read_text()
    spec = write_spec(tmp_path, [target.address], {"command": ["touch", str(tmp_path / "done")]})
    r = cli("up", spec, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "done").exists()
    assert f"Accepted publickey for root from {jump.address}" in log.read_text()[len(before):]

    known.write_text(  # the jump host's key unknown: refused, naming it
        "".join(f"{line}\n" for line in th.known_hosts.read_text().splitlines()
                             if not line.startswith(jump.address + " ")))
    r = cli("up", spec, timeout=120)
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2, out
    assert f"jump host root@{jump.address} (ProxyJump on the way to {target.address}): its SSH host key is not " \
           "in known_hosts" in out, out
    assert not wait_gone(tmp_path, 10)


@needs_root
def test_task_environment_is_not_on_a_remote_command_line(cli, th, tmp_path):
    spec = write_spec(tmp_path, th.addresses[:1], tick(), defaults={"env": {"API_TOKEN": "hunter2"}})
    seen = []

    def look(up, _st):
        seen.extend(command_lines_with("hunter2", "TF_CONFIG"))
        up.send_signal(signal.SIGINT)

    code, out = cli.up_while(spec, lambda: all_progressing(cli, tmp_path), look, "progress", ready_timeout=120)
    assert code == 130, out
    assert not seen, seen


FLOOD = """
import os, sys, time
if os.environ["MGPU_TASK_INDEX"] == "1":
    time.sleep(600)
line = "x" * 200
t0 = time.time()
while time.time() - t0 < 3:
    print(line, flush=True)
open(sys.argv[1], "w").write(repr(time.time()))
sys.exit(3)
"""


@needs_root
@pytest.mark.parametrize("rate", ["1mbit", "256kbit"])
def test_fail_fast_over_a_slow_link_while_a_task_floods_output(cli, th, tmp_path, rate):
    """A slow link from the flooding task's host: its exit overtakes its output, and its peer is stopped
    within 3 s of the exit (queued output once delayed it by 18 s at 1 Mbit/s)."""
    exit_at, h0 = tmp_path / "exit_at", th.hosts[0]
    spec = write_spec(tmp_path, th.addresses[:2], {"command": [PY, "-c", FLOOD, str(exit_at)]},
                      launch={"heartbeat_timeout": 120})
    shape = ["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"]
    subprocess.run(["ip", "netns", "exec", h0.netns, *shape], check=True)
    try:
        up = cli.popen("up", spec)
        peer = wait_for(lambda: next((p for p in run_processes(tmp_path)  # only the training has the task's env
                                      if (p.info["environ"] or {}).get("MGPU_TASK_INDEX") == "1"), None),
                        60, "the peer's training process")
        wait_for(exit_at.exists, 60, "the flooding task's exit")
        gone, _alive = psutil.wait_procs([peer], timeout=30)
        stopped_at = time.time()
        out, _ = up.communicate(timeout=120)
    finally:
        subprocess.run(["ip", "netns", "exec", h0.netns, "tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
    took = stopped_at - float(exit_at.read_text())
    print(f"\nslow link ({rate}/s): peer stopped {took:.2f} s after the flooding task exited")
    assert up.returncode == 1 and "exited with code 3" in out and "Traceback" not in out, out
    assert gone and took < 3.0, f"the peer was stopped {took:.1f} s after the failure"


WAIT_IN_ATTEMPT = """
import json, os, sys, time
d = os.environ["MGPU_RUN_DIR"]
print("attempt", os.environ["MGPU_ATTEMPT"], "warm", "tensorflow" in sys.modules, flush=True)
with open(os.path.join(d, ".p"), "w") as f:
    json.dump({"state": "training", "global_step": 1, "time": time.time()}, f)
os.replace(os.path.join(d, ".p"), os.path.join(d, "progress.json"))
time.sleep(300)
"""


def autogroup_nice(pid: int) -> int:
    """The nice value of the scheduler autogroup (the session) that process `pid` runs in."""
    return int(Path(f"/proc/{pid}/autogroup").read_text().split("nice")[1])


@needs_root
def test_standbys_over_ssh_restart_warm_and_die_with_a_lost_launcher(cli, th, tmp_path):
    """Two SSH hosts: each task's attempts are forked from its host's fork server (TensorFlow imported there
    once), held for the next attempt by a standby; a kill -9 restarts from them; a launcher killed with kill -9
    leaves no task, no server and no standby on either host. An idle server never slows its training: the task
    (in the SSH session its core leads, as its server) keeps the session's scheduler autogroup at nice 0."""
    (tmp_path / "wd").mkdir(exist_ok=True)
    (tmp_path / "wd" / "wait.py").write_text(WAIT_IN_ATTEMPT)
    spec = write_spec(tmp_path, th.addresses[:2], {"command": [PY, "wait.py"]}, launch={"max_restarts": 1})

    def standbys(attempt):
        st = latest_state(cli)
        found = [t.get("standby") for t in (st or {}).get("tasks", [])]
        if st and st["state"] == "running" and len(found) == 2 and all(
                s and s["ready"] and s["attempt"] == attempt and alive(s["pid"]) for s in found):
            return [s["pid"] for s in found]
        return None

    with cli.running("up", spec) as up:
        first = wait_for(lambda: standbys(1), 240, "a ready standby on both hosts")
        tasks = latest_state(cli)["tasks"]
        assert [autogroup_nice(t["pid"]) for t in tasks] == [0, 0], "an idle standby niced its training"
        os.kill(tasks[1]["pid"], signal.SIGKILL)
        wait_for(lambda: standbys(2), 240, "attempt 1 running, and the standbys for attempt 2")
        st = latest_state(cli)
        assert st["attempt"] == 1 and all(t["warm"] for t in st["tasks"]), st["tasks"]
        assert [t["standby"]["pid"] for t in st["tasks"]] == first  # the same servers, for the next attempt too
        log = (task_dir(tmp_path, st, 0) / "worker.log").read_text()
        assert "attempt 0 warm False" in log and "attempt 1 warm True" in log, log[-1500:]
        assert [autogroup_nice(t["pid"]) for t in st["tasks"]] == [0, 0], "an idle standby niced its training"
        up.kill()  # the launcher lost: kill -9
        up.wait()
    assert not wait_gone(tmp_path, 30), "tasks or standbys outlived their launcher"
