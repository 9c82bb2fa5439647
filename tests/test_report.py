"""The report and the data it draws (launcher.diagnose.series): made-up and damaged records first, then real
two-task digits runs on this machine (a clean one, one with a kill -9 and a restart, a refused one)."""

import json
import math
import os
import socket
import stat

import pytest

from conftest import latest_state, status_json, write_spec
from shared_runs import DIGITS_EPOCHS, RESTART_EPOCHS
from test_dashboard import dashboard, scrape
from launcher.diagnose import report, series
from launcher.errors import ReportError
from launcher.run.progress import typed, without_told
from worker.training.progress import EPOCH_ENDS_KEPT, ProgressWriter

PNG = b"\x89PNG\r\n\x1a\n"
T0 = 1000.0


def made_up_run(**extra) -> dict:
    return {"run_id": "r", "state": "succeeded", "created_at": T0, "ended_at": T0 + 60, "restarts": 1, "preemptions": 1,
            "phases": {"preflight_s": 1.0, "spawn_started": T0 + 1, "all_started": T0 + 2, "first_step": T0 + 6,
                       "end": T0 + 58},
            "attempts": [{"number": 0, "started_at": T0 + 1, "ended_at": T0 + 20, "outcome": "failed",
                          "reason": "task 1 (h1:7001) was killed by SIGKILL.\n    a log line", "failure": {
                              "kind": "killed", "task": 1, "host": "h1", "exit_code": -9, "signal": "SIGKILL",
                              "message": "task 1 (h1:7001) was killed by SIGKILL.\n    a log line"}},
                         {"number": 1, "started_at": T0 + 21, "ended_at": T0 + 40, "outcome": "preempted"},
                         {"number": 2, "started_at": T0 + 41, "ended_at": T0 + 58, "outcome": "succeeded"}],
            "tasks": [{"index": 0, "host": "h0"}, {"index": 1, "host": "h1"}], **extra}


def made_up_history() -> list[dict]:
    rows = []
    for s in range(6, 58):
        attempt = 0 if s < 20 else 1 if s < 40 else 2
        for t in (0, 1):
            ends = [{"epoch": s // 10, "start": T0 + s - 9, "end": T0 + s, "samples_per_sec": 900.0 + s,
                     "loss": 1.0 / s, "metrics": {"accuracy": s / 60, "val_loss": 2.0 / s}}] if s % 10 == 0 else []
            rows.append({"time": T0 + s + 0.5, "task": t, "attempt": attempt, "progress": {
                "time": T0 + s, "epoch": s // 10 + 1, "step": s % 10, "samples_per_sec": 1000.0 + t,
                "compute_ms": 3.0 + t, "wait_ms": 6.0 - t, "loss": 1.0 / s, "state": "training",
                "metrics": {"accuracy": s / 60}, "epoch_ends": ends}})
    return rows


def assert_clean(value) -> None:
    """JSON-ready: no NaN or infinity anywhere, no time before the run began."""
    json.dumps(value, allow_nan=False)
    if isinstance(value, dict):
        for k, v in value.items():
            if k in ("t", "start", "end") and isinstance(v, float):
                assert v >= 0, (k, v)
            assert_clean(v)
    elif isinstance(value, list):
        for v in value:
            assert_clean(v)


# --------------------------------------------------------------------------- made-up data

def test_series_of_made_up_data_has_every_part():
    data = series.build(made_up_run(), made_up_history())
    assert_clean(data)
    assert [p["name"] for p in data["phases"]] == ["preflight", "setup", "spawn", "to first step", "training",
                                                "teardown"]
    assert [(e["kind"], e["label"]) for e in data["events"]] == [
        ("failure", "task 1 on h1 was killed by SIGKILL (exit code -9)"), ("restart", "restart: attempt 1"),
        ("preemption", "preemption: attempt 2")]
    assert data["attempts"][0]["failure"]["exit_code"] == -9 and data["attempts"][0]["failure"]["signal"] == "SIGKILL"
    assert [t["host"] for t in data["tasks"]] == ["h0", "h1"] and all(len(t["points"]) == 52 for t in data["tasks"])
    assert [(e["epoch"], e["task"]) for e in data["group"]["epochs"]] == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0)]
    assert {p["task"] for p in data["group"]["within"]} == {0}  # the group's rate, once
    assert data["startups"][0] == {"attempt": 0, "start": 0.0, "end": 6.0}


