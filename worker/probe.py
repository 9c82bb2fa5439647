"""Reads (or stops) a run's tasks on this host from their folders (no TensorFlow here).

    python -m worker.probe [--stop] DIR...   prints one JSON object per task folder
"""

from __future__ import annotations

import json
import os
import signal
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


def probe(run_dir: str) -> dict:
    """What a task's folder says: pid, alive, exit code, progress, CPU% and RSS."""
    d = Path(run_dir)
    pid = _read(d / "pid")
    code = _read(d / "exit_code")
    proc = _process(pid)
    out = {"dir": run_dir, "pid": int(pid) if pid else None, "alive": proc is not None,
           "exit_code": int(code) if code else None, "progress": None, "cpu_percent": None, "rss": None}
    try:
        out["progress"] = json.loads((d / "progress.json").read_text())
    except (OSError, ValueError):
        pass
    if proc is not None:
        try:
            with proc.oneshot():
                procs = [proc, *proc.children(recursive=True)]
                out["rss"] = sum(p.memory_info().rss for p in procs)
                out["cpu_percent"] = round(proc.cpu_percent(interval=0.1), 1)
        except psutil.Error:
            pass
    out["time"] = time.time()
    return out


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
    action = stop if args[:1] == ["--stop"] else probe
    dirs = args[1:] if action is stop else args
    print(json.dumps([action(d) for d in dirs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
