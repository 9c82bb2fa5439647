"""Each restart's phases, told: a real 2-task digits run on this machine, kill -9 of task 1 mid-run; the
restarted attempt's phases in `status --json`, one line on screen, the summary's cost of restarts, `report`."""

import json
import os
import signal
from pathlib import Path

import pytest

from conftest import DIGITS, latest_state, need, status_json, write_spec
from launcher.diagnose import report, series

PARTS = ("detected_s", "teardown_s", "spawn_s", "first_step_s", "took_s")


def progress(task: dict) -> dict:
    try:
        return json.loads((Path(task["run_dir"]) / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def past_a_checkpoint(cli):
    """Both tasks trained past step 6 (a checkpoint every 3 steps, so one was saved)."""
    st = latest_state(cli)
    if st and st["state"] == "running" and all(progress(t).get("global_step", 0) >= 6 for t in st["tasks"]):
        return st
    return None


@pytest.mark.parametrize("standby", [True, False], ids=["standby", "cold"])
def test_a_restart_is_measured_in_phases_and_told(cli, tmp_path, standby):
    spec = write_spec(tmp_path, DIGITS + "\nepochs = 3\nsteps_per_epoch = 12\nbatch_size_per_replica = 8\n"
                      "checkpoint_every_steps = 3", launch=f"max_restarts = 1\nstandby = {str(standby).lower()}",
                      each="cpus = [{i}]\n",
                      env='TF_CPP_MIN_LOG_LEVEL = "2", MGPU_PROGRESS_INTERVAL = "0.1"')
    code, out = cli.up_while(spec, lambda: past_a_checkpoint(cli),
                             lambda _up, st: os.kill(st["tasks"][1]["pid"], signal.SIGKILL),
                             "both tasks past step 6", ready_timeout=300, timeout=300)
    assert code == 0, out

    snap = status_json(cli)
    first, second = snap["attempts"]
    assert {"spawn_s", "first_step_s"} <= set(first["phases"]) and "detected_s" not in first["phases"], first
    ph = second["phases"]
    assert set(PARTS) <= set(ph) and "steps_redone" in ph and "failed_at" not in ph, (ph, out)
    assert all(ph[k] >= 0 for k in PARTS) and ph["steps_redone"] >= 0, ph
    assert ph["resumed_step"] >= 3 and ph["resumed_step"] % 3 == 0, ph  # from a checkpoint, not from scratch
    # the parts happen one after the other within the restart (the gaps between them are small, not asserted)
    assert ph["detected_s"] + ph["teardown_s"] + ph["spawn_s"] + ph["first_step_s"] <= ph["took_s"] + 0.5, ph
    # back where it failed: at or after the first step, the steps redone counted from the step it had reached
    assert ph["back_s"] >= ph["took_s"] and ph["reached_step"] - ph["resumed_step"] == ph["steps_redone"], ph
    assert ph["reached_step"] >= 6, ph

    lines = [line for line in out.splitlines() if "restart 1 took" in line]
    assert len(lines) == 1, out
    print(f"\n{lines[0]}\n{ph}")
    for words in ("detected", "teardown", "spawn", "to first step", "redone"):
        assert words in lines[0], lines[0]
    # said once: in the first step's line where that was the step reached, else in a line of its own
    back = [line for line in out.splitlines() if "restart 1" in line and "back at step" in line]
    assert len(back) == 1 and f"back at step {ph['reached_step']} after {ph['back_s']:.1f} s" in back[0], out
    assert "1 restart(s) cost" in out and "back at the steps reached after" in out, out  # the summary

    rid = snap["run_id"]
    data = series.load(cli.home / "runs" / rid)
    restart = data["restart_phases"][0]
    assert restart["attempt"] == 1 and [p["name"] for p in restart["parts"]] == [
        "detected", "teardown", "spawn", "first step", "steps redone"], restart
    assert any("restart 1 took" in line for line in report.notes(data)), report.notes(data)
    need("matplotlib")
    png = tmp_path / "restart.png"
    r = cli("report", rid, "-o", png, timeout=120)
    assert r.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", r.stderr


# ---------------------------------------------------------------- the phases alone (no training)

def test_phases_of_a_restart_add_up_and_are_told_in_one_line():
    from launcher.run import phases
    from launcher.run.record import Attempt, RunRecord, TaskRecord
    from worker import protocol

    run = RunRecord(run_id="r", spec_path="s", tasks=[TaskRecord(index=i, host="h", address="h", port=1, run_dir="d",
                                                                progress={"global_step": 14}) for i in (0, 1)])
    failed = phases.failed_at(run, 1, protocol.Exit(code=-9, time=100.0), now=100.2)
    carried = phases.ended(failed, 100.2, decided_at=100.2, stopped_at=101.2)
    assert carried == {"teardown_s": 1.0, "failed_at": 100.0, "detected_s": 0.2}
    attempt = Attempt(number=1, started_at=101.3)
    marks = phases.Phases(attempt, carried, phases.reached(run))
    marks.spawn_at = 101.3
    marks.all_started(101.6, 0)
    assert not marks.progress({"global_step": 10, "first_global_step": 10}, 102.0)  # resumed, no step trained yet
    assert marks.progress({"global_step": 11, "first_global_step": 10, "first_step_at": 103.1}, 104.0)
    assert not marks.progress({"global_step": 12, "first_global_step": 10}, 105.0)  # once
    ph = attempt.phases
    assert (ph["spawn_s"], ph["first_step_s"], ph["took_s"], ph["resumed_step"], ph["steps_redone"]) == (
        0.3, 1.5, 3.1, 10, 4), ph
    line = phases.restart_line(1, phases.told(attempt))
    assert line == ("restart 1 took 3.1 s: detected 0.2 s, teardown 1.0 s, spawn 0.3 s, to first step 1.5 s, "
                    "4 step(s) redone"), line
    run.attempts = [Attempt(number=0, started_at=90.0, phases={"spawn_s": 0.2, "first_step_s": 5.0}), attempt]
    assert phases.restarts_words(run).startswith("1 restart(s) cost 3.1 s in all"), phases.restarts_words(run)
    # a host's clock far off does not make up a phase: the launcher's time stands in
    assert phases.failed_at(run, 1, protocol.Exit(code=-9, time=5000.0), now=100.2) == 100.2


def test_back_at_the_step_reached_is_when_the_group_trained_again_to_where_it_failed():
    from launcher.run import phases
    from launcher.run.record import Attempt, RunRecord, TaskRecord

    run = RunRecord(run_id="r", spec_path="s", tasks=[TaskRecord(index=i, host="h", address="h", port=1, run_dir="d",
                                                                progress={"global_step": 30}) for i in (0, 1)])
    first = phases.Phases(Attempt(number=0, started_at=90.0), {}, 0)
    for g, t in ((20, 99.0), (30, 99.5), (30, 99.6)):  # read every 0.5 s, 20 steps a second; a task's repeat
        first.progress({"global_step": g, "first_global_step": 0, "time": t, "steps_per_epoch": 50, "epochs": 2},
                       t + 0.1)
    first.detected, first.decided_at = (100.0, 100.05), 100.1  # failed() at these times
    carried = first.ended(100.2)  # its step at the failure: 30 read, 10 more at the rate between the reads
    assert carried["reached_step"] == 40 and carried["failed_at"] == 100.0, carried

    attempt = Attempt(number=1, started_at=100.3)
    marks = phases.Phases(attempt, carried, phases.reached(run))
    marks.spawn_at = 100.3
    marks.all_started(100.4, 2)
    assert attempt.phases["reached_step"] == 40
    mark = marks.progress({"global_step": 36, "first_global_step": 35, "first_step_at": 103.0, "time": 103.2}, 103.3)
    assert mark is phases.Mark.FIRST_STEP and attempt.phases["steps_redone"] == 5 and "back_s" not in attempt.phases
    assert marks.progress({"global_step": 44, "first_global_step": 35, "time": 104.0}, 104.1) is phases.Mark.BACK
    assert attempt.phases["back_s"] == 3.5, attempt.phases  # step 40 half-way from 36 (its first, at 103.0) to 44
    assert marks.progress({"global_step": 50, "first_global_step": 35, "time": 104.5}, 104.6) is None  # once
    ph = phases.told(attempt)
    assert phases.restart_line(1, ph).endswith("5 step(s) redone; back at step 40 after 3.5 s"), ph
    assert phases.back_line(1, ph).startswith("restart 1: back at step 40 after 3.5 s"), phases.back_line(1, ph)
    run.attempts = [Attempt(number=0, started_at=90.0), attempt]
    assert phases.restarts_words(run).endswith("back at the steps reached after 3.5 s in all")

    # resumed at the step reached (a crash just after a save): back at its first step
    again = Attempt(number=1, started_at=100.3)
    marks = phases.Phases(again, {**carried, "reached_step": 35}, 30)
    marks.spawn_at = 100.3
    marks.all_started(100.4, 2)
    assert marks.progress({"global_step": 36, "first_global_step": 35, "first_step_at": 103.0, "time": 103.2},
                          103.3) is phases.Mark.FIRST_STEP
    assert again.phases["back_s"] == again.phases["took_s"] == 3.0, again.phases

    # carried forward at most EXTRAPOLATE_MAX_S (a task that stopped stepping long before: a hang), never past the end
    hung = phases.Phases(Attempt(number=0, started_at=0.0), {}, 0)
    for g, t in ((10, 1.0), (20, 2.0)):
        hung.progress({"global_step": g, "time": t, "steps_per_epoch": 50, "epochs": 2}, t)
    assert hung.step_at(60.0) == 20 + 10 * phases.EXTRAPOLATE_MAX_S
    assert hung.step_at(2.0) == 20 and hung.step_at(1.0) == 20  # never behind what was read
    for g, t in ((95, 3.0), (99, 3.1)):
        hung.progress({"global_step": g, "time": t, "steps_per_epoch": 50, "epochs": 2}, t)
    assert hung.step_at(4.0) == 100
    # a record without a time (a script's own) still marks the first step, and no back
    plain = Attempt(number=1, started_at=0.0)
    marks = phases.Phases(plain, carried, 30)
    assert marks.progress({"global_step": 41, "first_global_step": 35}, 5.0) is phases.Mark.FIRST_STEP
    assert "back_s" not in plain.phases and marks.progress({"global_step": 50, "first_global_step": 35}, 6.0) is None
    # an attempt that failed before any step it told (its start) has no step to be back at
    started = Attempt(number=1, started_at=0.0)
    marks = phases.Phases(started, {k: v for k, v in carried.items() if k != "reached_step"}, 0)
    assert marks.progress({"global_step": 1, "first_global_step": 0, "first_step_at": 4.0, "time": 4.5}, 5.0) \
        is phases.Mark.FIRST_STEP
    assert "back_s" not in started.phases and "back" not in phases.restart_line(1, phases.told(started))


def test_the_report_places_each_restarts_phases_and_leaves_out_damaged_ones():
    t0 = 1000.0
    run = {"run_id": "20991231-235959-dead", "state": "succeeded", "created_at": t0, "ended_at": t0 + 40,
           "phases": {"preflight_s": 0.1, "spawn_started": t0 + 1, "all_started": t0 + 1.3, "first_step": t0 + 7,
                      "end": t0 + 39},
           "attempts": [{"number": 0, "started_at": t0 + 1, "ended_at": t0 + 16, "outcome": "failed",
                         "phases": {"spawn_s": 0.3, "first_step_s": 5.7}},
                        {"number": 1, "started_at": t0 + 16.1, "ended_at": t0 + 39, "outcome": "succeeded",
                         "phases": {"failed_at": t0 + 14.8, "detected_s": 0.2, "teardown_s": 1.0, "spawn_s": 0.3,
                                    "first_step_s": 2.0, "took_s": 3.6, "steps_redone": 3, "resumed_step": 40,
                                    "bogus": "x"}}],
           "tasks": []}
    data = series.build(run, [])
    (restart,) = data["restart_phases"]
    spans = {p["name"]: (round(p["start"], 3), round(p["end"], 3)) for p in restart["parts"]}
    assert spans == {"detected": (14.8, 15.0), "teardown": (15.0, 16.0), "spawn": (16.1, 16.4),
                     "first step": (16.4, 18.4)}, spans
    assert "bogus" not in restart["phases"] and "failed_at" not in restart["phases"]
    assert restart["line"].startswith("restart 1 took 3.6 s: detected 0.2 s") and "3 step(s) redone" in restart["line"]
    assert restart["line"] in report.notes(data)
