"""The launcher's own faults, with real processes: a Ctrl-C that comes while a failed attempt is torn
down (no restart follows), an MGPU_HOME too full to record a run (nothing starts), `up --detach` of a
run that ends at once, and run records damaged field by field (exit 2, never a traceback)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import IN_CI, Cli, latest_state, reap, run_processes, tmpfs, wait_for, wait_gone, write_spec

PY = sys.executable
needs_root = pytest.mark.skipif(os.geteuid() != 0 and not IN_CI,
                                reason="needs root to mount a small tmpfs (never skipped under CI=true)")

# task 1 fails at once; task 0 takes 2 s to stop on TERM and says when the TERM came
SLOW_TO_STOP = """
import os, signal, sys, time
if os.environ["MGPU_TASK_INDEX"] == "1":
    time.sleep(1)
    sys.exit(3)
def on_term(*_):
    open(sys.argv[1], "w").write("x")
    time.sleep(2)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
time.sleep(600)
"""


def command(*argv) -> str:
    return f"command = {json.dumps([PY, *map(str, argv)])}"


def test_ctrl_c_during_a_failed_attempts_teardown_restarts_nothing(cli, tmp_path):
    termed = tmp_path / "termed"
    spec = write_spec(tmp_path, command("-c", SLOW_TO_STOP, termed), launch="max_restarts = 2\nstop_grace = 5")
    code, out = cli.up_while(spec, termed.exists, lambda up, _: up.send_signal(signal.SIGINT),
                             "the teardown of the failed attempt", ready_timeout=60, timeout=60)
    assert code == 130 and "Traceback" not in out, out
    assert "restarting" not in out, out  # the Ctrl-C came before any restart: none may follow
    st = latest_state(cli)
    assert st["state"] == "stopped" and st["failure"]["kind"] == "stopped", st
    assert len(st["attempts"]) == 1 and st["attempts"][0]["outcome"] == "failed", st["attempts"]
    assert not wait_gone(cli.home, 10)


@pytest.fixture
def full_home(tmp_path):
    """An MGPU_HOME on a 1 MiB tmpfs that is full (an empty file still fits: inodes are not blocks)."""
    with tmpfs(tmp_path / "disk", "1m") as disk:
        (disk / "home" / "runs").mkdir(parents=True)
        subprocess.run(["dd", "if=/dev/zero", f"of={disk}/filler", "bs=64k"], capture_output=True)
        yield disk / "home"


@needs_root
def test_an_mgpu_home_too_full_to_record_the_run_starts_nothing(tmp_path, full_home):
    started = tmp_path / "started"
    spec = write_spec(tmp_path, command("-c", f"open({str(started)!r}, 'w')"))
    cli = Cli(full_home, tmp_path)
    try:
        r = cli("up", spec, timeout=60)
        out = r.stdout + r.stderr
        assert r.returncode == 2 and "Traceback" not in out, out
        assert "cannot record run" in out and "MiB free" in out and str(full_home) in out, out
        assert not started.exists() and not list((full_home / "runs").glob("2*")), out
        status = cli("status", timeout=60)
        assert status.returncode == 2 and "No runs yet" in status.stderr, status.stderr
    finally:
        assert not reap(run_processes(full_home))


def test_detach_of_a_run_that_ends_at_once_is_not_a_failure(cli, tmp_path):
    spec = write_spec(tmp_path, command("-c", "pass"))
    for _ in range(3):  # the background run may end before the detaching `up` looks
        r = cli("up", "--detach", spec, timeout=120)
        assert r.returncode == 0 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
        wait_for(lambda: latest_state(cli)["state"] == "succeeded", 60, "the run to succeed")


RECORD = {"version": 3, "run_id": "20991231-235959-dead", "spec_path": "/nowhere/cluster.toml", "state": "running",
          "tasks": [{"index": 0, "host": "h", "address": "h", "port": 20000, "run_dir": "/nowhere", "state": "running"}]}


@pytest.mark.parametrize("damage", [
    {"tasks": [{**RECORD["tasks"][0], "rss": "big"}]},
    {"tasks": [{**RECORD["tasks"][0], "state": "weird"}]},
    {"phases": {"preflight_s": "soon"}},
    {"attempts": "none"},
    {"restarts": True},
    {"tasks": {"0": "x"}},
], ids=["rss", "state", "phases", "attempts", "bool", "tasks"])
def test_a_record_damaged_in_one_field_is_exit_2_naming_it(cli, damage):
    folder = cli.home / "runs" / RECORD["run_id"]
    folder.mkdir(parents=True)
    (folder / "state.json").write_text(json.dumps({**RECORD, **damage}))
    for args in (["status"], ["status", "--json"], ["logs"], ["down"]):
        r = cli(*args, timeout=60)
        assert r.returncode == 2 and "corrupt" in r.stderr, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stdout + r.stderr, r.stderr


def test_a_record_that_is_not_text_is_exit_2(cli):
    folder = cli.home / "runs" / RECORD["run_id"]
    folder.mkdir(parents=True)
    (folder / "state.json").write_bytes(b"\xff\xfe\x00garbage")
    r = cli("status", "--json", timeout=60)
    assert r.returncode == 2 and "corrupt" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_run_whose_spec_copy_is_gone_is_told_so(cli, tmp_path):
    spec = write_spec(tmp_path, command("-c", "pass"), n=1)
    assert cli("up", spec, timeout=120).returncode == 0
    run_id = latest_state(cli)["run_id"]
    (cli.home / "runs" / run_id / "spec.toml").unlink()
    r = cli("status", "--probe", timeout=60)
    assert r.returncode == 2 and "spec.toml is missing" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "cluster.example.toml" not in r.stderr, r.stderr
    assert Path(cli.home / "runs" / run_id).exists()
