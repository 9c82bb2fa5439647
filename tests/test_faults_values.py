"""Values from files and specs are untrusted input: a NUL in the spec, a progress.json of the wrong
types, host names that look like markup, a relative workdir, a program that is not executable, and a
dead launcher's run asked about 30 times at once. Exit codes and one paragraph, never a traceback."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import psutil

from conftest import Cli, free_port, latest_state, wait_for, wait_gone, write_spec
from launcher.run.progress import typed
from launcher.spec.base import nul_at

PY = sys.executable


def no_traceback(r: subprocess.CompletedProcess) -> bool:
    return "Traceback" not in r.stdout + r.stderr


def command(script: str) -> str:
    return f"command = {json.dumps([PY, '-c', script])}"


NULS = [  # (training, extra host keys, top-level keys, the key path named)
    (command("pass"), 'env = { A = "x\\u0000y" }\n', "", "hosts[0].env.A"),
    ('command = ["prog", "a\\u0000b"]', "", "", "training.command[1]"),
    (command("pass"), "", "", "hosts[0].address"),
    (command("pass"), 'workdir = "/tmp/a\\u0000b"\n', "", "hosts[0].workdir"),
    (command("pass"), "", 'sync = ["data\\u0000"]\n', "sync[0]"),
    (command("pass") + '\ncheckpoint_dir = "ck\\u0000pt"', "", "", "training.checkpoint_dir"),
]


def test_a_nul_anywhere_in_the_spec_is_refused_by_its_key(cli, tmp_path):
    for i, (training, host, top, where) in enumerate(NULS):
        address = "local\\u0000host" if where.endswith("address") else "localhost"
        spec = tmp_path / f"nul{i}.toml"
        spec.write_text(f'{top}[[hosts]]\naddress = "{address}"\nport = {free_port()}\ngpus = "none"\n{host}'
                        f"[training]\n{training}\n")
        for verb in ("check", "up"):
            r = cli(verb, spec, timeout=60)
            assert r.returncode == 2 and f"{where}: holds a NUL character" in r.stderr and no_traceback(r), \
                r.stdout + r.stderr
    assert not (cli.home / "runs").exists() or not list((cli.home / "runs").iterdir())  # nothing started


def test_control_characters_in_a_host_name_or_address_are_refused(cli, tmp_path):
    for key, value in (("name", "w\\u001b[31m0"), ("name", "two\\nlines"), ("address", "host\\u0007")):
        spec = tmp_path / "cluster.toml"
        extra = f'{key} = "{value}"\n' + ('address = "localhost"\n' if key != "address" else "")
        spec.write_text(f'[[hosts]]\n{extra}port = {free_port()}\n[training]\n{command("pass")}\n')
        r = cli("check", spec, timeout=60)
        assert r.returncode == 2 and f"hosts[0].{key}:" in r.stderr and "control character" in r.stderr \
            and no_traceback(r) and "\x1b[31m0" not in r.stderr, r.stdout + r.stderr


def test_nul_at_names_the_first_key_path_that_holds_one():
    assert nul_at({"a": [{"b": "ok"}, {"c": ["x", "y\x00"]}]}) == "a[1].c[1]"
    assert nul_at({"k\x00": 1}) == "k\x00" and nul_at({"a": 1, "b": [2.5, True]}) is None


def test_typed_progress_keeps_only_fields_of_the_right_type_and_range():
    assert typed([1, 2]) == {} and typed("x") == {} and typed(None) == {}
    got = typed({"global_step": -5, "step": 2**60, "epoch": True, "time": float("inf"), "loss": "nan",
                 "samples_per_sec": 12, "state": ["training"], "metrics": {"x" * 100: 1, "bad": [1], "\x1b[2J": 1},
                 "epochs": 3, "compute_ms": 1e400})
    assert got == {"samples_per_sec": 12.0, "epochs": 3, "metrics": {"x" * 64: 1.0}}, got
    many = typed({"metrics": {f"m{i}": i for i in range(1000)}, "state": "training", "global_step": 7})
    assert len(many["metrics"]) == 32 and many["state"] == "training" and many["global_step"] == 7


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
    own_line = command("import os; print(os.environ['MGPU_TASK_INDEX'])")  # lines alike would be shown once
    spec.write_text(f'[defaults]\ngpus = "none"\n{hosts}[training]\n{own_line}\n')
    for args in (["check", spec], ["up", spec], ["status"], ["status", "--json"]):
        r = cli(*args, timeout=120)
        out = r.stdout + r.stderr
        assert r.returncode == 0 and no_traceback(r), out
        assert "gpu[a100]" in out and "w[/]0" in out, out
    up = cli("up", spec, timeout=120)
    assert "task0 w[/]0 | 0" in up.stdout and "task1 gpu[a100] | 1" in up.stdout, up.stdout


def test_a_failing_task_with_a_markup_name_is_told_as_it_is(cli, tmp_path):
    """The failure paragraph, the summary, status drawn as on a terminal, logs and down: names, log lines
    and metric names that look like markup stay as they are."""
    script = ("import json, os, sys; open(os.path.join(os.environ['MGPU_RUN_DIR'], 'progress.json'), 'w').write("
              "json.dumps({'state': 'training', 'global_step': 1, 'metrics': {'[red]acc': 0.5}})); "
              "print('[bold]said[/]', os.environ['MGPU_TASK_INDEX'], flush=True); "  # each its own line
              "sys.exit(int(os.environ['MGPU_TASK_INDEX']) * 3)")
    hosts = "".join(f'[[hosts]]\naddress = "localhost"\nport = {free_port()}\nname = "{name}"\n'
                    for name in ("w[/]0", "gpu[a100]"))
    spec = tmp_path / "cluster.toml"
    spec.write_text(f'[defaults]\ngpus = "none"\n{hosts}[training]\n{command(script)}\n')
    up = cli("up", spec, timeout=120)
    assert up.returncode == 1 and no_traceback(up), up.stdout + up.stderr
    assert "task 1 (gpu[a100]:" in up.stderr and "exited with code 3" in up.stderr, up.stderr
    assert "task1 gpu[a100] | [bold]said[/] 1" in up.stdout and "gpu[a100]:" in up.stdout, up.stdout
    tty = Cli(cli.home, tmp_path)
    tty.env["FORCE_COLOR"] = "1"  # rich draws its table, as on a terminal
    for c, args in ((tty, ["status"]), (cli, ["status"]), (cli, ["logs", "--task", "1"]), (cli, ["down"])):
        r = c(*args, timeout=60)
        assert r.returncode == 0 and no_traceback(r), r.stdout + r.stderr
        assert ("gpu[a100]" in r.stdout) or args[0] != "status", r.stdout
    assert "[bold]said[/]" in cli("logs", "--task", "1", timeout=60).stdout


def test_a_relative_workdir_is_found_from_another_folder(cli, tmp_path):
    """A detached run with workdir = "wd": logs, status --probe and down, run from another folder, reach
    the same task (its workdir is relative to the spec's folder, and the record keeps that folder)."""
    script = "import time; print('hello from the task', flush=True); time.sleep(600)"
    spec = write_spec(tmp_path, command(script), n=1, extra='workdir = "wd"\n', launch="heartbeat_timeout = 5")
    (tmp_path / "wd").mkdir()
    assert cli("up", "--detach", spec, timeout=120).returncode == 0
    assert (tmp_path / "wd" / ".mgpu").is_dir()  # relative to the spec's folder
    elsewhere = Cli(cli.home, tmp_path.parent)  # the same runs, another folder
    wait_for(lambda: "hello from the task" in elsewhere("logs", timeout=60).stdout, 60, "the task's line in logs")
    probe = elsewhere("status", "--probe", "--json", timeout=60)
    task = json.loads(probe.stdout)["tasks"][0]
    assert probe.returncode == 0 and task["state"] == "running" and task["error"] is None, probe.stdout
    down = elsewhere("down", timeout=120)
    assert down.returncode == 0 and no_traceback(down), down.stdout + down.stderr
    assert not wait_gone(cli.home, 10)


def test_a_program_that_is_not_executable_is_refused_by_check(cli, tmp_path):
    prog = tmp_path / "train.sh"
    prog.write_text("#!/bin/sh\necho hi\n")
    prog.chmod(0o644)
    bin_dir = tmp_path / "bin"  # a program named without a folder, found on PATH but not executable
    bin_dir.mkdir()
    (bin_dir / "mgpu-train-here").write_text("#!/bin/sh\necho hi\n")
    cli.env["PATH"] = f"{bin_dir}:{cli.env['PATH']}"
    for program, needle in ((str(prog), f"program {prog} is not executable"),
                            ("mgpu-train-here", f"program {bin_dir}/mgpu-train-here (found on PATH) is not executable"),
                            (str(tmp_path), f"program {tmp_path} is a folder")):
        spec = write_spec(tmp_path, f"command = [{json.dumps(program)}]", n=1)
        for verb in ("check", "up"):
            r = cli(verb, spec, timeout=60)
            assert r.returncode == 2 and needle in r.stdout + r.stderr and no_traceback(r), r.stdout + r.stderr
    assert not (cli.home / "runs").exists() or not list((cli.home / "runs").glob("*/hosts/*/task-*/worker.log"))


def test_status_of_a_killed_launchers_run_never_says_alive_even_30_at_once(cli, tmp_path):
    spec = write_spec(tmp_path, command("import time; time.sleep(600)"), n=2, launch="heartbeat_timeout = 5")
    assert cli("up", "--detach", spec, timeout=120).returncode == 0
    st = latest_state(cli)
    psutil.Process(st["agent_pid"]).send_signal(signal.SIGKILL)
    wait_for(lambda: not psutil.pid_exists(st["agent_pid"]) or psutil.Process(st["agent_pid"]).status() == "zombie",
             10, "the launcher gone")
    with ThreadPoolExecutor(30) as pool:
        answers = list(pool.map(lambda _: cli("status", "--json", timeout=120), range(30)))
    # and while one of them settles the run (holding the run's lock, as a `status` probing slow hosts would)
    fd = os.open(cli.home / "runs" / st["run_id"] / "run.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        answers += [cli("status", "--json", timeout=120) for _ in range(3)]
    finally:
        os.close(fd)
    for r in answers:
        assert r.returncode == 0 and no_traceback(r), r.stdout + r.stderr
        snap = json.loads(r.stdout)
        assert snap["launcher_alive"] is False and snap["state"] != "running", snap
    assert not wait_gone(cli.home, 30)  # the tasks' lifeline stopped them
    settled = json.loads(cli("status", "--json", timeout=60).stdout)
    assert settled["state"] == "lost" and settled["failure"]["kind"] == "lost", settled
    assert latest_state(cli)["state"] == "lost"  # recorded by the status that found every task stopped
