"""Failure detection: kill -9 one of two training workers and time until the other is gone,
under `up` (local, and over SSH) against the same workers started by hand (TensorFlow alone)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from bench.common import (HAND, LOCAL_DEFAULTS, PY, Bench, SkipBench, alive, free_ports, job_argv, kill_tree,
                          local_hosts, mgpu_argv, wait_for, write_spec)
from bench.results import Row
from bench.timing import Stat, paired_ratio

TITLE = "failure detection"
TARGET = "ours <= 2"


def kill_and_time(victim: int, others: list[int], limit: float, gone: dict | None = None) -> float | None:
    """kill -9 `victim`; seconds until every pid in `others` is gone (None: still there at `limit`).
    `gone`, when given, gets each pid's own time."""
    os.kill(victim, signal.SIGKILL)
    t0 = time.time()
    gone = {} if gone is None else gone
    while time.time() - t0 < limit:
        for p in others:
            if p not in gone and not alive(p):
                gone[p] = round(time.time() - t0, 3)
        if len(gone) == len(others):
            return time.time() - t0
        time.sleep(0.01)
    return None


def ours(b: Bench, name: str, spec: Path, env: dict, workdir: Path | None = None) -> float:
    """Start `up`, wait until both workers train, kill -9 task 1, time until task 0 is gone."""
    before = b.runs()
    out = open(spec.with_suffix(".out"), "w")
    proc = subprocess.Popen([*mgpu_argv(), "up", str(spec)], stdout=out, stderr=subprocess.STDOUT, env=env,
                            cwd=spec.parent, start_new_session=True)
    try:
        def training():
            new = sorted(b.runs() - before)
            run = b.run_state(new[-1]) if new else {}
            if run.get("state") == "running" and all(
                    "BENCH-READY" in b.task_log(run, t["index"], workdir) for t in run["tasks"]):
                return run
            if proc.poll() is not None:
                raise RuntimeError(f"{name}: up exited {proc.returncode} early; see {spec.with_suffix('.out')}")
            return None

        t0, t1 = wait_for(training, 180, f"{name}: both workers training")["tasks"]
        gone: dict = {}
        took = kill_and_time(t1["pid"], [t0["pid"], t0["supervisor_pid"]], 30, gone)
        b.raw.setdefault("failure_detail", []).append(
            {"name": name, "worker_gone_s": gone.get(t0["pid"]), "supervisor_gone_s": gone.get(t0["supervisor_pid"])})
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if took is None:
            raise RuntimeError(f"{name}: task 0 still running 30 s after task 1 was killed")
        return took
    finally:
        kill_tree(proc)
        out.close()


def hand(b: Bench, command: list[str], limit: float) -> float | None:
    """Baseline: hand-launched workers, kill -9 worker 1, time until worker 0 exits on its own."""
    import psutil

    d = b.fresh("failure-hand")
    p0, p1 = free_ports(2)
    proc = subprocess.Popen(["bash", str(HAND), str(p0), str(p1), str(d), "--", *command], env=b.env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=d, start_new_session=True)
    try:
        def logs_ready():
            logs = [d / f"worker{i}.log" for i in (0, 1)]
            return all(p.exists() and "BENCH-READY" in p.read_text(errors="replace") for p in logs)

        wait_for(logs_ready, 180, "hand-launched workers training")
        workers = {}
        for child in psutil.Process(proc.pid).children():
            with contextlib.suppress(psutil.Error, ValueError, KeyError):
                workers[json.loads(child.environ()["TF_CONFIG"])["task"]["index"]] = child.pid
        return kill_and_time(workers[1], [workers[0]], limit)
    finally:
        kill_tree(proc)


def run(b: Bench) -> list[Row]:
    command = job_argv("mnist", 64, 1_000_000, 5)
    local = []
    for _ in range(b.reps):
        spec = write_spec(b.fresh("failure-up") / "cluster.toml", local_hosts(2), command, LOCAL_DEFAULTS)
        local.append(ours(b, "failure (local)", spec, b.env()))
    b.raw["failure_local"] = local
    base = None
    if not b.quick:
        limit = 60.0
        took = hand(b, command, limit)
        base = Stat([took if took is not None else limit])
        b.raw["failure_hand_hung"] = took is None
    detail = [d for d in b.raw.get("failure_detail", []) if d["name"] == "failure (local)"]
    note = ("gone = the surviving worker and its supervisor; worker itself gone after "
            f"{Stat([d['worker_gone_s'] for d in detail if d['worker_gone_s'] is not None]).fmt('s')}; "
            "baseline: the same workers started by hand, the survivor left to TensorFlow's own detection"
            + (" (still running at 60 s: shown as 60)" if b.raw.get("failure_hand_hung") else ""))
    rows = [Row("failure detection, local: kill -9 of one worker -> every other worker gone", Stat(local), base,
                "s", paired_ratio(local, base.values * len(local)) if base else None, TARGET, note)]
    if b.quick:
        return rows
    try:
        th = b.hosts()
    except SkipBench as exc:
        return rows + [Row("failure detection over SSH", note=f"skipped: {exc}", target=TARGET)]
    remote = []
    for _ in range(b.reps):
        d = b.fresh("failure-ssh")
        spec = write_spec(d / "cluster.toml", [{"address": a, "port": 20000} for a in th.addresses[:2]], command,
                          {**LOCAL_DEFAULTS, "python": PY, "workdir": str(d)})
        remote.append(ours(b, "failure (SSH)", spec, b.env(th.env()), d))
    b.raw["failure_ssh"] = remote
    rows.append(Row("failure detection over SSH (2 namespace hosts)", Stat(remote), base, "s",
                    paired_ratio(remote, base.values * len(remote)) if base else None, TARGET,
                    "same job and baseline as the local row"))
    return rows
