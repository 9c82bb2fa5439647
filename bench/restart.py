"""The cost of one crash against a cold start: the digits example run twice in alternated pairs, once as it is
and once with a kill -9 of task 1 mid-run (max_restarts = 3); crash cost = wall(kill) - wall(no kill), cold
start = spawn to first step of the run without kill (its record's phases); with standbys off and on, local
and over SSH. The parts of the crash cost are the restarted attempt's phases (launcher.run.phases)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from bench.common import LOCAL_DEFAULTS, PY, Bench, SkipBench, kill_tree, local_hosts, mgpu_argv, tail, wait_for, \
    write_spec
from bench.results import Row
from bench.timing import Stat, alternated, paired_ratio

TITLE = "restart cost"
TARGET = "ratio <= 0.5"  # with standbys: a crash costs at most half a cold start (issue 33)
EPOCHS, QUICK_EPOCHS = 16, 8  # digits on 2 pinned cores: about 1 s an epoch; a kill lands mid-run, before fit ends
EVERY = 5  # a checkpoint every this many steps
PARTS = (("detected_s", "detected"), ("teardown_s", "teardown"), ("spawn_s", "spawn"),
         ("first_step_s", "to first step"), ("took_s", "in all until the first step"))


def training(epochs: int) -> dict:
    return {"entrypoint": "worker.examples.digits:task", "epochs": epochs, "checkpoint_every_steps": EVERY}


def steps(run: dict) -> tuple[int, int] | None:
    """(the slowest task's global step, the run's steps in all) from the record, once both tasks train."""
    progress = [t.get("progress") or {} for t in run.get("tasks", [])]
    if run.get("state") != "running" or not progress or not all(p.get("steps_per_epoch") for p in progress):
        return None
    return min(p.get("global_step") or 0 for p in progress), progress[0]["steps_per_epoch"] * progress[0]["epochs"]


def once(b: Bench, spec: Path, env: dict, kill: bool) -> dict:
    """`up SPEC` timed from start to exit; with `kill`, task 1 is killed (-9) once half the steps are done."""
    before = b.runs()
    out = open(spec.with_suffix(".kill.out" if kill else ".out"), "w")
    t0 = time.time()
    proc = subprocess.Popen([*mgpu_argv(), "up", str(spec)], stdout=out, stderr=subprocess.STDOUT, env=env,
                            cwd=spec.parent, start_new_session=True)
    try:
        killed_at = None
        if kill:
            def halfway():
                new = sorted(b.runs() - before)
                run = b.run_state(new[-1]) if new else {}
                done = steps(run)
                if done and done[0] >= done[1] // 2:
                    return run
                if proc.poll() is not None:
                    raise RuntimeError(f"up exited {proc.returncode} before half its steps; see {out.name}")
                return None

            run = wait_for(halfway, 300, "half the steps done")
            killed_at = steps(run)[0]
            os.kill(run["tasks"][1]["pid"], signal.SIGKILL)
        code = proc.wait(600)
        wall = time.time() - t0
    finally:
        kill_tree(proc)
        out.close()
    if code != 0:
        raise RuntimeError(f"mgpu-cluster up {spec} exited {code}:\n{tail(Path(out.name).read_text(errors='replace'))}")
    new = sorted(b.runs() - before)
    run = b.run_state(new[-1]) if new else {}
    attempts = run.get("attempts") or []
    if kill and len(attempts) < 2:
        raise RuntimeError(f"the kill -9 made no restart (attempts: {len(attempts)}); see {out.name}")
    last = [t.get("progress") or {} for t in run.get("tasks", [])]
    every = [(p.get("steps_per_epoch") or 0) * (p.get("epochs") or 0) for p in last]
    if not last or not all(n and p.get("global_step") == n for p, n in zip(last, every)):  # none to time
        raise RuntimeError(f"{'the restarted ' if kill else 'the '}run did not train to its last step (global steps "
                           f"{[p.get('global_step') for p in last]}); see {out.name}")
    first = (attempts[0].get("phases") or {}) if attempts else {}
    return {"wall": wall, "cold_start": first.get("spawn_s", 0.0) + first.get("first_step_s", 0.0),
            "killed_at_step": killed_at, "phases": (attempts[-1].get("phases") or {}) if kill else first,
            "attempts": len(attempts)}


def measure(b: Bench, where: str, standby: bool, hosts: Callable[[], list[dict]], env: dict,
            defaults: Callable[[Path], dict], pairs: int, epochs: int) -> Row:
    """`pairs` alternated pairs of runs without and with a kill; one row."""
    name = f"restart-{where.split()[0].lower()}-{'standby' if standby else 'cold'}"
    launch = {"max_restarts": 3, "standby": standby}

    def spec() -> Path:
        d = b.fresh(name)
        return write_spec(d / "cluster.toml", hosts(), [], defaults(d), launch, training(epochs))

    plain, killed = alternated(pairs, lambda: once(b, spec(), env, False), lambda: once(b, spec(), env, True))
    b.raw.setdefault("restart", []).append({"where": where, "standby": standby, "epochs": epochs, "without": plain,
                                            "with_kill": killed})
    # a pair where a run failed by itself too (a restart more than the kill made) measures no single crash
    kept = [(p, k) for p, k in zip(plain, killed) if p["attempts"] == 1 and k["attempts"] == 2]
    if not kept:
        raise RuntimeError(f"every pair had a failure besides the kill (attempts {[k['attempts'] for k in killed]})")
    dropped, plain, killed = len(plain) - len(kept), [p for p, _ in kept], [k for _, k in kept]
    crash = [k["wall"] - p["wall"] for p, k in zip(plain, killed)]
    cold = [p["cold_start"] for p in plain]

    def part(key: str) -> str:
        values = [k["phases"][key] for k in killed if key in k["phases"]]
        return Stat(values).fmt("s") if values else "-"

    rest = [c - k["phases"]["took_s"] for c, k in zip(crash, killed) if "took_s" in k["phases"]]
    redone = [k["phases"]["steps_redone"] for k in killed if "steps_redone" in k["phases"]]
    left_out = f", {dropped} left out (a run failed by itself as well)" if dropped else ""
    note = (f"{pairs} alternated pair(s){left_out}; digits, 2 {where} workers pinned to cores 0 and 1, {epochs} epochs, a "
            f"checkpoint every {EVERY} steps, max_restarts = 3, standby = {str(standby).lower()}; kill -9 of task 1 at "
            f"step {Stat([k['killed_at_step'] for k in killed]).fmt()}; crash cost = wall with the kill "
            f"{Stat([k['wall'] for k in killed]).fmt('s')} - without {Stat([p['wall'] for p in plain]).fmt('s')}; "
            "cold start = the run without kill's spawn + to first step. The restart's phases: "
            + ", ".join(f"{words} {part(key)}" for key, words in PARTS)
            + f"; steps redone {Stat(redone).fmt() if redone else '-'}; the rest of the crash cost (the steps redone, "
            f"a slower first epoch after the restart, noise) {Stat(rest).fmt('s') if rest else '-'}")
    return Row(figure(where, standby), Stat(crash), Stat(cold), "s", paired_ratio(crash, cold),
               TARGET if standby else "", note)


def figure(where: str, standby: bool) -> str:
    return f"restart cost, {where}, standby {'on' if standby else 'off'}: one kill -9 (baseline: a cold start)"


def run(b: Bench) -> list[Row]:
    pairs, epochs = max(b.reps, 1 if b.quick else 3), QUICK_EPOCHS if b.quick else EPOCHS
    rows = [one(b, "local", standby, lambda: local_hosts(2, [[0], [1]]), b.env(), lambda _d: LOCAL_DEFAULTS, pairs,
                epochs) for standby in ((True,) if b.quick else (False, True))]
    if b.quick:
        return rows + [Row(f"restart cost, {what}", note="skipped: quick mode", target=TARGET)
                       for what in ("local, standby off", "over SSH")]
    try:
        th = b.hosts()
    except SkipBench as exc:
        return rows + [Row("restart cost, over SSH", note=f"skipped: {exc}", target=TARGET)]
    ssh_hosts = [{"address": a, "port": 20000, "cpus": [i]} for i, a in enumerate(th.addresses[:2])]
    return rows + [one(b, "SSH (2 namespace hosts)", standby, lambda: ssh_hosts, b.env(th.env()),
                       lambda d: {**LOCAL_DEFAULTS, "python": PY, "workdir": str(d)}, pairs, epochs)
                   for standby in (False, True)]


def one(b: Bench, where: str, standby: bool, *args) -> Row:
    """measure(), or a row that says why it failed: one broken setting must not hide the others."""
    try:
        return measure(b, where, standby, *args)
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        return Row(figure(where, standby), note=f"failed: {first}", target=TARGET if standby else "")
