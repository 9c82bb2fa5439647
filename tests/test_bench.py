"""The bench command works: `python bench/run.py --quick` writes its table and plot (no timing asserted)."""

import json
import subprocess
import sys

from conftest import REPO, wait_gone


def test_quick_bench_writes_table_and_plot(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "bench" / "run.py"), "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out

    table = (tmp_path / "results.md").read_text()
    assert "| figure | ours | baseline | ratio | target | met? |" in table
    for figure in ("--help", "launcher overhead", "scaling", "failure detection"):
        assert figure in table, figure
    for skipped in ("launch scaling over SSH", "status --json", "Ray Train"):
        assert skipped in table, skipped  # listed as not run in quick mode
    assert "failed:" not in table, table  # every figure of the quick mode ran

    png = (tmp_path / "results.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000

    raw = json.loads((tmp_path / "out" / "results.json").read_text())
    assert raw["quick"] is True
    measured = [row for row in raw["rows"] if "ours" in row]
    assert len(measured) >= 4 and all(row["ours"]["values"] for row in measured)
    assert not wait_gone(tmp_path / "out" / "mgpu-home", 10)  # the bench left no task running
