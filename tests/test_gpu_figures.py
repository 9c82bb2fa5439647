"""Each task's own GPUs' use and memory: one nvidia-smi call read defensively (a stand-in nvidia-smi first on
PATH prints two GPUs' CSV), the task's CUDA_VISIBLE_DEVICES choosing its GPUs, through a real two-task run's
`status --json --probe` to /metrics' gauges."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest

from conftest import status_json, wait_for, write_spec
from test_dashboard import browser, dashboard, get  # noqa: F401 (browser: a fixture)
from worker.host.devices import GpuFigures, gpu_figures, gpu_indices, nvidia_smi, task_figures, visible_gpus

CSV = "0, 87, 12288, 81559\n1, [N/A], 1024, 81559\n"  # GPU 1's use: not known


def stand_in(folder: Path, figures: str = CSV, code: int = 0) -> Path:
    """An `nvidia-smi` in `folder` answering the two queries asked of it (anything else: exit 9)."""
    folder.mkdir(exist_ok=True)
    (folder / "figures.csv").write_text(figures)
    script = folder / "nvidia-smi"
    script.write_text(f"""#!/bin/sh
case "$1" in
  --query-gpu=index) printf '0\\n1\\n' ;;
  --query-gpu=index,utilization.gpu,memory.used,memory.total) cat '{folder / "figures.csv"}'; exit {code} ;;
  *) exit 9 ;;
