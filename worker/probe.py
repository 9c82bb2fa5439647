"""Reads (or stops) a run's tasks on this host from their folders (no TensorFlow here).

    python -m worker.probe [--stop] DIR...   prints one JSON object per task folder
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _process(pid_text: str | None) -> psutil.Process | None:
    try:
        proc = psutil.Process(int(pid_text))
        return proc if proc.status() != psutil.STATUS_ZOMBIE else None
    except (TypeError, ValueError, psutil.Error):
        return None


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
        pid, code = _read(d / "pid"), _read(d / "exit_code")
        proc = _process(pid)
        row = {"dir": run_dir, "pid": int(pid) if pid else None, "alive": proc is not None,
               "exit_code": int(code) if code else None, "progress": None, "cpu_percent": None, "rss": None}
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
            row["rss"] = sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
        except psutil.Error:
            pass
    return rows


def probe(run_dir: str) -> dict:
    return probe_many([run_dir])[0]


def stop(run_dir: str, grace: float = 5.0) -> dict:
    """Stop a task's supervisor and its training group: TERM, then KILL after `grace` seconds."""
    d = Path(run_dir)
    procs = [p for p in (_process(_read(d / "supervisor.pid")), _process(_read(d / "pid"))) if p]
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGTERM) if proc.pid == os.getpgid(proc.pid) else proc.terminate()
        except (psutil.Error, OSError):
            pass
    _gone, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        try:
            os.killpg(proc.pid, signal.SIGKILL) if proc.pid == os.getpgid(proc.pid) else proc.kill()
        except (psutil.Error, OSError):
            pass
    psutil.wait_procs(alive, timeout=2.0)
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