def test_restarts_and_failures_are_drawn_with_their_reason_whole_and_the_rate_from_zero(tmp_path):
    reason = "task 1 (h1:7001) was killed by SIGKILL. " + "a long reason that goes on " * 30
    run = made_up_run()
    run["attempts"][0]["reason"] = run["attempts"][0]["failure"]["message"] = reason
    data = series.build(run, made_up_history())
    words = report.notes(data)
    assert all(len(line) <= report.WRAP for line in words)
    assert " ".join(" ".join(words).split()).count(" ".join(reason.split())) == 1, words  # wrapped, never cut
    assert any("own work:" in line for line in words) and any("waiting:" in line for line in words)
    fig = report.figure(data)
    rate = fig.axes[0]
    assert rate.get_ylim()[0] == 0 and rate.get_ylim()[1] > 1000
    assert [t.get_text() for t in rate.texts if t.get_text().startswith("[")] == ["[1]", "[2]", "[3]"]


def test_a_refused_run_is_a_paragraph_and_exit_2_not_empty_axes(tmp_path):
    run = {"run_id": "20250101-000000-abcd", "state": "failed", "created_at": T0, "ended_at": T0 + 1,
           "failure": {"kind": "refused", "message": "port 7001 is in use"}, "phases": {}, "attempts": []}
    data = series.build(run, [])
    assert data["refused"] and not series.build(made_up_run(), [])["refused"]
    with pytest.raises(ReportError) as err:
        report.write(data, tmp_path / "r.png")
    assert err.value.exit_code == 2 and not (tmp_path / "r.png").exists()
    assert str(err.value) == ("run 20250101-000000-abcd ended in its preflight (failed): no task was started, so there "
                              "is nothing to draw. 'mgpu-cluster status 20250101-000000-abcd' tells why.")


def test_report_png_is_owner_only_and_written_whole(tmp_path):
    path = tmp_path / "r.png"
    path.write_bytes(b"old")
    os.chmod(path, 0o644)
    report.write(series.build(made_up_run(), made_up_history()), path)
    assert path.read_bytes()[:8] == PNG and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not [p for p in tmp_path.iterdir() if p.name != "r.png"]  # no temporary file left
    odd = report.write(series.build(made_up_run(), made_up_history()), tmp_path / "r.xyz")
    assert odd.read_bytes()[:8] == PNG
    with pytest.raises(ReportError, match="cannot write the report to"):
        report.write(series.build(made_up_run(), []), tmp_path / "no-such-folder" / "r.png")


def test_startup_is_compressed_and_training_drawn_to_scale():
    forward, inverse = report.squeeze([{"start": 0.0, "end": 30.0}, {"start": 40.0, "end": 50.0}], 100.0)
    assert forward(30.0) + forward(50.0) - forward(40.0) == pytest.approx(report.STARTUP_SHARE * 100)
    assert forward(100.0) == pytest.approx(100.0) and forward(0.0) == 0
    assert forward(35.0) - forward(31.0) == pytest.approx(forward(99.0) - forward(95.0))  # training: one scale
    assert inverse(forward(44.0)) == pytest.approx(44.0)
    assert report.squeeze([{"start": 0.0, "end": 5.0}], 100.0) is None  # already no more than its share


