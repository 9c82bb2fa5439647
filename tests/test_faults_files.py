"""The launcher's own reads and writes, with real processes through the real CLI: bytes that are not UTF-8
in a log or a history, run files that are folders, FIFOs or too large, a read-only MGPU_HOME (a real
read-only bind mount), an MGPU_HOME that fills before the run's end (a real small tmpfs), logs of a run that
never started a task or of a host that cannot be reached. Each is output or one paragraph, never a traceback."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import IN_CI, Cli, latest_state, reap, run_processes, tmpfs, wait_for, wait_gone, write_spec

PY = sys.executable
needs_root = pytest.mark.skipif(os.geteuid() != 0 and not IN_CI,
                                reason="needs root to mount a file system (never skipped under CI=true)")


def command(script: str) -> str:
    return f"command = {json.dumps([PY, '-c', script])}"


def no_traceback(out: str) -> bool:
    return not any(line.startswith("Traceback") for line in out.splitlines())


def run_folder(cli, run_id: str) -> Path:
    return cli.home / "runs" / run_id


@contextlib.contextmanager
def read_only(folder: Path):
    """`folder` made read-only where it is (a read-only bind mount over itself), writable again afterwards."""
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def started(cli, run_id: str | None = None):
    """A wait_for condition: the newest run (other than `run_id`) is running; its state."""
    def cond():
        st = latest_state(cli)
        return st if st and st["run_id"] != run_id and st["state"] == "running" else None
    return cond


# --------------------------------------------------------------------------- logs: bytes as written

UNDECODABLE = r"""
import sys, time
w = sys.stdout.buffer
w.write(b"hello \xff\xfe\xfd\xfc world line one\n"); w.flush()
time.sleep(1.5)
w.write(b"price 10 \xe2\x82"); w.flush()  # a character split between two reads of `logs -f`
time.sleep(1.5)
w.write(b"\xac\nhello world line two\nno newline at the end"); w.flush()
time.sleep(0.5)
"""


def test_logs_show_a_log_with_bytes_that_are_not_utf8_whole(cli, tmp_path):
    spec = write_spec(tmp_path, command(UNDECODABLE), n=1)
    up = cli.popen("up", spec)
    try:
        st = wait_for(started(cli), 60, "the task to run")
        followed = cli("logs", "-f", timeout=60)
        up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 0 and followed.returncode == 0 and no_traceback(followed.stderr), followed.stderr
    lines = followed.stdout.splitlines()
    assert "hello \ufffd\ufffd\ufffd\ufffd world line one" in lines, lines  # each bad byte shown, none skipped
    assert "price 10 \u20ac" in lines and "hello world line two" in lines, lines
    assert lines[-1] == "no newline at the end", lines  # the partial last line, once the run ended
    log = Path(st["tasks"][0]["run_dir"], "worker.log").read_bytes()
    assert followed.stdout == log.decode("utf-8", "replace") + "\n"  # the log whole, nothing cut or added
    again = cli("logs", timeout=60)
    assert again.returncode == 0 and again.stdout == followed.stdout, again.stdout


# --------------------------------------------------------------------------- files of a run, damaged

def test_damaged_files_of_a_run_are_one_paragraph_each(cli, tmp_path):
    spec = write_spec(tmp_path, command("pass"), n=1)
    assert cli("up", spec, timeout=120).returncode == 0
    st = latest_state(cli)
    folder = run_folder(cli, st["run_id"])
    history = folder / "progress.jsonl"
    good = {"time": st["created_at"] + 1, "task": 0, "attempt": 0, "progress": {"samples_per_sec": 10.0}}
    history.write_bytes(b"\xff\xfe\x00 not text \xc3\n" + json.dumps(good).encode() + b"\n{\"time\": NaN}\n[[[[\n")
    png = tmp_path / "report.png"
    r = cli("report", "-o", png, timeout=120)
    assert r.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG" and no_traceback(r.stderr), r.stderr

    history.unlink()
    history.mkdir()
    r = cli("report", "-o", png, timeout=120)
    assert r.returncode == 2 and no_traceback(r.stderr), r.stderr
    assert f"{history} is a folder" in r.stderr, r.stderr

    state = folder / "state.json"
    kept = state.read_bytes()
    state.unlink()
    for damage, words in (("folder", "is a folder"), ("fifo", "not a regular file"), ("huge", "more than")):
        if damage == "folder":
            state.mkdir()
        elif damage == "fifo":
            os.mkfifo(state)  # reading must not wait for a writer that never comes
        else:
            with open(state, "wb") as f:
                f.truncate(1 << 30)  # sparse: 1 GiB read as nothing but its size
        for args in (["status"], ["status", "--json"], ["logs"], ["down"], ["report"]):
            r = cli(*args, timeout=30)
            assert r.returncode == 2 and no_traceback(r.stdout + r.stderr), (damage, args, r.stdout, r.stderr)
            assert str(state) in r.stderr and words in r.stderr, (damage, args, r.stderr)
        if state.is_dir():
            state.rmdir()
        else:
            state.unlink()
    state.write_bytes(kept)
    assert cli("status", timeout=30).returncode == 0


# --------------------------------------------------------------------------- a read-only MGPU_HOME

@needs_root
def test_a_read_only_home_shows_runs_and_says_what_it_cannot_record(cli, tmp_path):
    assert cli("up", write_spec(tmp_path, command("print('a done')"), n=1, name="a.toml"), timeout=120).returncode == 0
    done = latest_state(cli)["run_id"]
    up = cli.popen("up", write_spec(tmp_path, command("import time; time.sleep(600)"), n=1, name="b.toml"))
    try:
        killed = wait_for(started(cli, done), 60, "run b to run")["run_id"]
    finally:
        up.kill()  # kill -9: the launcher records nothing; the supervisors stop their tasks
        up.wait()
    assert not wait_gone(cli.home, 30)
    with read_only(cli.home):
        for args in (["status", killed], ["status", "--json", killed]):
            r = cli(*args, timeout=60)
            out = r.stdout + r.stderr
            assert r.returncode == 0 and no_traceback(out), out
            assert "could not be recorded" in r.stderr and "Read-only file system" in r.stderr, r.stderr
            assert "ended without recording how the run ended" in r.stdout, r.stdout
        snap = json.loads(r.stdout)
        assert snap["state"] == "lost" and "state.json" in snap["unrecorded"], snap
        r = cli("down", done, timeout=60)  # an ended run: nothing to write
        assert r.returncode == 0 and "every task is stopped" in r.stdout and no_traceback(r.stderr), r.stdout + r.stderr
        r = cli("logs", done, timeout=60)
        assert r.returncode == 0 and r.stdout.splitlines()[-1] == "a done", r.stdout + r.stderr
        r = cli("down", killed, timeout=60)  # its stop is news: said, not recorded
        assert r.returncode == 2 and no_traceback(r.stdout + r.stderr), r.stdout + r.stderr
        assert "could not be recorded" in r.stderr and "Read-only file system" in r.stderr, r.stderr
        assert json.loads((run_folder(cli, killed) / "state.json").read_text())["state"] == "running"
    r = cli("status", "--json", killed, timeout=60)  # writable again: recorded now
    assert r.returncode == 0 and json.loads(r.stdout)["unrecorded"] is None, r.stdout + r.stderr
    assert json.loads((run_folder(cli, killed) / "state.json").read_text())["state"] == "lost"


# --------------------------------------------------------------------------- an MGPU_HOME that fills up

FILLS_THEN_FAILS = """
import os, subprocess, sys, time
if os.environ["MGPU_TASK_INDEX"] == "1":
    time.sleep(1)
    subprocess.run(["dd", "if=/dev/zero", "of=" + sys.argv[1], "bs=64k"], capture_output=True)
    time.sleep(1.5)
    sys.exit(3)
