"""`mgpu-cluster check` of a generated spec with 1000 local tasks against `check` of 2 local
tasks, alternated; with the most processes check had running at once."""

from __future__ import annotations

import os
import subprocess
import time

from bench.common import LOCAL_DEFAULTS, PY, Bench, free_ports, mgpu_argv, tail, write_spec
from bench.results import Row
from bench.timing import Stat, alternated, machine_cpu, paired_ratio

TITLE = "`check` of a generated spec with many local tasks"
TARGET = "ours <= 10"


def distinct_free_ports(n: int) -> list[int]:
    """`n` distinct ports free right now (asked of the kernel 100 at a time: few descriptors open)."""
    ports: set[int] = set()
    while len(ports) < n:
        ports.update(free_ports(min(100, n - len(ports))))
    return sorted(ports)[:n]


def check(b: Bench, tasks: int) -> dict:
    import psutil

    d = b.fresh(f"check-{tasks}")
    hosts = [{"address": "localhost", "port": p} for p in distinct_free_ports(tasks)]
    spec = write_spec(d / "cluster.toml", hosts, [PY, "-c", "pass"], LOCAL_DEFAULTS)
    m0, t0 = machine_cpu(), time.time()
    with open(d / "check.out", "w") as out:
        proc = subprocess.Popen([*mgpu_argv(), "check", str(spec)], stdout=out, stderr=subprocess.STDOUT,
                                env=b.env(), cwd=d)
        peak = 0
        while proc.poll() is None:  # the most processes under check at once
            try:
                peak = max(peak, len(psutil.Process(proc.pid).children(recursive=True)))
            except psutil.Error:
                pass
            time.sleep(0.05)
            if time.time() - t0 > 600:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"check of {tasks} tasks still running after 600 s; see {d / 'check.out'}")
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"check of {tasks} tasks exited {proc.returncode}:\n"
                           f"{tail((d / 'check.out').read_text(errors='replace'), 15)}")
    return {"wall_s": wall, "peak_processes": peak, "machine_cpu_s": machine_cpu() - m0}


def run(b: Bench) -> list[Row]:
    many = 50 if b.quick else 1000
    big, small = alternated(b.reps, lambda: check(b, many), lambda: check(b, 2))
    b.raw["check_scale"] = {"tasks": many, "ours": big, "baseline": small}
    ours, base = [r["wall_s"] for r in big], [r["wall_s"] for r in small]
    note = (f"a generated spec: {many} [[hosts]] on localhost, one port each, `command` = python -c pass; "
            f"most processes under check at once {max(r['peak_processes'] for r in big)} "
            f"(2 tasks: {max(r['peak_processes'] for r in small)}); CPU of all processes on the machine "
            f"{Stat([r['machine_cpu_s'] for r in big]).fmt('s')} on {os.cpu_count()} cores")
    return [Row(f"`check` of {many} local tasks (baseline: `check` of 2)", Stat(ours), Stat(base), "s",
                paired_ratio(ours, base), TARGET if many >= 1000 else "", note)]