def test_damaged_history_and_record_are_skipped_never_fatal(tmp_path):
    good = made_up_history()[:40]
    bad_rows = [
        {"time": float("nan"), "task": 0, "progress": {}}, {"time": 1e308, "task": 0, "progress": {"time": 1e308}},
        {"time": T0 + 7, "task": -1, "progress": {}}, {"time": T0 + 7, "task": True, "progress": {}},
        {"time": T0 - 50, "task": 0, "progress": {"samples_per_sec": 5.0}},
        {"time": T0 + 8, "task": 0, "attempt": "x", "progress": {
            "time": "soon", "samples_per_sec": 1e300, "compute_ms": -1e13, "loss": "low", "step": -3,
            "metrics": {"acc": float("inf"), "ok": 0.5, 3: [1]}, "epoch_ends": [
                {"epoch": 2, "end": float("nan"), "samples_per_sec": 1e400}, "x", {"epoch": -1, "end": T0 + 8},
                {"epoch": 3, "start": T0 + 9, "end": T0 + 8.5, "samples_per_sec": 10, "loss": None}]}},
        {"time": T0 + 9, "task": 1, "progress": {"epoch_ends": {"epoch": 1}}},
    ]
    lines = [json.dumps(r).encode() for r in good + bad_rows]
    lines[3:3] = [b"\xff\xfe not text", b"{\"time\": NaN, \"progress\": {}}", b"[" * 100_000, b"", b"{\"time\": 1"]
    (tmp_path / "progress.jsonl").write_bytes(b"\n".join(lines))
    run = made_up_run(created_at=T0, restarts="many", hosts_lost=[1, "x", -2], tasks=[{"index": "0"}, 7, {"index": 1}])
    run["attempts"].append({"number": 3, "started_at": float("inf"), "outcome": "exploded", "failure": [1]})
    run["attempts"][1]["failure"] = "an old record's words"
    run["phases"]["first_step"] = "later"
    (tmp_path / "state.json").write_text(json.dumps(run))
    data = series.load(tmp_path, now=T0 + 100)
    assert_clean(data)
    assert data["restarts"] == 0 and data["hosts_lost"] == [1] and len(data["attempts"]) == 3
    assert data["attempts"][1]["failure"]["message"] == "an old record's words"
    points = [p for t in data["tasks"] for p in t["points"]]
    assert len(points) == 40 + 2 and max(p["samples_per_s"] or 0 for p in points) < 1e12
    assert all(p["compute_ms"] is None or p["compute_ms"] >= 0 for p in points)
    assert [e["start"] for e in data["epochs"] if e["epoch"] == 3] == [None]  # a start after its end: none
    assert report.figure(data) is not None
    assert series.build("not a record", ["x", None, 3])["tasks"] == []  # nothing but damage: still a dict


def test_a_history_of_an_older_worker_still_draws_its_epochs():
    """Rows without epoch summaries (before per-epoch rates): an epoch mark where each was seen complete."""
    rows = [{"time": T0 + s, "task": 0, "progress": {"time": T0 + s, "epoch": 1 + s // 10, "step": s % 10 + 1,
                                                     "steps_per_epoch": 10, "state": "training", "loss": 1.0 / s,
                                                     "samples_per_sec": 500.0}} for s in range(6, 40)]
    data = series.build(made_up_run(attempts=[]), rows)
    assert [(e["epoch"], e["samples_per_s"]) for e in data["group"]["epochs"]] == [(n, None) for n in (1, 2, 3, 4)]
    report.figure(data)


def test_the_worker_keeps_recent_epoch_summaries_and_the_history_gets_each_once(tmp_path):
    writer = ProgressWriter(str(tmp_path), interval=0)
    for epoch in range(1, 12):
        writer.update(epoch_samples=1234.5 * 2, epoch_train_s=2.0)
        writer.epoch_end(epoch, 100.0 + epoch, 0.5 / epoch, {"accuracy": 0.9, "val_loss": float("nan")})
    writer.update()
    on_disk = json.loads((tmp_path / "progress.json").read_text())
    ends = typed(on_disk)["epoch_ends"]
    assert [e["epoch"] for e in ends] == list(range(12 - EPOCH_ENDS_KEPT, 12))
    assert ends[-1]["samples_per_sec"] == 1234.5 and ends[-1]["metrics"] == {"accuracy": 0.9}  # NaN: not a number
    assert (ends[-1]["samples"], ends[-1]["train_s"]) == (2469.0, 2.0)
    first = typed(on_disk)
    assert without_told(first, [])["epoch_ends"] == ends
    assert without_told(first, ends)["epoch_ends"] == [] and without_told(first, ends[:-1])["epoch_ends"] == ends[-1:]
    paced = ProgressWriter(str(tmp_path / "paced"), interval=60)
    assert paced.update(force=True) and not paced.update(step=1)
    paced.epoch_end(1, None, None, {})
    assert paced.update(step=2) and not paced.update(step=3)  # an epoch's end at once; the pace as it was
    assert [e["epoch"] for e in json.loads((tmp_path / "paced" / "progress.json").read_text())["epoch_ends"]] == [1]


