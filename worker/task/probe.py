"""Reads (or stops) a run's tasks on this host from their folders (no TensorFlow here).

    python -m worker.task.probe [--stop] DIR...   prints one JSON object per task folder
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from worker.host.devices import GpuFigures, gpu_figures, task_figures
from worker.host.protocol import FILE_MAX_BYTES, json_object
from worker.host import layout
from worker.host import procs
from worker.host.env import VISIBLE_DEVICES
from worker.host.probed import ProbeRow
from worker.host.system import tree_rss


def _read(path: Path) -> bytes:
    """A file of a task's folder, where the training can write too: at most FILE_MAX_BYTES (and one more)."""
    try:
        with open(path, "rb") as f:
            return f.read(FILE_MAX_BYTES + 1)
    except OSError:
        return b""


def _exit_code(raw: bytes) -> int | None:
    try:
        return int(raw) if len(raw) < 32 else None
    except ValueError:
        return None


def task_info(d: Path) -> dict[str, Any]:
    """task.json of a task folder (pids with their create times), {} when missing or not one."""
    return json_object(_read(layout.file(d, layout.TASK_INFO))) or {}


def _named(info: dict[str, Any], who: str = "") -> psutil.Process | None:
    """The live process task.json names as `who`pid, only with its create time (the training can write the
    file: a pid alone would name anybody's process)."""
    created = info.get(f"{who}create_time")
    return procs.same(info.get(f"{who}pid"), created) if isinstance(created, (int, float)) else None


def _gpus(proc: psutil.Process, figures: list[GpuFigures] | None) -> list[GpuFigures] | None:
    """The figures of the training's own GPUs: those its CUDA_VISIBLE_DEVICES names (it started with it; unset:
    every GPU of the host), None where there are none or its environment cannot be read."""
    if not figures:
        return None
    try:
        visible = proc.environ().get(VISIBLE_DEVICES)
    except psutil.Error:
        return None
    return task_figures(figures, visible) or None


def probe_many(run_dirs: list[str], cpu_window: float = 0.1) -> list[ProbeRow]:
    """What each task's folder says: pid, alive, exit code, progress, CPU% (over cpu_window), RSS and its
    GPUs' figures (`gpus`: nvidia-smi's, device-wide; one call for every task)."""
    rows: list[ProbeRow] = []
    procs: list[psutil.Process | None] = []
    for run_dir in run_dirs:
        d = Path(run_dir)
        info = task_info(d)
        proc = _named(info)
        pid = info.get("pid")
        rows.append(ProbeRow(dir=run_dir, pid=pid if isinstance(pid, int) else None, alive=proc is not None,
                             exit_code=_exit_code(_read(layout.file(d, layout.EXIT_CODE))),
                             progress=json_object(_read(layout.file(d, layout.PROGRESS)))))
        if proc is not None:
            try:
                proc.cpu_percent(None)  # starts the measuring window
            except psutil.Error:
                proc = None
        procs.append(proc)
    if any(procs) and cpu_window:
        time.sleep(cpu_window)
    figures = gpu_figures(timeout=10) if any(procs) else None
    for i, proc in enumerate(procs):
        rows[i] = replace(rows[i], time=time.time())
        if proc is None:
            continue
        try:
            rows[i] = replace(rows[i], cpu_percent=round(proc.cpu_percent(None), 1), status=proc.status(),
                              rss=tree_rss(proc))
        except psutil.Error:
            continue
        rows[i] = replace(rows[i], gpus=_gpus(proc, figures))
    return rows


def probe(run_dir: str) -> ProbeRow:
    return probe_many([run_dir])[0]


def stop(run_dir: str, grace: float = 5.0) -> ProbeRow:
    """Stop a task from its folder alone: its supervisor (INT: stop now), its training group, and
    every process left with the task's run id in its environment; each pid checked by create time."""
    info = task_info(Path(run_dir))
    supervisor = _named(info, "supervisor_")
    procs.stop([supervisor], grace, group=False, first=signal.SIGINT)
    procs.stop([_named(info)], grace)
    if info.get("run_id"):
        procs.stop(procs.of_task(info["run_id"], info.get("index", "")), grace)
    return probe(run_dir)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--stop"]:
        print(json.dumps([stop(d).to_json() for d in args[1:]]))
    else:
        print(json.dumps([row.to_json() for row in probe_many(args)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
