"""The dashboard's bounds: every answer bounded in bytes and time whatever a run's length or output (a log of
one 300 MB line, a history of hours), and a scrape that costs the live runs, not the 2000 that ended."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import psutil
import pytest

from conftest import Cli, status_json, write_spec
from test_dashboard import dashboard, get
from launcher.diagnose import series

FRAMES = 3_000_000  # "\r" progress frames of 100 bytes each: one line of 300 MB


def ended_run(cli: Cli, tmp_path: Path, said: str = "done") -> tuple[str, Path]:
    """A real one-task run that ended: its id and its task's worker.log."""
    spec = write_spec(tmp_path, f'command = ["python3", "-c", "print({said!r})"]', n=1)
    assert cli("up", spec, timeout=120).returncode == 0
    run = status_json(cli)["run_id"]
    return run, next((cli.home / "runs" / run).glob("**/task-0/worker.log"))


def test_a_log_of_one_300_mb_progress_line_is_a_small_quick_tail(cli, tmp_path):
    run, log = ended_run(cli, tmp_path)
    frame = "\r" + "epoch 1 step {:>9} ".format(0).ljust(99, "=")
    with open(log, "a") as f:  # a task that printed its progress with \r for hours, never a newline
        for n in range(0, FRAMES, 10_000):
            f.write("".join(frame.replace(f"{0:>9}", f"{i:>9}") for i in range(n, n + 10_000)))
    assert log.stat().st_size > 300_000_000
    with dashboard(cli) as (_, url, _, token):
        for _ in range(3):
            started = time.monotonic()
            code, _, body = get(f"{url}/api/runs/{run}/logs", token=token)
            took = time.monotonic() - started
            assert code == 200 and len(body.encode()) < 100_000, len(body)
            assert took < 2.0, f"the tail of a 300 MB line took {took:.1f} s"
        lines = json.loads(body)[0]["lines"]
        assert lines[-1].startswith(f"epoch 1 step {FRAMES - 1:>9} ==") and "\r" not in lines[-1], lines[-1][:200]
        assert lines[-1].endswith("more characters)") or len(lines[-1]) <= 1000
    shown = cli("logs", "-n", "3", run, timeout=60)  # the CLI's tail: bounded too
    assert shown.returncode == 0 and len(shown.stdout) < 1_000_000, len(shown.stdout)


def test_a_scrape_costs_the_live_runs_not_2000_ended_ones(cli, tmp_path):
    run, _ = ended_run(cli, tmp_path)
    record = json.loads((cli.home / "runs" / run / "state.json").read_text())
    for n in range(2000):  # 2000 ended runs' records, as `up` wrote this one
        rid = f"2024{n // 1000 + 1:02d}{n % 28 + 1:02d}-{n % 24:02d}{n % 60:02d}00-{n:04x}"
        folder = cli.home / "runs" / rid
        folder.mkdir(mode=0o700)
        (folder / "state.json").write_text(json.dumps({**record, "run_id": rid}))
    with dashboard(cli) as (_, url, _, token):
        server = next(p for p in psutil.Process().children(recursive=True) if "dashboard" in " ".join(p.cmdline()))
        code, _, text = get(f"{url}/metrics", token=token)  # the first reads every record once
        assert code == 200 and f'run="{run}"' in text, text[:2000]
        before, started = server.cpu_times(), time.monotonic()
        for _ in range(5):
            assert get(f"{url}/metrics", token=token)[0] == 200
        code, _, body = get(f"{url}/api/runs", token=token)
        after, took = server.cpu_times(), time.monotonic() - started
        cpu = (after.user + after.system - before.user - before.system) / 6
        assert cpu < 0.5 and took < 6 * 1.0, f"a scrape of 2001 runs took {cpu:.2f} s of CPU, {took:.1f} s in all"
        listed = json.loads(body)
        assert listed["total"] == 2001 and len(listed["runs"]) == 500 and len(body) < 300_000, len(body)
        assert listed["runs"][0]["run_id"] == run
    print(f"scrape of 2001 runs: {cpu * 1000:.0f} ms of CPU each")


def long_history(hours: float, spike_at: int, t0: float = 1_700_000_000.0) -> list[dict]:
    """Two tasks' progress every second for `hours`, with one spike of samples/s."""
    rows = []
    for s in range(int(hours * 3600)):
        for task in (0, 1):
            rate = 50_000.0 if s == spike_at else 1000.0 + s % 7
            rows.append({"time": t0 + s + 0.2, "task": task, "attempt": 0, "progress": {
                "time": t0 + s, "epoch": s // 600 + 1, "step": s % 600, "samples_per_sec": rate, "loss": 1 / (s + 1),
                "compute_ms": 3.0, "wait_ms": 6.0, "state": "training", "metrics": {"accuracy": 0.5},
                "epoch_ends": []}})
    return rows


def test_a_long_series_is_drawn_from_at_most_1000_points_keeping_its_extremes():
    spike = 5000
    data = series.build({"run_id": "r", "state": "running", "created_at": 1_700_000_000.0,
                         "tasks": [{"index": 0, "host": "h0"}, {"index": 1, "host": "h1"}]}, long_history(3, spike))
    within = data["group"]["within"]
    assert len(within) <= series.POINTS_DRAWN and sum(len(t["points"]) for t in data["tasks"]) <= series.POINTS_DRAWN
    assert max(p["samples_per_s"] for p in within) == 50_000.0  # the spike survives the reduction
    assert min(p["samples_per_s"] for p in within) == 1000.0
    newest = 3 * 3600 - 1 + 0.2  # the last second's progress (the launcher's clock runs 0.2 s after the task's)
    assert within[-1]["t"] == data["tasks"][0]["points"][-1]["t"] == pytest.approx(newest)  # up to the newest
    assert len(json.dumps(data)) < 500_000
    assert series.thin(within, ("samples_per_s",)) == within  # short enough: as it is


def test_a_long_runs_series_answer_is_small(cli, tmp_path):
    run, _ = ended_run(cli, tmp_path)
    state = cli.home / "runs" / run / "state.json"
    record = json.loads(state.read_text())
    record["created_at"] = t0 = record["ended_at"] - 2 * 3600 - 10  # a run of two hours
    state.write_text(json.dumps(record))
    with open(state.parent / "progress.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in long_history(2, 100, t0))
    with dashboard(cli) as (_, url, _, token):
        code, _, body = get(f"{url}/api/runs/{run}/series", token=token)
    assert code == 200 and len(body) < 500_000, len(body)
    assert len(re.findall(r'"samples_per_s"', body)) < 4 * series.POINTS_DRAWN