time.sleep(600)
"""


@pytest.mark.cluster
@needs_root
def test_a_home_that_fills_before_the_end_keeps_how_the_run_ended(tmp_path):
    with tmpfs(tmp_path / "disk", "2m") as disk:
        cli = Cli(disk / "home", tmp_path)
        filler = disk / "filler"
        (tmp_path / "wd").mkdir()
        spec = write_spec(tmp_path, f"command = {json.dumps([PY, '-c', FILLS_THEN_FAILS, str(filler)])}",
                          extra=f'workdir = "{tmp_path / "wd"}"\n')  # the tasks' folders have room
        try:
            r = cli("up", spec, timeout=120)
            out = r.stdout + r.stderr
            assert r.returncode == 1 and no_traceback(out) and "cannot write the run record" in out, out
            assert latest_state(cli)["state"] == "running"  # the record's last save that worked
            r = cli("status", timeout=60)  # the disk is still full
            assert r.returncode == 0 and no_traceback(r.stdout + r.stderr), r.stdout + r.stderr
            assert "ended without recording how the run ended" not in r.stdout, r.stdout
            assert "could not record how the run ended" in r.stdout and "No space left on device" in r.stdout, r.stdout
            assert "says the run was failed" in r.stdout and "exited with code 3" in r.stdout, r.stdout
            assert "could not be recorded" in r.stderr, r.stderr
            filler.unlink()
            snap = json.loads(cli("status", "--json", timeout=60).stdout)
            assert snap["state"] == "lost" and "exited with code 3" in snap["failure"]["message"], snap
            assert snap["unrecorded"] is None and latest_state(cli)["state"] == "lost"
        finally:
            left = reap(run_processes(cli.home))
    assert not left


# --------------------------------------------------------------------------- logs of a run without logs

def test_logs_of_a_run_refused_at_preflight_say_it_has_none(cli, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        spec = write_spec(tmp_path, command("pass"), n=1)
        spec.write_text(re.sub(r"port = \d+", f"port = {taken.getsockname()[1]}", spec.read_text()))
        r = cli("up", spec, timeout=120)
        assert r.returncode == 2 and "nothing was started" in r.stdout + r.stderr, r.stdout + r.stderr
    run_id = latest_state(cli)["run_id"]
    for args in (["logs", "--task", "0"], ["logs"], ["logs", "-f"], ["logs", "--tail", "3"]):
        r = cli(*args, timeout=60)
        assert r.returncode == 2 and no_traceback(r.stdout + r.stderr), (args, r.stdout, r.stderr)
        assert f"run {run_id} never started a task" in r.stderr and "so it has no logs" in r.stderr, r.stderr
        assert "launcher.log" in r.stderr, r.stderr


def test_logs_of_a_host_that_cannot_be_reached_is_one_paragraph(cli, tmp_path):
    spec = write_spec(tmp_path, command("print('here')"), n=1)
    assert cli("up", spec, timeout=120).returncode == 0
    st = latest_state(cli)
    folder = run_folder(cli, st["run_id"])
    with socket.socket() as s:  # a port nothing listens on: the host refuses SSH
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    # the run's task lives on another machine (as a remote run's would): 127.0.0.2 is not this one for mgpu-cluster
    copy = folder / "spec.toml"
    copy.write_text(copy.read_text().replace('address = "localhost"', f'address = "127.0.0.2"\nssh_port = {closed}'))
    state = json.loads((folder / "state.json").read_text())
    state["tasks"][0]["host"] = state["tasks"][0]["address"] = "127.0.0.2"
    (folder / "state.json").write_text(json.dumps(state))
    for args in (["logs", "--task", "0"], ["logs", "-f"]):
        r = cli(*args, timeout=60)
        assert r.returncode == 1 and no_traceback(r.stdout + r.stderr), (args, r.stdout, r.stderr)
        paragraph = r.stderr.strip()
        assert paragraph.startswith("error: task 0 (127.0.0.2): cannot read ") and "worker.log" in paragraph, paragraph
        assert "connection refused" in paragraph and f"'mgpu-cluster logs {st['run_id']} --task 0' again" in paragraph
        assert len(paragraph.splitlines()) == 1, paragraph
