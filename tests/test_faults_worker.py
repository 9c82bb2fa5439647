"""The worker side under faults: the task core (as the launcher, srun or a pod starts it), the progress
writer and `python -m worker`, driven with real processes, files, disks and signals. What a training writes
is untrusted input, its exit code reaches the launcher whatever happens to its folder, a notice is a
preemption only where the task did not finish, no traceback for a user's mistake, nothing left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import IN_CI, REPO, free_port, latest_state, tmpfs, wait_for, wait_gone, write_spec
from worker.host import protocol
from worker.task.slurm import peer_failed

PY = sys.executable
needs_root = pytest.mark.skipif(os.geteuid() != 0 and not IN_CI,
                                reason="needs root to mount a small tmpfs (never skipped under CI=true)")
NESTED = ["[" * 1000, '{"a": ' + "[" * 600 + "]" * 600 + "}", '{"a": ' + "[" * 40 + "]" * 40 + "}"]


def command(script: str) -> str:
    return f"command = {json.dumps([PY, '-c', script])}"


def records(out: bytes) -> list[protocol.Event]:
    found = []
    for line in out.splitlines():
        try:
            found.append(protocol.decode(line))
        except protocol.BadRecord:
            continue
    return found


def of_kind(events: list[protocol.Event], cls: type) -> list:
    return [ev for ev in events if isinstance(ev, cls)]


def supervised(run_dir: Path, script: str, *args: str, env_stdin: bool = False) -> subprocess.Popen:
    """The on-host core of a local or SSH task, started as the launcher starts it (detached: it goes on when
    its stdin ends, so that the test may read its records to the end)."""
    return subprocess.Popen([PY, "-m", "worker.task.supervised", "--run-dir", str(run_dir), "--detach", *args,
                             *(["--env-stdin"] if env_stdin else []), "--", PY, "-c", script],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)


def pod(run: Path, script: str, *args: str) -> subprocess.Popen:
    """The on-host core of a Kubernetes pod (task 0 of 1), its records in an events file."""
    return subprocess.Popen([PY, "-m", "worker.task.pod", "--run-id", "r1", "--run-dir", str(run), "--hosts", "localhost",
                             "--workers", "1", "--port", str(free_port()), *args, "--", PY, "-c", script],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                            env={**os.environ, "JOB_COMPLETION_INDEX": "0"})


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[bytes, bytes]:
    """Its output once it ended (stdin closed); killed if it does not end in time."""
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


# ---------------------------------------------------------------- 1. what a training writes is untrusted

@pytest.mark.cluster
def test_a_deeply_nested_progress_json_is_no_progress_and_no_crash(tmp_path):
    writes = NESTED + ['{"state": "training", "global_step": 3}']
    script = ("import os, sys, time; p = os.path.join(os.environ['MGPU_RUN_DIR'], 'progress.json')\n"
              f"for text in {writes!r}:\n"
              "    open(p + '.tmp', 'w').write(text); os.replace(p + '.tmp', p); print('wrote', flush=True)\n"
              "    time.sleep(0.4)\n")
    proc = supervised(tmp_path / "task-0", script)
    out, err = finish(proc)
    events = records(out)
    assert proc.returncode == 0 and b"Traceback" not in err, err.decode()
    assert [ev.progress for ev in of_kind(events, protocol.Progress)] == [{"state": "training", "global_step": 3}]
    assert [ev.code for ev in of_kind(events, protocol.Exit)] == [0]


def test_nested_records_and_files_are_bad_records_not_crashes(tmp_path):
    for line in ("[" * 100000, '{"event": "progress", "progress": {"a": ' + "[" * 600 + "]" * 600 + "}}",
                 '{"event": "progress", "progress": {"a": ' + "[" * 40 + "]" * 40 + "}}"):
        with pytest.raises(protocol.BadRecord):
            protocol.decode(line)
    # an events file of this attempt, in the training's folder: read by a Slurm task's signal handler
    events = tmp_path / "task-1" / "events-0.jsonl"
    events.parent.mkdir()
    events.write_text("\n".join(["[" * 100000, *NESTED]) + "\n")
    assert peer_failed(tmp_path, 0) is False
    with events.open("ab") as f:
        f.write(protocol.encode(protocol.Exit(code=3, time=time.time())))
    assert peer_failed(tmp_path, 0) is True
    # a task folder whose progress.json, task.json and exit_code the training wrote: the probe still answers
    task = tmp_path / "task-0"
    task.mkdir()
    (task / "progress.json").write_text("[" * 100000)
    (task / "task.json").write_text('{"pid": 1, "a": ' + "[" * 600 + "]" * 600 + "}")
    (task / "exit_code").write_text("9" * 5000)
    r = subprocess.run([PY, "-m", "worker.task.probe", str(task)], capture_output=True, text=True, cwd=REPO,
                       timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    row = json.loads(r.stdout)[0]
    assert (row["progress"], row["pid"], row["alive"], row["exit_code"]) == (None, None, False, None), row
    (task / "task.json").write_text('{"pid": 1}')  # a pid without its create time names nobody
    assert json.loads(subprocess.run([PY, "-m", "worker.task.probe", str(task)], capture_output=True, text=True,
                                     cwd=REPO, timeout=60).stdout)[0]["alive"] is False


@pytest.mark.parametrize("create_time", ["NaN", "Infinity", "1e400", "-1e308", "null", '"x"'])
def test_a_task_json_that_names_another_process_stops_nothing(tmp_path, create_time):
    """`down` stops a task from its folder by task.json's pids, each with its create time: a time that is
    not the process's (NaN compares false with everything) must never name it."""
    bystander = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    try:
        task = tmp_path / "task-0"
        task.mkdir()
        pid = bystander.pid
        (task / "task.json").write_text(f'{{"pid": {pid}, "create_time": {create_time}, "supervisor_pid": {pid}, '
                                        f'"supervisor_create_time": {create_time}, "pid_too_big": 1e999}}')
        r = subprocess.run([PY, "-m", "worker.task.probe", "--stop", str(task)], capture_output=True, text=True,
                           cwd=REPO, timeout=60)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        assert json.loads(r.stdout)[0]["alive"] is False and bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_up_with_a_nested_progress_json_succeeds_and_status_answers(cli, tmp_path):
    script = (f"import os, time; p = os.path.join(os.environ['MGPU_RUN_DIR'], 'progress.json')\n"
              f"for text in {NESTED!r}:\n"
              "    open(p, 'w').write(text); print('wrote', flush=True); time.sleep(0.4)\n")
    r = cli("up", write_spec(tmp_path, command(script), n=1), timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    s = cli("status", "--json", timeout=60)
    assert s.returncode == 0 and json.loads(s.stdout)["tasks"][0]["state"] == "succeeded", s.stdout + s.stderr
    assert not wait_gone(cli.home, 5)


# ---------------------------------------------------------------- 2. a notice to a task that finishes

def test_a_notice_to_a_task_that_then_exits_0_is_no_preemption(cli, tmp_path):
    script = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
              "print('ready', flush=True); time.sleep(60)")
    spec = write_spec(tmp_path, command(script), n=1, launch="preempt_grace = 5")

    def ready():  # its handler is in place once it said so (the log's first line is its command)
        logs = list(cli.home.glob("runs/*/hosts/*/task-0/worker.log"))
        st = logs and "\nready\n" in logs[0].read_text() and latest_state(cli)
        return st and st["tasks"][0].get("supervisor_pid") and st

    code, out = cli.up_while(spec, ready, lambda up, st: os.kill(st["tasks"][0]["supervisor_pid"], signal.SIGTERM),
                             "the task running")
    assert code == 0 and "Traceback" not in out and "preempted" not in out, out
    st = latest_state(cli)
    assert st["tasks"][0]["state"] == "succeeded" and st["preemptions"] == 0, st
    assert not wait_gone(cli.home, 5)


