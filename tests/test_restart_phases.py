"""Each restart's phases, told: a real 2-task digits run on this machine, kill -9 of task 1 mid-run; the
restarted attempt's phases in `status --json`, one line on screen, the summary's cost of restarts, `report`."""

import pytest

from conftest import Cli, need, reap, run_processes, status_json
from shared_runs import restarted
from launcher.diagnose import report, series

PARTS = ("detected_s", "teardown_s", "spawn_s", "first_step_s", "took_s")


@pytest.fixture(params=[True, False], ids=["standby", "cold"])
def restart(request, tmp_path):
    """A run whose task 1 was killed with SIGKILL in epoch 2 and restarted from a checkpoint: with standbys, the
    session's shared run; without, one of its own."""
    if request.param:
        yield request.getfixturevalue("restart_run")
        return
    cli = Cli(tmp_path / "mgpu-home", tmp_path)
    try:
        yield restarted(cli, tmp_path, standby=False)
    finally:
        left = reap(run_processes(cli.home))
        assert not left, f"processes left running after the test: {left}"


@pytest.mark.cluster
def test_a_restart_is_measured_in_phases_and_told(restart, tmp_path):
    cli, out = restart.cli, restart.out
    snap = status_json(cli, restart.run_id)
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
    # estimates are named in --json and said "about" on screen: the step reached where it was carried forward
    # past the last read (then the steps redone and the time back there too), the time back where it fell between
    # two reads; measured figures are not
    est = ph["estimated"]
    assert set(est) <= {"reached_step", "steps_redone", "back_s"} and first["phases"]["estimated"] == [], ph
    assert ("steps_redone" in est) == ("reached_step" in est) and ("reached_step" not in est or "back_s" in est), ph
    about = {k: "about " if k in est else "" for k in ("reached_step", "steps_redone", "back_s")}
    assert f"{about['steps_redone']}{ph['steps_redone']} step(s) redone" in lines[0], lines[0]
    # said once: in the first step's line where that was the step reached, else in a line of its own
    back = [line for line in out.splitlines() if "restart 1" in line and "back at " in line]
    words = f"back at {about['reached_step']}step {ph['reached_step']} after {about['back_s']}{ph['back_s']:.1f} s"
    assert len(back) == 1 and words in back[0], out
    assert ("about" in back[0]) == bool(est) and ("about" in lines[0]) == ("steps_redone" in est or (back == lines and bool(est))), out
    assert "1 restart(s) cost" in out and "back at the steps reached after" in out, out  # the summary
    summary = next(line for line in out.splitlines() if "1 restart(s) cost" in line)
    assert f"{about['steps_redone']}{ph['steps_redone']} step(s) redone" in summary, summary
    assert f"back at the steps reached after {about['back_s']}{ph['back_s']:.1f} s" in summary, summary

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
    from worker.host import protocol

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
                    "other 0.1 s, 4 step(s) redone"), line  # the parts follow each other: what they leave is named
    run.attempts = [Attempt(number=0, started_at=90.0, phases={"spawn_s": 0.2, "first_step_s": 5.0}), attempt]
    assert phases.restarts_words(run).startswith("1 restart(s) cost 3.1 s in all"), phases.restarts_words(run)
    # a host's clock far off does not make up a phase: the launcher's time stands in
    assert phases.failed_at(run, 1, protocol.Exit(code=-9, time=5000.0), now=100.2) == 100.2
    # a task lost (no exit report: its host gone, or Slurm's KillWait) ended after it last progressed, not when
    # the launcher gave up on it
    run.tasks[1].heartbeat = 95.0
    assert phases.failed_at(run, 1, protocol.Lost("its job ended with no exit report"), now=100.2) == 95.0


