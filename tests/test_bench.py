"""The bench package works: `python bench/run.py --quick` (= `python -m bench --quick`) runs every
benchmark of the quick mode and writes its table, plot and raw data (no timing asserted)."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, wait_gone

QUICK = ("`mgpu-cluster --help`", "launcher overhead", "`check` of 50 local tasks", "scaling, 2 workers / 1",
         "failure detection, local", "restart cost, local, standby on")
SKIPPED = ("launch scaling over SSH", "`status --json`, 16 SSH hosts", "peer: Ray Train",  # not in quick mode
           "restart cost, over SSH")


@pytest.mark.cluster
def test_quick_bench_writes_table_plot_and_numbers(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "bench" / "run.py"), "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr

    table = (tmp_path / "results.md").read_text()
    assert "| figure | ours | baseline | ratio | target | met? |" in table
    assert "failed:" not in table, table  # every benchmark of the quick mode ran
    for title in SKIPPED:
        assert f"| {title} | - | - | - |" in table and f"{title}: skipped: quick mode" in table, title

    raw = json.loads((tmp_path / "out" / "results.json").read_text())
    assert raw["quick"] is True
    for title in QUICK:  # each produced numbers: ours, its baseline (failure's is TensorFlow's, not in quick)
        row = next((row for row in raw["rows"] if row["figure"].startswith(title)), None)
        assert row and row["ours"]["values"], (title, raw["rows"])
        assert "failure" in title or (row["baseline"]["values"] and row["ratio"]["values"]), row

    png = (tmp_path / "results.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert not wait_gone(tmp_path / "out" / "mgpu-home", 10)  # the bench left no task running


def test_module_entry_and_unknown_name():
    r = subprocess.run([sys.executable, "-m", "bench", "--only", "help,nope"], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 2 and "unknown benchmark(s) ['nope']" in r.stderr, r.stderr