# ---------------------------------------------------------------- 3. the events file of a scheduler's task

def test_an_events_file_deleted_with_its_folder_is_made_again_and_gets_the_exit(tmp_path):
    script = ("import os, shutil, sys, time; print('before', flush=True); time.sleep(0.5); "
              "shutil.rmtree(os.environ['MGPU_RUN_DIR']); print('after', flush=True); time.sleep(0.5); sys.exit(3)")
    proc = pod(tmp_path, script)
    _out, err = finish(proc)
    assert proc.returncode == 3 and b"Traceback" not in err, err.decode()
    events = records((tmp_path / "task-0" / "events-0.jsonl").read_bytes())
    assert [ev.code for ev in of_kind(events, protocol.Exit)] == [3], events


@pytest.mark.cluster
@needs_root
def test_a_record_torn_by_a_full_disk_does_not_swallow_the_exit(tmp_path):
    with tmpfs(tmp_path / "disk", "1m") as disk:
        script = (f"import os, subprocess, sys, time; print('x' * 100, flush=True); time.sleep(0.5)\n"
                  f"subprocess.run(['dd', 'if=/dev/zero', 'of={disk}/filler', 'bs=4k'], capture_output=True)\n"
                  "for _ in range(3): print('y' * 3000, flush=True); time.sleep(0.3)\n"
                  f"os.unlink('{disk}/filler'); time.sleep(0.3); sys.exit(3)")
        proc = pod(disk, script)
        _out, err = finish(proc)
        assert proc.returncode == 3 and b"Traceback" not in err, err.decode()
        events = records((disk / "task-0" / "events-0.jsonl").read_bytes())
        assert [ev.code for ev in of_kind(events, protocol.Exit)] == [3], events


