"""Reads (or stops) a run's tasks on this host from their folders (no TensorFlow here).

    python -m worker.task.probe [--stop] DIR...   prints one JSON object per task folder
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from worker.task import procs
from worker.task.host import tree_rss


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def task_info(d: Path) -> dict:
    """task.json of a task folder (pids with their create times), {} when missing or unreadable."""
    try:
        info = json.loads((d / "task.json").read_text())
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def _task_process(info: dict):
    return procs.same(info.get("pid"), info.get("create_time"))


def gpu_utilization() -> list[int] | None:
    """Per-GPU utilisation in percent from nvidia-smi, or None on hosts without it."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [int(x) for x in out.split() if x.strip().isdigit()]


def probe_many(run_dirs: list[str], cpu_window: float = 0.1) -> list[dict]:
    """What each task's folder says: pid, alive, exit code, progress, CPU% (over cpu_window) and RSS."""
    rows, procs = [], []
    for run_dir in run_dirs:
        d = Path(run_dir)
        info, code = task_info(d), _read(d / "exit_code")
        proc = _task_process(info)
        row = {"dir": run_dir, "pid": info.get("pid"), "alive": proc is not None, "status": None,
               "exit_code": int(code) if code and code.lstrip("-").isdigit() else None,
               "progress": None, "cpu_percent": None, "rss": None}
        try:
            row["progress"] = json.loads((d / "progress.json").read_text())
        except (OSError, ValueError):
            pass
        if proc is not None:
            try:
                proc.cpu_percent(None)  # starts the measuring window
            except psutil.Error:
                proc = None
        rows.append(row)
        procs.append(proc)
    if any(procs) and cpu_window:
        time.sleep(cpu_window)
    gpus = gpu_utilization()
    for row, proc in zip(rows, procs):
        row["gpu_util"], row["time"] = gpus, time.time()
        if proc is None:
            continue
        try:
            row["cpu_percent"] = round(proc.cpu_percent(None), 1)
            row["status"] = proc.status()
            row["rss"] = tree_rss(proc)
        except psutil.Error:
            pass
    return rows


def probe(run_dir: str) -> dict:
    return probe_many([run_dir])[0]


def stop(run_dir: str, grace: float = 5.0) -> dict:
    """Stop a task from its folder alone: its supervisor (INT: stop now), its training group, and
    every process left with the task's run id in its environment; each pid checked by create time."""
    info = task_info(Path(run_dir))
    supervisor = procs.same(info.get("supervisor_pid"), info.get("supervisor_create_time"))
    procs.stop([supervisor], grace, group=False, first=signal.SIGINT)
    procs.stop([_task_process(info)], grace)
    if info.get("run_id"):
        procs.stop(procs.of_task(info["run_id"], info.get("index", "")), grace)
    return probe(run_dir)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--stop"]:
        print(json.dumps([stop(d) for d in args[1:]]))
    else:
        print(json.dumps(probe_many(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
