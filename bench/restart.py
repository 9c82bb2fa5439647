"""The cost of one crash against a cold start: the digits example run twice in alternated pairs, once as it is
and once with a kill -9 of task 1 (max_restarts = 3); with standbys off and on, local and over SSH. The cold
start = spawn to first step of the run without kill (its record's phases). The crash cost, two ways:

- time lost = from the failure until the restarted group has trained again to the step it had reached
  (the restarted attempt's back_s, launcher.run.phases): measured within the run that had the crash, it
  holds the restart and the steps trained twice, and none of another run's noise. The target is on it.
- wall = wall(kill) - wall(no kill): also what comes after (a slower first epoch, the next standbys'
  imports), but the difference of two runs whose walls spread over several seconds on this machine.

Its parts are the restarted attempt's phases.

Two kills: at half the steps of a short run (16 epochs, about 10 s into training: a crash soon after the
start), and, with standbys, once every task's standby is ready (40 epochs, as issue 33 measured: a crash in
a run's steady state, where most crashes of a long run fall). A standby imports on the CPU time the training
leaves; where the training takes every core (this bench: 2 pinned workers on 2 cores) it is ready about
25 s after the first step, so the first kind of kill meets it half imported."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from enum import Enum
from pathlib import Path
from typing import Callable

from bench.common import LOCAL_DEFAULTS, PY, Bench, SkipBench, kill_tree, local_hosts, mgpu_argv, tail, wait_for, \
    write_spec
from bench.results import Row
from bench.timing import Stat, alternated, paired_ratio

TITLE = "restart cost"
TARGET = "ratio <= 0.5"  # with standbys: a crash costs at most half a cold start (issue 33)
EPOCHS, QUICK_EPOCHS = 16, 8  # digits on 2 pinned cores: about 1 s an epoch; a kill lands mid-run, before fit ends
READY_EPOCHS = 40  # long enough that the standbys are ready (about 25 s after the first step) before fit ends
EVERY = 5  # a checkpoint every this many steps
PARTS = (("detected_s", "detected"), ("teardown_s", "teardown"), ("spawn_s", "spawn"),
         ("first_step_s", "to first step"), ("took_s", "in all until the first step"))


class Kill(str, Enum):
    HALFWAY = "at half the steps"
    READY = "once every standby is ready"


def training(epochs: int) -> dict:
    return {"entrypoint": "worker.examples.digits:task", "epochs": epochs, "checkpoint_every_steps": EVERY}


def steps(run: dict) -> tuple[int, int] | None:
    """(the slowest task's global step, the run's steps in all) from the record, once both tasks train."""
    progress = [t.get("progress") or {} for t in run.get("tasks", [])]
    if run.get("state") != "running" or not progress or not all(p.get("steps_per_epoch") for p in progress):
        return None
    return min(p.get("global_step") or 0 for p in progress), progress[0]["steps_per_epoch"] * progress[0]["epochs"]


def standbys_ready(run: dict) -> bool:
    """Every task's standby for the next attempt is ready (its imports done), by the run's record."""
    tasks = run.get("tasks") or []
    return bool(tasks) and all((t.get("standby") or {}).get("ready") for t in tasks)


def once(b: Bench, spec: Path, env: dict, kill: Kill | None) -> dict:
    """`up SPEC` timed from start to exit; with `kill`, task 1 is killed (-9) at that point of the run."""
    before = b.runs()
    out = open(spec.with_suffix(".kill.out" if kill else ".out"), "w")
    t0 = time.time()
    proc = subprocess.Popen([*mgpu_argv(), "up", str(spec)], stdout=out, stderr=subprocess.STDOUT, env=env,
                            cwd=spec.parent, start_new_session=True)
    try:
        killed_at = None
        if kill:
            def due():
                new = sorted(b.runs() - before)
                run = b.run_state(new[-1]) if new else {}
                done = steps(run)
                if done and (standbys_ready(run) if kill is Kill.READY else done[0] >= done[1] // 2):
                    return run
                if proc.poll() is not None:
                    raise RuntimeError(f"up exited {proc.returncode} before the kill ({kill.value}); see {out.name}")
                return None

            run = wait_for(due, 300, kill.value)
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


def measure(b: Bench, where: str, standby: bool, kill: Kill, hosts: Callable[[], list[dict]], env: dict,
            defaults: Callable[[Path], dict], pairs: int, epochs: int) -> list[Row]:
    """`pairs` alternated pairs of runs without and with a kill; two rows: the crash's cost in the run's wall
    time, and the restart's own time (failure to first step, steadier: no epoch's noise in it)."""
    name = f"restart-{where.split()[0].lower()}-{'standby' if standby else 'cold'}-{kill.name.lower()}"
    launch = {"max_restarts": 3, "standby": standby}

    def spec() -> Path:
        d = b.fresh(name)
        return write_spec(d / "cluster.toml", hosts(), [], defaults(d), launch, training(epochs))

    plain, killed = alternated(pairs, lambda: once(b, spec(), env, None), lambda: once(b, spec(), env, kill))
    b.raw.setdefault("restart", []).append({"where": where, "standby": standby, "kill": kill.name, "epochs": epochs,
                                            "without": plain, "with_kill": killed})
    # a pair where a run failed by itself too (a restart more than the kill made) measures no single crash
    kept = [(p, k) for p, k in zip(plain, killed) if p["attempts"] == 1 and k["attempts"] == 2]
    if not kept:
        raise RuntimeError(f"every pair had a failure besides the kill (attempts {[k['attempts'] for k in killed]})")
    dropped, plain, killed = len(plain) - len(kept), [p for p, _ in kept], [k for _, k in kept]
    crash = [k["wall"] - p["wall"] for p, k in zip(plain, killed)]
    cold = [p["cold_start"] for p in plain]

    def by_phase(key: str) -> tuple[list[float], list[float]]:
        """The restarted attempts' phase `key` and their pairs' cold starts, where it was recorded."""
        pairs = [(k["phases"][key], p["cold_start"]) for p, k in zip(plain, killed) if key in k["phases"]]
        return [ours for ours, _ in pairs], [base for _, base in pairs]

    def part(key: str) -> str:
        values = by_phase(key)[0]
        return Stat(values).fmt("s") if values else "-"

    rest = [c - k["phases"]["took_s"] for c, k in zip(crash, killed) if "took_s" in k["phases"]]
    redone = by_phase("steps_redone")[0]
    left_out = f", {dropped} left out (a run failed by itself as well)" if dropped else ""
    note = (f"{pairs} alternated pair(s){left_out}; digits, 2 {where} workers pinned to cores 0 and 1, {epochs} epochs, a "
            f"checkpoint every {EVERY} steps, max_restarts = 3, standby = {str(standby).lower()}; kill -9 of task 1 "
            f"{kill.value}, at step {Stat([k['killed_at_step'] for k in killed]).fmt()}; crash cost = wall with the "
            f"kill {Stat([k['wall'] for k in killed]).fmt('s')} - without {Stat([p['wall'] for p in plain]).fmt('s')}; "
            "cold start = the run without kill's spawn + to first step. The restart's phases: "
            + ", ".join(f"{words} {part(key)}" for key, words in PARTS)
            + f"; steps redone {Stat(redone).fmt() if redone else '-'}; the rest of the crash cost (the steps redone, "
            f"a slower first epoch after the restart, noise) {Stat(rest).fmt('s') if rest else '-'}")
    took, took_cold = by_phase("took_s")
    back, back_cold = by_phase("back_s")
    reached = by_phase("reached_step")[0]
    rows = [Row(figure(where, standby, kill), Stat(back), Stat(back_cold), "s", paired_ratio(back, back_cold),
                TARGET if standby else "",
                f"the same pairs ({len(back)} with the phase): the restarted attempt's back_s, from the failure until "
                f"the group had trained again to the step it had reached ({Stat(reached).fmt() if reached else '-'}), "
                "by the progress reads around it") if back else
            Row(figure(where, standby, kill), note="failed: no restarted attempt got back to the step reached",
                target=TARGET if standby else ""),
            Row(figure(where, standby, kill, Cost.WALL), Stat(crash), Stat(cold), "s", paired_ratio(crash, cold), "",
                note)]
    return rows + [Row(own_figure(where, standby, kill), Stat(took), Stat(took_cold), "s", paired_ratio(took, took_cold),
                       "", f"the same {len(took)} pair(s): the restarted attempt's phases, from the failure to its "
                       "first step (detected + teardown + spawn + to first step)")]


def own_figure(where: str, standby: bool, kill: Kill) -> str:
    return (f"restart itself, {where}, standby {'on' if standby else 'off'}, kill {kill.value}: failure to first "
            "step (baseline: a cold start)")


class Cost(str, Enum):
    LOST = "time lost (failure until back at the step reached)"
    WALL = "in wall time (with the kill - without)"


def figure(where: str, standby: bool, kill: Kill, cost: Cost = Cost.LOST) -> str:
    return (f"restart cost, {where}, standby {'on' if standby else 'off'}: one kill -9 {kill.value}, {cost.value} "
            "(baseline: a cold start)")


def run(b: Bench) -> list[Row]:
    pairs = max(b.reps, 1 if b.quick else 3)
    settings = [(True, Kill.HALFWAY, QUICK_EPOCHS)] if b.quick else \
        [(False, Kill.HALFWAY, EPOCHS), (True, Kill.HALFWAY, EPOCHS), (True, Kill.READY, READY_EPOCHS)]
    rows = [row for standby, kill, epochs in settings
            for row in one(b, "local", standby, kill, lambda: local_hosts(2, [[0], [1]]), b.env(),
                           lambda _d: LOCAL_DEFAULTS, pairs, epochs)]
    if b.quick:
        return rows + [Row(f"restart cost, {what}", note="skipped: quick mode", target=TARGET)
                       for what in ("local, standby off", "local, once every standby is ready", "over SSH")]
    try:
        th = b.hosts()
    except SkipBench as exc:
        return rows + [Row("restart cost, over SSH", note=f"skipped: {exc}", target=TARGET)]
    ssh_hosts = [{"address": a, "port": 20000, "cpus": [i]} for i, a in enumerate(th.addresses[:2])]
    return rows + [row for standby, kill, epochs in settings
                   for row in one(b, "SSH (2 namespace hosts)", standby, kill, lambda: ssh_hosts, b.env(th.env()),
                                  lambda d: {**LOCAL_DEFAULTS, "python": PY, "workdir": str(d)}, pairs, epochs)]


def one(b: Bench, where: str, standby: bool, kill: Kill, *args) -> list[Row]:
    """measure(), or a row that says why it failed: one broken setting must not hide the others."""
    try:
        return measure(b, where, standby, kill, *args)
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        return [Row(figure(where, standby, kill), note=f"failed: {first}", target=TARGET if standby else "")]