esac
""")
    script.chmod(0o755)
    return folder


@pytest.fixture
def smi_path(tmp_path, monkeypatch):
    folder = stand_in(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    return folder


def test_one_call_gives_every_gpus_figures_and_none_for_what_it_does_not_know(smi_path):
    assert gpu_figures() == [GpuFigures(0, 87, 12288, 81559), GpuFigures(1, None, 1024, 81559)]
    assert nvidia_smi("index") == [0, 1] and gpu_indices() == {0, 1}  # the preflight's callers, as before


@pytest.mark.parametrize("text, expected", [
    ("0, [Not Supported], [N/A], [N/A]\n", [GpuFigures(0, None, None, None)]),
    ("garbage\n\n[N/A], 3, 4, 5\n1, 2, 3\n2, -5, 1e3, ７\n", [GpuFigures(2, None, None, None)]),
    ("0, 1, 2, 3\n0, 9, 9, 9\n", [GpuFigures(0, 1, 2, 3)]),  # an index told twice: the first
    ("3, 99999999999999999999, 1, 2\n", [GpuFigures(3, None, 1, 2)]),  # no figure nvidia-smi gives
])
def test_untrusted_output_gives_only_whole_figures(tmp_path, monkeypatch, text, expected):
    monkeypatch.setenv("PATH", f"{stand_in(tmp_path / 'bin', text)}:{os.environ['PATH']}")
    assert gpu_figures() == expected


def test_a_failing_or_missing_nvidia_smi_is_no_figures(tmp_path, monkeypatch):
    failing = stand_in(tmp_path / "bin", "NVIDIA-SMI has failed\n", code=9)
    monkeypatch.setenv("PATH", f"{failing}:{os.environ['PATH']}")
    assert gpu_figures() is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert gpu_figures() is None


@pytest.mark.parametrize("value, seen", [
    (None, [0, 1, 2]), ("", []), ("-1", []), ("1", [1]), ("2,0", [2, 0]), ("1,1", [1]),
    ("0,GPU-8a3f,2", [0]), ("7,1", [1]), (" 1 , 2", [1, 2]), ("x", []),
])
def test_cuda_visible_devices_chooses_the_gpus_as_cuda_reads_it(value, seen):
    assert visible_gpus(value, [0, 1, 2]) == seen


def test_a_task_without_gpus_or_nvidia_smi_has_none():
    figures = [GpuFigures(0, 1, 2, 3), GpuFigures(1, 4, 5, 6)]
    assert task_figures(figures, "1") == [GpuFigures(1, 4, 5, 6)]
    assert task_figures(figures, "") is None and task_figures(None, None) is None and task_figures([], None) is None


def test_each_task_of_a_host_shows_its_own_gpus_in_status_the_page_and_metrics(cli, tmp_path, browser):
    """A live run: each task's supervisor relays its own GPUs' figures (status, the page at 1280 and 390 px and
    the dashboard's /metrics, with no probe of any host), and a probe of its host reads the same."""
    from prometheus_client.parser import text_string_to_metric_families

    folder = stand_in(tmp_path / "bin")
    cli.env["PATH"] = f"{folder}:{cli.env['PATH']}"  # the launcher's, inherited by its local tasks and probes
    sleep = json.dumps([sys.executable, "-c", "import time; time.sleep(60)"])
    spec = write_spec(tmp_path, f"command = {sleep}", each="gpus = [{i}]\n")
    r = cli("up", "--detach", spec, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    mine = {0: [{"index": 0, "util": 87, "memory_used": 12288, "memory_total": 81559}],
            1: [{"index": 1, "util": None, "memory_used": 1024, "memory_total": 81559}]}  # GPU 1's use: not known
    try:
        relayed = wait_for(lambda: (s := status_json(cli)) and all(t["gpus"] for t in s["tasks"]) and s,
                           60, "both tasks' GPU figures, relayed by their supervisors")
        assert {t["index"]: t["gpus"] for t in relayed["tasks"]} == mine, relayed["tasks"]
        probed = status_json(cli, "--probe")
        assert {t["index"]: t["gpus"] for t in probed["tasks"]} == mine, probed["tasks"]

        run = relayed["run_id"]
        with dashboard(cli) as (_first, url, _port, token):
            code, _, text = get(f"{url}/metrics", token=token)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{url}/?token={token}")
            page.goto(f"{url}/runs/{run}")
            page.wait_for_selector('[data-task="1"] .gpus', timeout=15_000)
            for width in (1280, 390):
                page.set_viewport_size({"width": width, "height": 900})
                shown = {0: "0: 87% · 12.0/79.6 GiB", 1: "1: – · 1.0/79.6 GiB"}
                wait_for(lambda: all(page.inner_text(f'[data-task="{i}"] .gpu').strip() == text
                                     for i, text in shown.items()), 15, f"both tasks' GPUs shown at {width} px")
                assert page.inner_text('[data-task="0"] .gpu').strip() == "0: 87% · 12.0/79.6 GiB"
                assert page.inner_text('[data-task="1"] .gpu').strip() == "1: – · 1.0/79.6 GiB"
                assert "null" not in page.inner_text("#charts")  # no chart drawn yet: nothing said as "null"
                scroll, inner = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
                assert scroll <= inner, f"the page overflows at {width} px: {scroll} > {inner}"
                page.screenshot(path=str(tmp_path / f"gpus-{width}.png"), full_page=True)
        assert code == 200, text
        seen = {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}
        gpu = {k: v for k, v in seen.items() if k[0].startswith("mgpu_task_gpu_")}
        assert gpu == {
            ("mgpu_task_gpu_utilization_percent", (("gpu", "0"), ("run", run), ("task", "0"))): 87.0,
            ("mgpu_task_gpu_memory_bytes", (("gpu", "0"), ("run", run), ("task", "0"))): 12288.0 * 2**20,
            ("mgpu_task_gpu_memory_bytes", (("gpu", "1"), ("run", run), ("task", "1"))): 1024.0 * 2**20,
        }, gpu  # GPU 1's use is not known: no sample
    finally:
        d = cli("down", timeout=120)
        assert d.returncode == 0, d.stdout + d.stderr


def test_relayed_figures_are_untrusted_input():
    """A Stats record's gpus come from a file or pipe the training can write to: only whole figures of GPUs."""
    from worker.host import protocol

    with pytest.raises(protocol.BadRecord):
        protocol.decode('{"v": 1, "event": "stats", "gpus": [1, 2]}')
    ev = protocol.decode('{"v": 1, "event": "stats", "gpus": [{"index": 0, "util": 5, "memory_used": 1, '
                         '"memory_total": 2}, {"index": "0"}, {"index": 1, "util": true, "memory_used": null, '
                         '"memory_total": null}, {"index": 2, "util": -1, "memory_used": 1, "memory_total": 2}]}')
    assert [GpuFigures.parse(g) for g in ev.gpus] == [GpuFigures(0, 5, 1, 2), None, None, None]


def hostile(folder: Path, body: str) -> Path:
    """An `nvidia-smi` in `folder` that runs `body` (sh) for any query."""
    folder.mkdir(exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return folder


FLOOD = "echo '0, 250, 999999999999, 1'; seq 1 399999 | sed 's/$/, 5, 1, 2/'"  # out of range, then 400000 GPUs


def test_a_reading_is_bounded_and_in_range_and_says_what_it_left_out(tmp_path, monkeypatch):
    from worker.host.devices import GPUS_MAX, read_gpus

    monkeypatch.setenv("PATH", f"{hostile(tmp_path / 'bin', FLOOD)}:{os.environ['PATH']}")
    reading = read_gpus()
    assert reading.figures is not None and len(reading.figures) == GPUS_MAX
    assert reading.figures[0] == GpuFigures(0, None, None, None) and reading.figures[1] == GpuFigures(1, 5, 1, 2)
    assert reading.dropped.startswith("nvidia-smi's figures left out (it listed ") and \
        f"GPUs, and a host holds at most {GPUS_MAX}: the first {GPUS_MAX} are kept" in reading.dropped, reading.dropped
    assert "GPU 0: a use of 250 % and 999999999999 MiB used of 1 MiB" in reading.dropped, reading.dropped
    assert len(nvidia_smi("index") or []) == GPUS_MAX
    assert GpuFigures.parse({"index": 0, "util": 250, "memory_used": 1, "memory_total": 2}) is None  # relayed too
    assert GpuFigures.parse({"index": 0, "util": 5, "memory_used": 3, "memory_total": 2}) is None


@pytest.mark.parametrize("hang", ["sleep", "setsid sleep"])
def test_a_hung_nvidia_smi_behind_a_wrapper_is_stopped_whole_at_its_timeout(tmp_path, monkeypatch, hang):
    """A wrapper script's hung child, in the wrapper's session or one of its own (setsid), is gone after the
    reader's timeout: nothing of a reader outlives it."""
    import psutil

    from worker.host.devices import read_gpus

    marker = "617.25"  # the hung child's own argument: no other process has it
    monkeypatch.setenv("PATH", f"{hostile(tmp_path / 'bin', f'{hang} {marker}; echo 0, 1, 2, 3')}:{os.environ['PATH']}")
    def left() -> list:
        return [p for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]

    read = []
    reader = threading.Thread(target=lambda: read.append(read_gpus(timeout=1)), daemon=True)
    reader.start()
    reader.join(60)  # a child holding the reader's pipe kept it reading until the child ended (617 s)
    try:
        assert read and read[0].figures is None, "the reader still waits for the hung child's output"
        assert wait_for(lambda: not left(), 10, "the wrapper's hung child gone"), left()
    finally:
        for proc in left():
            proc.kill()


def test_a_hostile_nvidia_smi_never_fails_the_task_and_is_said_once(cli, tmp_path):
    """A real task on a host whose nvidia-smi lists 400000 GPUs, the first out of range: every heartbeat still
    decodes (the task is not lost), `status --json` holds at most GPUS_MAX GPUs, each in range, and the run says
    once what was left out."""
    from worker.host.devices import GPUS_MAX

    cli.env["PATH"] = f"{hostile(tmp_path / 'bin', FLOOD)}:{cli.env['PATH']}"
    sleep = json.dumps([sys.executable, "-c", "import time; time.sleep(4)"])
    spec = write_spec(tmp_path, f"command = {sleep}", n=1, each='gpus = "all"\n',
                      launch="heartbeat_timeout = 60")
    r = cli("up", spec, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count("nvidia-smi's figures left out (it listed ") == 1, out
    assert "GPU 0: a use of 250 % and 999999999999 MiB used of 1 MiB" in out and "the task goes on" in out, out
    gpus = status_json(cli)["tasks"][0]["gpus"]
    assert gpus and len(gpus) == GPUS_MAX, gpus
    assert gpus[0] == {"index": 0, "util": None, "memory_used": None, "memory_total": None}, gpus[0]
    assert all((g["util"] is None or 0 <= g["util"] <= 100) for g in gpus)