def test_back_at_the_step_reached_is_when_the_group_trained_again_to_where_it_failed():
    from launcher.run import phases
    from launcher.run.record import Attempt, RunRecord, TaskRecord

    run = RunRecord(run_id="r", spec_path="s", tasks=[TaskRecord(index=i, host="h", address="h", port=1, run_dir="d",
                                                                progress={"global_step": 30}) for i in (0, 1)])
    first = phases.Phases(Attempt(number=0, started_at=90.0), {}, 0)
    # read every 0.5 s, 20 steps a second; the other task's record at the same step (the tasks step together)
    for task, g, t in ((0, 20, 99.0), (0, 30, 99.5), (1, 30, 99.6)):
        first.progress({"task": task, "global_step": g, "first_global_step": 0, "time": t, "step": g,
                        "steps_per_epoch": 50, "epochs": 2}, t + 0.1)
    first.detected, first.decided_at = (100.0, 100.05), 100.1  # failed() at these times
    carried = first.ended(100.2)  # its step at the failure: 30 read, 10 more at the rate between the reads
    assert carried["reached_step"] == 40 and carried["failed_at"] == 100.0, carried
    assert carried["estimated"] == ["reached_step"], carried  # carried forward: an estimate

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
    assert ph["estimated"] == ["reached_step", "steps_redone", "back_s"], ph  # all three from the carried step
    assert phases.restart_line(1, ph).endswith("about 5 step(s) redone; back at about step 40 after about 3.5 s"), ph
    assert phases.back_line(1, ph).startswith("restart 1: back at about step 40 after about 3.5 s"), ph
    run.attempts = [Attempt(number=0, started_at=90.0), attempt]
    assert phases.restarts_words(run).startswith("1 restart(s) cost the run about 3.5 s in all (back at the steps "
                                                 "reached after about 3.5 s"), phases.restarts_words(run)
    assert phases.restarts_words(run).endswith("then about 5 step(s) redone)"), phases.restarts_words(run)

    # resumed at the step reached (a crash just after a save): back at its first step
    again = Attempt(number=1, started_at=100.3)
    marks = phases.Phases(again, {**carried, "reached_step": 35}, 30)
    marks.spawn_at = 100.3
    marks.all_started(100.4, 2)
    assert marks.progress({"global_step": 36, "first_global_step": 35, "first_step_at": 103.0, "time": 103.2},
                          103.3) is phases.Mark.FIRST_STEP
    assert again.phases["back_s"] == again.phases["took_s"] == 3.0, again.phases
    assert phases.told(again)["estimated"] == [], again.phases  # the step it saved at: measured, so is its time
    assert phases.restart_line(1, phases.told(again)).endswith("0 step(s) redone; back at step 35 after 3.0 s")

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


def test_a_step_is_an_estimate_only_where_it_was_carried_forward_never_over_validation():
    from launcher.run import phases
    from launcher.run.record import Attempt

    def attempt(records, failure_at=20.0):
        """An attempt that read `records` (task, global step, step, time[, state]), failing at `failure_at`: what it
        carries."""
        marks = phases.Phases(Attempt(number=0, started_at=0.0), {}, 0)
        for task, g, s, t, *state in records:
            marks.progress({"task": task, "global_step": g, "step": s, "first_global_step": 0, "time": t,
                            "steps_per_epoch": 22, "epochs": 10, "state": (state or ["training"])[0]}, t)
        marks.detected, marks.decided_at = (failure_at, failure_at), failure_at
        return marks.ended(failure_at + 1)

    # training: the step read, carried forward at the rate between the last two reads: an estimate
    carried = attempt([(0, 112, 2, 18.0), (0, 122, 12, 19.0)])
    assert carried["reached_step"] == 132 and carried["estimated"] == ["reached_step"], carried
    # never past its epoch's last step: validation (and its save) follow it, not the next epoch's steps
    carried = attempt([(0, 120, 10, 18.0), (0, 130, 20, 19.0)])
    assert carried["reached_step"] == 132 and carried["estimated"] == ["reached_step"], carried
    # read at the epoch's last step: what follows is validation, which trains no step: measured, unmarked
    carried = attempt([(0, 122, 12, 18.0), (0, 132, 22, 19.0), (1, 132, 22, 19.1)])
    assert carried["reached_step"] == 132 and "estimated" not in carried, carried
    # validating after a read mid-epoch: the task's records at the step it told before, written later
    carried = attempt([(0, 120, 10, 18.0), (0, 130, 20, 19.0), (1, 130, 20, 19.1), (0, 130, 20, 19.5)])
    assert carried["reached_step"] == 130 and "estimated" not in carried, carried
    # saved on a notice (a preemption): the group stopped at the step it saved, whenever its exit came
    carried = attempt([(0, 112, 2, 18.0), (0, 122, 12, 19.0), (0, 124, 14, 19.2, "preempted")])
    assert carried["reached_step"] == 124 and "estimated" not in carried, carried
    carried = attempt([(0, 112, 2, 18.0), (1, 122, 12, 19.0), (0, 122, 12, 19.2, "preempted")])
    assert carried["reached_step"] == 122 and "estimated" not in carried, carried
    # the failure right at a read: nothing carried, nothing estimated
    carried = attempt([(0, 112, 2, 18.0), (0, 122, 12, 19.0)], failure_at=19.0)
    assert carried["reached_step"] == 122 and "estimated" not in carried, carried

    # the restart of one killed in validation (the record said 132, it resumed at 132): all measured, unmarked
    resumed = Attempt(number=1, started_at=21.0)
    marks = phases.Phases(resumed, attempt([(0, 122, 12, 18.0), (0, 132, 22, 19.0)]), 132)
    marks.spawn_at = 21.0
    marks.all_started(21.5, 0)
    assert marks.progress({"global_step": 133, "first_global_step": 132, "first_step_at": 23.0, "time": 23.1},
                          23.2) is phases.Mark.FIRST_STEP
    ph = phases.told(resumed)
    assert (ph["reached_step"], ph["steps_redone"], ph["back_s"], ph["estimated"]) == (132, 0, 3.0, []), ph
    assert phases.restart_line(1, ph).endswith("0 step(s) redone; back at step 132 after 3.0 s"), ph
    assert "about" not in phases.restart_line(1, ph)


