"""`mgpu-cluster status --json` of a live run on 16 SSH hosts against 16 parallel
`ssh host cat pid` (what a shell loop would do), alternated."""

from __future__ import annotations

import json
import os
import subprocess
import time

from bench.common import PY, Bench, SkipBench, mgpu_argv, write_spec
from bench.results import Row
from bench.timing import Stat, alternated, children_cpu, machine_cpu, paired_ratio

TITLE = "`status --json`, 16 SSH hosts"
TARGET = "ours <= 1"
HOSTS = 16


def run(b: Bench) -> list[Row]:
    if b.quick:
        raise SkipBench("quick mode")
    th = b.hosts()
    d = b.fresh("status")
    work = d / "work"  # run_dir in state.json may be relative to it
    work.mkdir()
    spec = write_spec(d / "cluster.toml", [{"address": a, "port": 20000} for a in th.addresses[:HOSTS]],
                      ["sleep", "600"], {"python": PY, "workdir": str(work)})
    env = b.env(th.env())
    res = b.up(spec, env, timeout=300, args=("--detach",))
    b.need_ok(res, f"status: up --detach on {HOSTS} hosts")
    run_id = sorted(b.runs())[-1]
    tasks = b.run_state(run_id)["tasks"]
    cpu: list[tuple[float, float]] = []

    def status() -> float:
        t0, m0, c0 = time.time(), machine_cpu(), children_cpu()
        r = subprocess.run([*mgpu_argv(), "status", "--json", run_id], capture_output=True, text=True, env=env,
                           timeout=120)
        wall = time.time() - t0
        cpu.append((children_cpu() - c0, machine_cpu() - m0))
        states = {t["state"] for t in json.loads(r.stdout)["tasks"]} if r.returncode == 0 else set()
        if states != {"running"}:
            raise RuntimeError(f"status --json: exit {r.returncode}, task states {states}: {r.stderr[-500:]}")
        return wall

    def ssh_loop() -> float:
        t0 = time.time()
        procs = [subprocess.Popen(th.ssh_argv(i, "cat", f"{work / t['run_dir']}/pid"), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env=env) for i, t in enumerate(tasks)]
        codes = [p.wait(120) for p in procs]
        if any(codes):
            raise RuntimeError(f"ssh baseline failed: exit codes {codes}")
        return time.time() - t0

    try:
        ours, base = alternated(max(5, b.reps), status, ssh_loop)
    finally:
        subprocess.run([*mgpu_argv(), "down", run_id], capture_output=True, env=env, timeout=120)
    b.raw["status"] = {"ours": ours, "baseline": base, "cpu_status_process_and_machine": cpu}
    return [Row(f"`status --json` over {HOSTS} SSH hosts (baseline: {HOSTS} parallel `ssh host cat pid`)", Stat(ours),
                Stat(base), "s", paired_ratio(ours, base), TARGET,
                "a fresh `mgpu-cluster status --json` process each time: start, read the live launcher's record "
                "(the supervisors relay progress, CPU, RSS), print; `--probe` goes to every host; "
                f"CPU of the status process {Stat([c[0] for c in cpu]).fmt('s')}, of all processes on the machine "
                f"{Stat([c[1] for c in cpu]).fmt('s')} on {os.cpu_count()} cores")]