# ---------------------------------------------------------------- 4. progress writes never end the training

def test_the_progress_writer_makes_a_deleted_folder_again(tmp_path):
    folder = tmp_path / "task-0"
    script = (f"import json, shutil; from worker.training.progress import ProgressWriter; w = ProgressWriter({str(folder)!r})\n"
              f"w.update(force=True, state='training'); shutil.rmtree({str(folder)!r})\n"
              f"w.update(force=True, step=7); print(json.load(open({str(folder / 'progress.json')!r}))['step'])")
    r = subprocess.run([PY, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "7" and not r.stderr, r.stdout + r.stderr
    assert os.listdir(folder) == ["progress.json"]


@needs_root
def test_a_full_disk_never_ends_the_training_and_leaves_no_temporary_file(tmp_path):
    with tmpfs(tmp_path / "disk", "256k") as disk:
        script = (f"import subprocess; from worker.training.progress import ProgressWriter; w = ProgressWriter({str(disk)!r})\n"
                  f"subprocess.run(['dd', 'if=/dev/zero', 'of={disk}/filler', 'bs=4k'], capture_output=True)\n"
                  "for i in range(3): w.update(force=True, state='training', step=i, metrics={'m' * 5000: 1.0})\n"
                  "print('trained on')")
        r = subprocess.run([PY, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == "trained on" and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.count("cannot write") == 1 and str(disk) in r.stderr, r.stderr
        assert sorted(os.listdir(disk)) == ["filler"], os.listdir(disk)  # no temporary file left


# ---------------------------------------------------------------- 5. output is budgeted as it is encoded

def test_non_ascii_output_is_budgeted_on_its_encoded_size(tmp_path):
    script = ("import sys; [print('\u2588' * 1000, flush=True) for _ in range(3000)]; "
              "sys.stdout.write('x' * 60000 + '\\n'); sys.stdout.flush(); sys.exit(3)")
    proc = supervised(tmp_path / "task-0", script)
    out, err = finish(proc)
    assert proc.returncode == 3 and b"Traceback" not in err, err.decode()
    sizes = {kind: [len(line) for line in out.splitlines() if f'"event": "{kind}"'.encode() in line[:40]]
             for kind in ("output", "exit")}
    assert sizes["output"] and max(sizes["output"]) < 16384, sizes["output"]  # one batch: about 8 KB
    assert len(sizes["exit"]) == 1 and sizes["exit"][0] < 10000, sizes["exit"]  # the tail: about 8 KB
    exit_ = of_kind(records(out), protocol.Exit)[0]
    assert exit_.code == 3 and exit_.tail and exit_.tail[-1].startswith("x" * 100), exit_.tail[-1][:100]
    log = (tmp_path / "task-0" / "worker.log").read_text()
    assert log.count("\u2588" * 1000 + "\n") == 3000 and "x" * 60000 in log  # worker.log keeps everything


def test_a_flood_of_block_characters_fails_fast_with_a_bounded_tail(cli, tmp_path):
    script = ("import os, sys, time; i = int(os.environ['MGPU_TASK_INDEX'])\n"
              "if i == 1: [print('\u2588' * 2000, flush=True) for _ in range(2000)]; sys.exit(3)\n"
              "time.sleep(60)")
    r = cli("up", write_spec(tmp_path, command(script)), timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    failure = json.loads(cli("status", "--json", timeout=60).stdout)["failure"]
    assert (failure["task"], failure["exit_code"]) == (1, 3), failure
    assert failure["tail"] and len(json.dumps(failure["tail"])) < 10000, len(json.dumps(failure["tail"]))
    assert not wait_gone(cli.home, 5)


# ---------------------------------------------------------------- 6. the exit code first

def test_exit_code_is_written_before_a_send_that_blocks(tmp_path):
    """Nobody reads the core's records (a cut-off SSH host): the flood fills its pipe, the last progress (30 KB)
    blocks in the send, and the exit code is on disk all the same."""
    script = ("import json, os, sys; [print('z' * 200, flush=True) for _ in range(20000)]\n"
              "open(os.path.join(os.environ['MGPU_RUN_DIR'], 'progress.json'), 'w').write("
              "json.dumps({'state': 'training', 'global_step': 1, 'note': 'n' * 30000})); sys.exit(5)")
    proc = supervised(tmp_path / "task-0", script)
    try:
        code = tmp_path / "task-0" / "exit_code"
        wait_for(lambda: code.exists() and code.read_text() == "5\n", 30, "exit_code 5 while the core's sends block")
    finally:
        finish(proc)  # reads what the core sends: it ends
    assert proc.returncode == 5


# ---------------------------------------------------------------- 7. a notice learned from a peer

def test_a_peers_notice_in_progress_json_makes_a_kill_at_the_end_of_grace_a_preemption(tmp_path):
    script = ("import json, os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "open(os.path.join(os.environ['MGPU_RUN_DIR'], 'progress.json'), 'w').write("
              "json.dumps({'state': 'preempting', 'time': time.time()})); print('saving', flush=True); time.sleep(60)")
    proc = pod(tmp_path, script, "--preempt-grace", "0.5")
    _out, err = finish(proc)
    assert proc.returncode == protocol.EXIT_PREEMPTED and b"Traceback" not in err, (proc.returncode, err.decode())
    exit_ = of_kind(records((tmp_path / "task-0" / "events-0.jsonl").read_bytes()), protocol.Exit)[0]
    assert exit_.code == -signal.SIGKILL and "SIGTERM" in exit_.notice, exit_
    started = of_kind(records((tmp_path / "task-0" / "events-0.jsonl").read_bytes()), protocol.Started)[0]
    assert gone(started.pid)


# ---------------------------------------------------------------- 8. a user's mistake is one paragraph

@pytest.mark.parametrize("name, value", [("TF_CONFIG", "{bad"), ("TF_CONFIG", '{"task": {"index": "x"}}'),
                                         ("MGPU_TASK_INDEX", "first"), ("MGPU_PROGRESS_INTERVAL", "soon"),
                                         ("MGPU_PROGRESS_INTERVAL", "-1")])
def test_a_bad_environment_variable_is_exit_2_naming_it(tmp_path, name, value):
    r = subprocess.run([PY, "-m", "worker", "--entrypoint", "worker.examples.digits:task"], capture_output=True,
                       text=True, cwd=tmp_path, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO), "MGPU_RUN_DIR": str(tmp_path / "task-0"),
                            name: value})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"worker: error: {name} ") and len(r.stderr.strip().splitlines()) == 1, r.stderr


# ---------------------------------------------------------------- 9, 10, 12: the host, the folder, early signals

def test_a_hung_nvidia_smi_is_no_gpu_information_not_a_crash(tmp_path, monkeypatch):
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\nexec sleep 30\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    from worker.host.devices import nvidia_smi

    started = time.monotonic()
    assert nvidia_smi("index", timeout=0.5) is None and time.monotonic() - started < 10


def test_one_folder_step_that_fails_skips_none_of_the_others(tmp_path):
    task = tmp_path / "task-0"
    (task / "exit_code").mkdir(parents=True)  # a stale file that cannot be removed (the first of them)
    (task / "exit_code" / "x").write_text("")
    (task / "progress.json").write_text('{"state": "done"}')  # an earlier attempt's
    proc = supervised(task, "import sys; print('trained', flush=True); sys.exit(4)")
    out, err = finish(proc)
    assert proc.returncode == 4 and b"Traceback" not in err, err.decode()
    assert not (task / "progress.json").exists() and "trained" in (task / "worker.log").read_text()
    events = records(out)
    assert [ev.code for ev in of_kind(events, protocol.Exit)] == [4]
    assert [ev.text for ev in of_kind(events, protocol.Note) if "exit_code" in ev.text], events


def test_a_notice_before_the_task_starts_starts_nothing_and_is_a_preemption(tmp_path):
    marker = tmp_path / "ran"
    proc = supervised(tmp_path / "task-0", f"open({str(marker)!r}, 'w')", env_stdin=True)
    try:
        def handles_term() -> bool:  # our handlers are in place (SigCgt), the environment not sent yet
            status = Path(f"/proc/{proc.pid}/status").read_text()
            caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt")), 16)
            return bool(caught & (1 << (signal.SIGTERM - 1)))

        wait_for(handles_term, 30, "the supervisor's signal handlers")
        proc.send_signal(signal.SIGTERM)
        proc.stdin.write(json.dumps({"MGPU_RUN_ID": "r"}).encode() + b"\n")
        proc.stdin.flush()
        out, err = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == protocol.EXIT_PREEMPTED and b"Traceback" not in err, (proc.returncode, err.decode())
    events = records(out)
    assert not of_kind(events, protocol.Started) and not marker.exists(), events
    exit_ = of_kind(events, protocol.Exit)[0]
    assert exit_.code == protocol.EXIT_PREEMPTED and exit_.notice == "SIGTERM", exit_


def test_a_hosts_probe_row_is_read_field_by_field():
    """What a host's probe says is untrusted: each field of the wrong kind is not known, the rest stands."""
    from worker.host.probed import ProbeRow

    row = ProbeRow.parse(json.loads('{"pid": "1", "alive": 1, "exit_code": -9, "cpu_percent": NaN, "rss": -5, '
                                    '"progress": [1], "gpus": [{"index": 0, "util": 50, "memory_used": 1, '
                                    '"memory_total": 2}, "x", {"index": 1}], "state": "' + "p" * 5000 + '", '
                                    '"job": {"id": "7"}, "time": 1e400}'))
    assert (row.pid, row.alive, row.exit_code, row.cpu_percent, row.rss, row.progress) == (None, False, -9, None,
                                                                                          None, None)
    assert [g.index for g in row.gpus or []] == [0] and row.state is None and row.job == {"id": "7"}
    assert row.time is None and ProbeRow.parse([1]).error and ProbeRow.parse(row.to_json()) == row