def test_an_epoch_saved_before_a_restart_whose_line_never_came_is_listed():
    from launcher.diagnose import series, timeline
    from launcher.diagnose.values import Clock
    from launcher.run import phases
    from launcher.run.record import Attempt

    def record(epoch, step, ends, t, first_epoch=1):
        return {"task": 0, "epoch": epoch, "step": step, "global_step": (epoch - 1) * 22 + step, "steps_per_epoch": 22,
                "epochs": 10, "first_epoch": first_epoch, "first_global_step": (first_epoch - 1) * 22, "time": t,
                "first_step_at": 1.0, "epoch_ends": [{"epoch": e} for e in ends]}

    first = phases.Phases(Attempt(number=0, started_at=0.0), {}, 0)
    first.progress(record(1, 5, [], 2.0), 2.0)
    for epoch in range(2, 7):  # epochs 1-5 told (their lines printed); epoch 6 trained and saved, then the kill
        first.progress(record(epoch, 11, list(range(1, epoch)), 2.0 + epoch), 2.0 + epoch)
    first.progress(record(6, 22, [1, 2, 3, 4, 5], 9.0), 9.0)
    first.detected, first.decided_at = (10.0, 10.0), 10.0
    carried = first.ended(11.0)
    assert carried["epoch_told"] == 5, carried

    restarted = Attempt(number=1, started_at=11.0)
    marks = phases.Phases(restarted, carried, 132)
    assert marks.progress(record(7, 1, [], 13.0, first_epoch=7), 13.0) is phases.Mark.FIRST_STEP
    ph = phases.told(restarted)
    assert ph["epochs_unprinted"] == [6], ph
    line = phases.restart_line(1, ph)
    assert line.endswith("; epoch 6: saved, its line was not printed (attempt 0 ended before it)"), line
    assert "epoch 6" not in phases.restart_line(1, ph, epochs=False)
    # the next restart does not list it again
    marks.progress(record(7, 5, [], 14.0, first_epoch=7), 14.0)
    marks.detected, marks.decided_at = (15.0, 15.0), 15.0
    again = Attempt(number=2, started_at=16.0)
    later = phases.Phases(again, marks.ended(16.0), 140)
    later.progress(record(7, 1, [], 18.0, first_epoch=7), 18.0)
    assert "epochs_unprinted" not in again.phases, again.phases
    # a run that resumed another's checkpoint (its first attempt from epoch 4): the epochs before are not its own
    other = phases.Phases(Attempt(number=0, started_at=0.0), {}, 0)
    other.progress(record(4, 1, [], 2.0, first_epoch=4), 2.0)
    other.detected, other.decided_at = (3.0, 3.0), 3.0
    assert other.ended(4.0)["epoch_told"] == 3

    # the report and the page: the restart event says it (the restart's own line in the notes does not repeat it)
    run = {"run_id": "20991231-235959-dead", "state": "succeeded", "created_at": 0.0, "ended_at": 30.0,
           "attempts": [{"number": 0, "started_at": 1.0, "ended_at": 10.5, "outcome": "failed", "phases": {}},
                        {"number": 1, "started_at": 11.0, "ended_at": 30.0, "outcome": "succeeded",
                         "phases": {**restarted.phases, "epochs_unprinted": [6, "x"]}}], "tasks": []}
    data = series.build(run, [])
    (event,) = [e for e in data["events"] if e["kind"] == "restart"]
    assert event["label"] == ("restart: attempt 1; epoch 6: saved, its line was not printed (attempt 0 ended "
                              "before it)"), event
    assert "epoch 6" not in data["restart_phases"][0]["line"]
    assert timeline.attempts(run, Clock(0.0, 30.0))[1]["unprinted"] == [6]


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

    # a restart whose backup was copied to a host that lacked it (SSH hosts): the copy comes before the spawn
    run["attempts"][1]["phases"].update(copy_s=0.9, copy_bytes=1_000_000)
    (restart,) = series.build(run, [])["restart_phases"]
    spans = {p["name"]: (round(p["start"], 3), round(p["end"], 3)) for p in restart["parts"]}
    assert (spans["backup copy"], spans["spawn"], spans["first step"]) == ((16.1, 17.0), (17.0, 17.3), (17.3, 19.3))
    assert "teardown 1.0 s, backup copy 0.9 s (1.0 MB), spawn 0.3 s" in restart["line"], restart["line"]