# --------------------------------------------------------------------------- real runs

def console_rates(out: str) -> dict[int, float]:
    """samples/s of each epoch line the console showed (`epoch 3/4 ... samples/s=1234`): task 0's (alone or merged,
    the chief's rate) where it printed one."""
    lines = [line for line in out.splitlines() if " | epoch " in line and "samples/s=" in line]
    return {int(line.split("epoch ")[1].split("/")[0]): float(line.rsplit("samples/s=", 1)[1].split()[0])
            for line in sorted(lines, key=lambda line: line.startswith("task0"))}  # task 0's last: it stands


def test_report_of_a_real_run_has_each_panels_data(digits_run, tmp_path):
    cli, rid, epochs = digits_run.cli, digits_run.run_id, DIGITS_EPOCHS
    data = series.load(digits_run.record)
    assert_clean(data)
    group = data["group"]["epochs"]
    assert [e["epoch"] for e in group] == list(range(1, epochs + 1)), group
    shown = console_rates(digits_run.out)  # a line alike on both tasks is shown once, with the chief's rate
    for e in group:  # each epoch's own rate, the one its console line showed; loss and metrics at its end
        assert e["task"] == 0 and round(e["samples_per_s"]) == shown[e["epoch"]], (e, shown)
        assert e["start"] < e["t"] and e["loss"] > 0 and 0 <= e["metrics"]["accuracy"] <= 1, e
    assert {(e["task"], e["epoch"]) for e in data["epochs"]} == {(t, n) for t in (0, 1) for n in range(1, epochs + 1)}
    assert all(len(t["points"]) >= epochs for t in data["tasks"]) and data["group"]["within"]
    assert [p["name"] for p in data["phases"]] == ["preflight", "setup", "spawn", "to first step", "training",
                                                "teardown"]
    first_step = data["phases"][3]["end"]
    assert data["startups"] == [{"attempt": 0, "start": 0.0, "end": first_step}]
    assert not data["events"] and data["attempts"][0]["outcome"] == "succeeded"
    points = [p for t in data["tasks"] for p in t["points"]]  # within epochs: means, never sums over the workers
    assert all(p["metrics"].get("accuracy", 0) <= 1 and (p["loss"] or 0) < 2 * math.log(10) for p in points), points

    # one training throughput: the last epoch's console line, status --json, /metrics and the report's data agree
    last = shown[epochs]
    snap = status_json(cli, rid)
    with dashboard(cli) as (_first, url, _port, token):
        scraped = scrape(url, token)
    served = scraped[("mgpu_group_samples_per_second", (("run", rid),))]
    drawn = next(e["samples_per_s"] for e in data["group"]["epochs"] if e["epoch"] == epochs)
    assert round(snap["group"]["samples_per_sec"]) == round(served) == round(drawn) == last, (last, snap["group"],
                                                                                            served, drawn)
    for t in snap["tasks"]:  # each task's own measure, labelled so: near the group's, not the figure shown
        own = scraped[("mgpu_task_samples_per_second", (("run", rid), ("task", str(t["index"]))))]
        assert own == t["samples_per_sec"] > 0, (own, t)

    fig = report.figure(data)
    rate, split, loss, metrics = fig.axes[:4]
    assert rate.get_ylim()[0] == 0 and split.get_ylim()[0] == 0
    assert len(rate.patches) >= epochs  # a bar per epoch (and the shaded start-up)
    for ax in (rate, loss, metrics):  # epoch marks, labelled
        labels = [t.get_text() for t in ax.texts]
        assert all(f"epoch {n}" in labels for n in range(1, epochs + 1)), labels
        marks = {round(line.get_xdata()[0], 3) for line in ax.lines if line.get_linestyle() == ":"}
        assert {e["t"] for e in group} <= marks
    names = loss.get_legend_handles_labels()[1] + metrics.get_legend_handles_labels()[1]
    assert {"loss (epoch)", "val_loss (epoch)", "accuracy (epoch)", "val_accuracy (epoch)"} <= set(names), names
    squeezed = report._squeezed(data)
    if first_step > report.STARTUP_SHARE * data["until"]:  # the start-up takes most of a run this short
        assert squeezed[0](first_step) == pytest.approx(report.STARTUP_SHARE * data["until"], rel=1e-6)
    png = cli("report", rid, timeout=120)
    path = digits_run.record / "report.png"
    assert png.returncode == 0 and png.stdout.strip() == str(path), png.stderr
    assert path.read_bytes()[:8] == PNG and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_report_of_a_run_with_a_kill_9_names_the_signal_and_restarts(restart_run, tmp_path):
    cli, out, epochs = restart_run.cli, restart_run.out, RESTART_EPOCHS  # killed in epoch 2, after a checkpoint
    data = series.load(restart_run.record)
    first, second = data["attempts"]
    assert first["outcome"] == "failed" and second["outcome"] == "succeeded"
    f = first["failure"]
    assert (f["task"], f["exit_code"], f["signal"], f["kind"]) == (1, -9, "SIGKILL", "killed"), f
    kinds = [(e["kind"], e["label"]) for e in data["events"]]
    unprinted = second["unprinted"]  # an epoch saved just before the kill whose line never came: named at the restart
    said = "".join(f"; epoch {n}: saved, its line was not printed (attempt 0 ended before it)" for n in unprinted)
    assert kinds == [("failure", f"task 1 on {f['host']} was killed by SIGKILL (exit code -9)"),
                     ("restart", "restart: attempt 1" + said)] and len(unprinted) <= 1, kinds
    assert [s["attempt"] for s in data["startups"]] == [0, 1]  # the restart's start-up is compressed too
    assert {e["attempt"] for e in data["group"]["epochs"]} == {0, 1}
    # every epoch the console showed, the one just before the kill too (written at its end, read at the exit);
    # an epoch whose checkpoint was saved just before the kill, and whose line never came, is in neither: it is
    # named at the restart, on the console too
    shown = console_rates(out)
    assert {e["epoch"] for e in data["group"]["epochs"]} == set(shown) and {1, epochs} <= set(shown), out
    assert set(shown) | set(unprinted) == set(range(1, epochs + 1)) and not set(shown) & set(unprinted), out
    assert all(f"epoch {n}: saved, its line was not printed" in out for n in unprinted), out
    words = " ".join(" ".join(report.notes(data)).split())
    assert " ".join(f["message"].split()) in words  # the reason, whole
    png = tmp_path / "killed.png"
    r = cli("report", restart_run.run_id, "-o", png, timeout=120)
    assert r.returncode == 0 and png.read_bytes()[:8] == PNG, r.stderr


def test_report_of_a_refused_run_exits_2_naming_the_run(cli, tmp_path):
    spec = write_spec(tmp_path, 'command = ["python3", "-c", "pass"]', n=1)
    port = int(spec.read_text().split("port = ")[1].split()[0])
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        assert cli("up", spec, timeout=120).returncode == 2
    rid = latest_state(cli)["run_id"]
    r = cli("report", rid, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"run {rid} ended in its preflight" in r.stderr and f"'mgpu-cluster status {rid}' tells why" in r.stderr
    assert not (cli.home / "runs" / rid / "report.png").exists()
