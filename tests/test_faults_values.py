"""Values from files and specs are untrusted input: a NUL in the spec, a progress.json of the wrong
types, host names that look like markup, a relative workdir, a program that is not executable, and a
dead launcher's run asked about 30 times at once. Exit codes and one paragraph, never a traceback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import psutil

from conftest import Cli, free_port, latest_state, wait_for, wait_gone, write_spec

PY = sys.executable


def no_traceback(r: subprocess.CompletedProcess) -> bool:
    return "Traceback" not in r.stdout + r.stderr


def command(script: str) -> str:
    return f"command = {json.dumps([PY, '-c', script])}"


def test_a_nul_in_an_env_value_or_the_command_is_refused_by_name(cli, tmp_path):
    for training, env, needle in [(command("pass"), 'A = "x\\u0000y"', "env: the value of A holds a NUL"),
                                  ('command = ["prog", "a\\u0000b"]', 'B = "1"', "training.command: an argument")]:
        spec = write_spec(tmp_path, training, n=1, env=env)
        for verb in ("check", "up"):
            r = cli(verb, spec, timeout=60)
            assert r.returncode == 2 and needle in r.stderr and no_traceback(r), r.stdout + r.stderr
    assert not (cli.home / "runs").exists() or not list((cli.home / "runs").glob("*/task-*"))


def test_a_progress_json_of_the_wrong_types_is_ignored_not_fatal(cli, tmp_path):
    bad = {"state": "training", "global_step": "7", "time": "soon", "loss": "low", "epoch": [1],
           "samples_per_sec": 1e400, "metrics": {"acc": "high", "ok": 0.5}, "compute_ms": None}
    script = (f"import json, os, time; p = os.path.join(os.environ['MGPU_RUN_DIR'], 'progress.json'); "
              f"[open(p, 'w').write({json.dumps(bad)!r}) or time.sleep(0.6) for _ in range(3)]")
    spec = write_spec(tmp_path, command(script), n=2)
    r = cli("up", spec, timeout=120)
    assert r.returncode == 0 and no_traceback(r), r.stdout + r.stderr
    for args in (["status"], ["status", "--json"], ["status", "--probe"]):
        s = cli(*args, timeout=60)
        assert s.returncode == 0 and no_traceback(s), s.stdout + s.stderr
    task = json.loads(cli("status", "--json", timeout=60).stdout)["tasks"][0]
    assert task["global_step"] is None and task["heartbeat_age"] is None and task["metrics"] == {"ok": 0.5}, task


def test_host_names_that_look_like_markup_are_shown_as_they_are(cli, tmp_path):
    hosts = "".join(f'[[hosts]]\naddress = "localhost"\nport = {free_port()}\nname = "{name}"\n'
                    for name in ("w[/]0", "gpu[a100]"))
    spec = tmp_path / "cluster.toml"
    spec.write_text(f'[defaults]\ngpus = "none"\n{hosts}[training]\n{command("print(1)")}\n')
    for args in (["check", spec], ["up", spec], ["status"], ["status", "--json"]):
        r = cli(*args, timeout=120)
        out = r.stdout + r.stderr
        assert r.returncode == 0 and no_traceback(r), out
        assert "gpu[a100]" in out and "w[/]0" in out, out
    up = cli("up", spec, timeout=120)
    assert "task0 w[/]0 | 1" in up.stdout and "task1 gpu[a100] | 1" in up.stdout, up.stdout


def test_logs_of_a_relative_workdir_from_another_folder(cli, tmp_path):
    spec = write_spec(tmp_path, command("print('hello from the task', flush=True)"), n=1, extra='workdir = "wd"\n')
    (tmp_path / "wd").mkdir()
    assert cli("up", spec, timeout=120).returncode == 0
    elsewhere = Cli(cli.home, tmp_path.parent)  # the same runs, another folder
    r = elsewhere("logs", timeout=60)
    assert r.returncode == 0 and "hello from the task" in r.stdout, r.stdout + r.stderr
    assert (tmp_path / "wd" / ".mgpu").is_dir()  # relative to the spec's folder


def test_a_program_that_is_not_executable_is_refused_by_check(cli, tmp_path):
    prog = tmp_path / "train.sh"
    prog.write_text("#!/bin/sh\necho hi\n")
    prog.chmod(0o644)
    spec = write_spec(tmp_path, f"command = [{json.dumps(str(prog))}]", n=1)
    r = cli("check", spec, timeout=60)
    assert r.returncode == 2 and "is not executable" in r.stdout + r.stderr and no_traceback(r), r.stdout + r.stderr


def test_status_of_a_killed_launchers_run_never_says_alive_even_30_at_once(cli, tmp_path):
    spec = write_spec(tmp_path, command("import time; time.sleep(600)"), n=2, launch="heartbeat_timeout = 5")
    assert cli("up", "--detach", spec, timeout=120).returncode == 0
    st = latest_state(cli)
    psutil.Process(st["agent_pid"]).send_signal(signal.SIGKILL)
    wait_for(lambda: not psutil.pid_exists(st["agent_pid"]) or psutil.Process(st["agent_pid"]).status() == "zombie",
             10, "the launcher gone")
    with ThreadPoolExecutor(30) as pool:
        answers = list(pool.map(lambda _: cli("status", "--json", timeout=120), range(30)))
    for r in answers:
        assert r.returncode == 0 and no_traceback(r), r.stdout + r.stderr
        snap = json.loads(r.stdout)
        assert snap["launcher_alive"] is False and snap["state"] != "running", snap
    assert not wait_gone(cli.home, 30)  # the tasks' lifeline stopped them
