"""A run's state from facts that only move forward (a task started, a task ended), taken from events:
the rules on real records (pure), and `up --detach` of a run whose short task ends before its peer starts."""

from __future__ import annotations

import json
import sys
import time

from conftest import latest_state, status_json, write_spec

from launcher.run import watch
from launcher.run.attempt import LiveAttempt
from launcher.run.failure import FailureKind
from launcher.run.record import RunRecord, TaskRecord
from launcher.run.states import TaskState
from launcher.spec.cluster import Launch
from worker.host import protocol

# every task but task 0 ends at once (exit 0); task 0 sleeps
SHORT = "import os, time\nif os.environ['MGPU_TASK_INDEX'] != '0':\n    raise SystemExit(0)\ntime.sleep(20)\n"
DETACHES = 4
# Task 0's interpreter (its host's `python`): its supervisor starts only once the agent has recorded the end of
# every other task, so that each detach meets the race (a task ended before its peer's start was reported) for
# sure, instead of now and then under load; bounded: after 30 s it starts all the same (and the test fails).
LATE_START = """#!{python}
import json, os, sys, time
argv = sys.argv[1:]
if "worker.task.supervised" in argv and os.path.basename(argv[argv.index("--run-dir") + 1].rstrip("/")) == "task-0":
    folder, end = os.path.dirname(argv[argv.index("--run-dir") + 1].rstrip("/")), time.time() + 30
    while not os.path.exists(os.path.join(folder, "state.json")) and folder != os.path.dirname(folder):
        folder = os.path.dirname(folder)
    while time.time() < end:
        try:
            tasks = json.load(open(os.path.join(folder, "state.json")))["tasks"]
            if all(t["ended_at"] for t in tasks[1:]):
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)
os.execv(sys.executable, [sys.executable, *argv])
"""


def record(n: int = 2) -> RunRecord:
    return RunRecord(run_id="20250101-000000-0000", spec_path="cluster.toml", tasks=[
        TaskRecord(index=i, host="localhost", address="127.0.0.1", port=20000 + i, run_dir=f"/tmp/r/task-{i}")
        for i in range(n)])


def started(pid: int) -> protocol.Started:
    return protocol.Started(pid=pid, create_time=1.0, supervisor_pid=pid + 1, time=1.0)


def test_an_end_is_a_start_and_no_fact_moves_back():
    run, live = record(), LiveAttempt(0, [0, 1])
    assert watch.apply(run, live, 1, protocol.Exit(code=0, time=1.0)) is None  # task 1 done before task 0 started
    assert run.task(1).state == TaskState.SUCCEEDED and not live.all_started and live.live == [0]
    assert watch.apply(run, live, 0, started(100)) is None
    assert live.all_started and live.live == [0] and run.task(0).state == TaskState.RUNNING
    watch.apply(run, live, 1, started(200))  # a late report of task 1's start
    assert run.task(1).state == TaskState.SUCCEEDED and live.ended == {1}


def test_a_lost_task_has_started_and_its_failure_names_its_log_from_the_record():
    run, live = record(), LiveAttempt(0, [0, 1])
    run.task(1).host, run.task(1).port = "node7", 20007  # where it landed, as a scheduler said
    failure = watch.apply(run, live, 1, protocol.Lost("its channel ended"))
    assert live.started == {1} and live.ended == {1} and run.task(1).state == TaskState.LOST
    assert failure.kind == FailureKind.LOST and failure.task == 1 and failure.host == "node7"
    assert failure.log == "node7:/tmp/r/task-1/worker.log"
    assert failure.message.startswith("task 1 (node7:20007) was lost: its channel ended.")


def test_a_task_that_never_started_fails_on_start_timeout_and_stays_live_for_the_teardown():
    run, live = record(), LiveAttempt(0, [0, 1], spawned_at=0.0)  # long ago on the monotonic clock
    watch.apply(run, live, 0, started(100))
    failure = watch.overdue(run, live, Launch(start_timeout=5))
    assert failure.kind == FailureKind.NOT_STARTED and failure.task == 1 and "start_timeout = 5 s" in failure.message
    assert run.task(1).state == TaskState.FAILED and live.live == [0, 1]



def test_detach_returns_when_a_short_task_ends_before_its_peer_starts(cli, tmp_path):
    late = tmp_path / "late-python"
    late.write_text(LATE_START.format(python=sys.executable))
    late.chmod(0o755)
    spec = write_spec(tmp_path, f"command = {json.dumps([sys.executable, '-c', SHORT])}", n=3, each="# host {i}\n")
    spec.write_text(spec.read_text().replace("# host 0\n", f'python = "{late}"\n'))  # task 0's host only
    took, ended_first = [], 0
    for _ in range(DETACHES):
        t0 = time.monotonic()
        r = cli("up", "--detach", spec, timeout=120)
        took.append(time.monotonic() - t0)
        try:
            assert r.returncode == 0, r.stdout + r.stderr
            assert "running detached" in r.stdout, r.stdout
            st = status_json(cli)
            assert st["state"] == "running", st
            rec = latest_state(cli)
            assert "all_started" in rec["phases"], rec["phases"]
            tasks = rec["tasks"]  # the record: when the agent took each start and end
            ended_first += any(t["ended_at"] < tasks[0]["started_at"] for t in tasks[1:])
        finally:
            d = cli("down", timeout=120)
        assert d.returncode == 0, d.stdout + d.stderr
    print(f"\n{len(took)} detaches: {min(took):.2f}-{max(took):.2f} s, mean {sum(took) / len(took):.2f} s; in "
          f"{ended_first} a task ended before task 0's start was reported")
    assert ended_first == DETACHES, ended_first  # the race met in every detach
    assert max(took) < 10, took  # the run ends after 20 s: a detach that waits for the end fails here
