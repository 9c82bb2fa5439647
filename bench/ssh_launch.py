"""Launch over SSH to 1..32 namespace hosts: `up` of a trivial command until every task runs and
until it ends, with the CPU the hosts spend on it (sum of their processes); beside it, the same
hosts each asked once by OpenSSH (`ssh host python -c pass`), alternated at each size."""

from __future__ import annotations

import os
import statistics
import subprocess
import time

from bench.common import PY, Bench, SkipBench, write_spec
from bench.results import Row
from bench.timing import Stat, back_and_forth, machine_cpu, paired_ratio

TITLE = "launch scaling over SSH"
TARGET = "ratio <= 1.5"
SIZES = (1, 2, 4, 8, 16, 32)


def hosts_cpu(th, n: int, before: list[tuple[int, float]], settle: float = 5.0) -> float:
    """CPU seconds the first `n` hosts spent since `before` (th.usage()), once their sessions end."""
    deadline = time.time() + settle
    while True:
        now = th.usage()
        if all(now[k][0] <= before[k][0] for k in range(n)) or time.time() > deadline:
            return sum(now[k][1] - before[k][1] for k in range(n))
        time.sleep(0.05)


def ours(b: Bench, th, n: int) -> dict:
    d = b.fresh(f"ssh-launch-{n}")
    (d / "work").mkdir()
    spec = write_spec(d / "cluster.toml", [{"address": a, "port": 20000} for a in th.addresses[:n]],
                      ["true"], {"python": PY, "workdir": str(d / "work")})
    before = th.usage()
    res = b.up(spec, b.env(th.env()), timeout=300)
    b.need_ok(res, f"launch over SSH on {n} hosts")
    cpu = hosts_cpu(th, n, before)
    ph, t0 = res.run.get("phases", {}), res.run["_t0"]
    # A trivial task may end before the last one starts: "every task running" is when the
    # launcher got the last task's "started" report (per task in state.json).
    started = max(t["started_at"] for t in res.run["tasks"])
    return {"running_s": started - t0, "finished_s": res.wall, "preflight_s": ph.get("preflight_s"),
            "launcher_cpu_s": res.launcher_cpu, "machine_cpu_s": res.machine_cpu, "hosts_cpu_s": cpu,
            "cpu_per_host_s": cpu / n}


def round_trip(b: Bench, th, n: int) -> dict:
    """Baseline: one `ssh host python -c pass` to each of the first `n` hosts, all at once."""
    before, m0, t0 = th.usage(), machine_cpu(), time.time()
    procs = [subprocess.Popen(th.ssh_argv(i, PY, "-c", "pass"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env=th.env()) for i in range(n)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    wall = time.time() - t0
    if any(p.returncode for p in procs):
        raise RuntimeError(f"ssh baseline failed: {[p.returncode for p in procs]} {errors[0][-300:]!r}")
    cpu = hosts_cpu(th, n, before)
    return {"wall_s": wall, "machine_cpu_s": machine_cpu() - m0, "hosts_cpu_s": cpu, "cpu_per_host_s": cpu / n}


def run(b: Bench) -> list[Row]:
    if b.quick:
        raise SkipBench("quick mode")
    th = b.hosts()
    up: dict[int, list[dict]] = {n: [] for n in SIZES}
    ssh: dict[int, list[dict]] = {n: [] for n in SIZES}
    for i, n in back_and_forth(b.reps, SIZES):
        pair = [lambda: up[n].append(ours(b, th, n)), lambda: ssh[n].append(round_trip(b, th, n))]
        for step in (pair if i % 2 == 0 else pair[::-1]):
            step()
        b.log(f"    rep {i + 1}, {n} hosts: every task running {up[n][-1]['running_s']:.2f} s, finished "
              f"{up[n][-1]['finished_s']:.2f} s, hosts' CPU {up[n][-1]['cpu_per_host_s']:.2f} s per host")
    b.raw["ssh_launch"] = {"up": up, "ssh_round_trip": ssh}
    med = {n: {k: statistics.median(r[k] for r in up[n]) for k in up[n][0]} for n in SIZES}
    b.plot["ssh_launch"] = med

    def sizes(key: str, fmt: str = ".2f") -> str:
        return " / ".join(f"{med[n][key]:{fmt}}" for n in SIZES)

    def col(n: int, key: str, data=up) -> list[float]:
        return [r[key] for r in data[n] if r[key] is not None]

    names = "/".join(map(str, SIZES))
    rows = []
    for key, what in (("running_s", "every task running"), ("finished_s", "every task finished")):
        for big, target in ((16, TARGET if key == "running_s" else ""), (32, "")):
            note = f"{names} hosts: {sizes(key)} s"
            if key == "running_s" and big == 16:
                note += (f"; 16 hosts: preflight {Stat(col(16, 'preflight_s')).fmt('s')}, launcher process CPU "
                         f"{Stat(col(16, 'launcher_cpu_s')).fmt('s')}, CPU of all processes on the machine "
                         f"{Stat(col(16, 'machine_cpu_s')).fmt('s')} (2 hosts: {Stat(col(2, 'machine_cpu_s')).fmt('s')})"
                         f" on {os.cpu_count()} cores")
            rows.append(Row(f"launch over SSH, {big} hosts vs 2: `up` to {what}", Stat(col(big, key)),
                            Stat(col(2, key)), "s", paired_ratio(col(big, key), col(2, key)), target, note))
    for big in (16, 32):
        ours_cpu, base_cpu = col(big, "cpu_per_host_s"), col(big, "cpu_per_host_s", ssh)
        rows.append(Row(f"hosts' CPU per host during `up`, {big} hosts (baseline: one `ssh host python -c pass` "
                        "per host)", Stat(ours_cpu), Stat(base_cpu), "CPU s", paired_ratio(ours_cpu, base_cpu), "",
                        f"sum of the CPU of every process in the hosts' namespaces (sshd sessions, shells, "
                        f"Pythons, supervisors, the task), divided by the hosts; {names} hosts: "
                        f"{sizes('cpu_per_host_s', '.3f')} CPU s per host; at {big} hosts the hosts' CPU alone needs "
                        f"{Stat([c * big / os.cpu_count() for c in ours_cpu]).fmt('s')} of wall time on this "
                        f"machine's {os.cpu_count()} cores (the floor when they share it); the baseline's wall "
                        f"time {Stat(col(big, 'wall_s', ssh)).fmt('s')}"))
    return rows
