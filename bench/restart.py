"""The cost of one crash against a cold start, and what fork servers and standbys cost while nothing fails: the
digits example on 2 workers pinned to the 2 cores, 40 epochs, a checkpoint every 5 steps, max_restarts = 3, local
and over SSH, in alternated rounds of: a run as it is (standby on), runs with a kill -9 of task 1 at epoch 3, 10
and 30, and a run with standby = false (the order flips each round).

- crash cost = wall(kill) - wall(the round's run without kill), over that run's cold start (spawn + to first
  step, its record's phases): at most 0.5 at every kill point. The restart's phases say where its time went.
- steps per second over the first 60 s of training (the launcher's progress history), standby on over off:
  at least 0.97.
- the memory a standby adds per task: the figure its supervisor reports (worker.host.system.private_memory of
  the fork server and of itself, the most seen) plus the running attempt's reaper's: at most 0.2 GB.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import psutil

from bench.common import LOCAL_DEFAULTS, PY, Bench, SkipBench, kill_tree, local_hosts, mgpu_argv, tail, wait_for, \
    write_spec
from bench.results import Row
from bench.timing import Stat, paired_ratio
from worker.host.system import private_memory

TITLE = "restart cost"
TARGET, SLOWDOWN_TARGET, MEMORY_TARGET = "ratio <= 0.5", "ratio >= 0.97", "ours <= 0.2"
EPOCHS, QUICK_EPOCHS = 40, 8
KILL_EPOCHS, QUICK_KILL = (3, 10, 30), (3,)
EVERY = 5  # a checkpoint every this many steps
FIRST_S = 60.0  # steps per second over this much of the training's start
PARTS = (("detected_s", "detected"), ("teardown_s", "teardown"), ("spawn_s", "spawn"),
         ("first_step_s", "to first step"), ("took_s", "in all until the first step"))


def progress(run: dict) -> tuple[int, int] | None:
    """(the slowest task's epoch reached, its global step) from the record, once both tasks train."""
    found = [t.get("progress") or {} for t in run.get("tasks", [])]
    if run.get("state") != "running" or not found or not all(p.get("steps_per_epoch") for p in found):
        return None
    return min(p.get("epoch") or 0 for p in found), min(p.get("global_step") or 0 for p in found)


def standby_memory(run: dict) -> float | None:
    """The most memory any task's standby adds now, in GB: its supervisor's figure and its attempt's reaper's."""
    most = None
    for t in run.get("tasks") or []:
        held = (t.get("standby") or {}).get("memory")
        if not isinstance(held, int) or not t.get("pid"):
            continue
        try:
            reaper = private_memory(psutil.Process(t["pid"]).ppid()) or 0
        except psutil.Error:
            continue
        most = max(most or 0.0, (held + reaper) / 1e9)
    return most


def steps_per_s(seen: list[tuple[float, int]]) -> float | None:
    """Global steps per second over the first FIRST_S s after the first step, of attempt 0's records `seen`."""
    moving = [(t, s) for t, s in seen if s > 0]
    if len(moving) < 2:
        return None
    t0, s0 = moving[0]
    within = [(t, s) for t, s in moving if t - t0 <= FIRST_S]
    t1, s1 = within[-1]
    return (s1 - s0) / (t1 - t0) if t1 > t0 else None


def history(home: Path, run_id: str, attempt: int) -> list[tuple[float, int]]:
    """Task 0's (time, global step) records in `attempt`, by the launcher's progress history."""
    seen = []
    try:
        for line in (home / "runs" / run_id / "progress.jsonl").read_text().splitlines():
            rec = json.loads(line)
            p = rec.get("progress") or {}
            if rec.get("task") == 0 and rec.get("attempt") == attempt and isinstance(p.get("global_step"), int) \
                    and isinstance(p.get("time"), (int, float)):
                seen.append((p["time"], p["global_step"]))
    except (OSError, ValueError):
        return []
    return seen


def pace(seen: list[tuple[float, int]], settle_s: float = 2.0,
         steps: tuple[int, int] | None = None) -> tuple[float, tuple[int, int]] | None:
    """Global steps per second in one attempt's records `seen`, from `settle_s` after its first record that moved
    (the pace it trained at, its start-up left out), or over the global steps `steps` (first, last) where given;
    with the steps it covers. None where too little is told."""
    moving = [(t, s) for t, s in seen if s > (seen[0][1] if seen else 0)]
    if steps is None:
        kept = [(t, s) for t, s in moving if t - moving[0][0] >= settle_s]
    else:
        kept = [(t, s) for t, s in moving if steps[0] <= s <= steps[1]]
    if len(kept) < 2 or kept[-1][0] <= kept[0][0]:
        return None
    return (kept[-1][1] - kept[0][1]) / (kept[-1][0] - kept[0][0]), (kept[0][1], kept[-1][1])


def once(b: Bench, spec: Path, env: dict, kill_epoch: int | None) -> dict:
    """`up SPEC` timed from start to exit; with `kill_epoch`, task 1 is killed (-9) once both reach that epoch."""
    before = b.runs()
    out = open(spec.with_suffix(f".kill{kill_epoch}.out" if kill_epoch else ".out"), "w")
    t0 = time.time()
    proc = subprocess.Popen([*mgpu_argv(), "up", str(spec)], stdout=out, stderr=subprocess.STDOUT, env=env,
                            cwd=spec.parent, start_new_session=True)
    memory: list[float] = []
    sampled = [0.0]
    try:
        def due():
            new = sorted(b.runs() - before)
            run = b.run_state(new[-1]) if new else {}
            if time.time() - sampled[0] >= 10 and (held := standby_memory(run)) is not None:  # smaps cost the training
                sampled[0] = time.time()
                memory.append(held)
            done = progress(run)
            if kill_epoch and done and done[0] >= kill_epoch:
                return run
            if proc.poll() is not None:
                if kill_epoch:
                    raise RuntimeError(f"up exited {proc.returncode} before the kill at epoch {kill_epoch}; see {out.name}")
                return run or {"state": "gone"}
            return None

        run = wait_for(due, 600, f"epoch {kill_epoch}" if kill_epoch else "the run's end", poll=1.0)
        killed_at = None
        if kill_epoch:
            killed_at = progress(run)[1]
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
    if kill_epoch and len(attempts) < 2:
        raise RuntimeError(f"the kill -9 made no restart (attempts: {len(attempts)}); see {out.name}")
    first = (attempts[0].get("phases") or {}) if attempts else {}
    histories = [history(b.home, run.get("run_id", ""), n) for n in range(len(attempts))]
    return {"wall": wall, "cold_start": first.get("spawn_s", 0.0) + first.get("first_step_s", 0.0),
            "killed_at_step": killed_at, "phases": (attempts[-1].get("phases") or {}) if kill_epoch else first,
            "attempts": len(attempts), "steps_per_s": steps_per_s(histories[0]) if histories else None,
            "history": histories,
            "memory_gb": max(memory) if memory else None}


def measure(b: Bench, where: str, hosts: Callable[[], list[dict]], env: dict, defaults: Callable[[Path], dict],
            rounds: int, epochs: int, kills: tuple[int, ...]) -> list[Row]:
    name = f"restart-{where.split()[0].lower()}"

    def run(standby: bool, kill_epoch: int | None) -> dict:
        d = b.fresh(name)
        spec = write_spec(d / "cluster.toml", hosts(), [], defaults(d), {"max_restarts": 3, "standby": standby},
                          {"entrypoint": "worker.examples.digits:task", "epochs": epochs,
                           "checkpoint_every_steps": EVERY})
        return once(b, spec, env, kill_epoch)

    plain: list[dict] = []
    killed: dict[int, list[dict]] = {k: [] for k in kills}
    cold: list[dict] = []
    for i in range(rounds):  # each round's order flips, so drift in the machine's load hits every kind alike
        order = [("plain", None), *[("kill", k) for k in kills], ("cold", None)]
        for kind, k in (order if i % 2 == 0 else order[::-1]):
            if kind == "plain":
                plain.append(run(True, None))
            elif kind == "cold":
                cold.append(run(False, None))
            else:
                killed[k].append(run(True, k))
    b.raw.setdefault("restart", []).append({"where": where, "epochs": epochs, "without": plain, "killed": killed,
                                            "standby_off": cold})
    rows = []
    for k in kills:
        pairs = [(p, x) for p, x in zip(plain, killed[k]) if p["attempts"] == 1 and x["attempts"] == 2]
        crash = [x["wall"] - p["wall"] for p, x in pairs]
        base = [p["cold_start"] for p, _ in pairs]
        parts = ", ".join(f"{words} {Stat(v).fmt('s') if (v := [x['phases'][key] for _, x in pairs if key in x['phases']]) else '-'}"
                          for key, words in PARTS)
        redone = [x["phases"]["steps_redone"] for _, x in pairs if "steps_redone" in x["phases"]]
        rows.append(Row(figure(where, k), Stat(crash), Stat(base), "s", paired_ratio(crash, base), TARGET,
                        f"{len(pairs)} of {rounds} round(s) kept (a run that failed by itself too measures no single "
                        f"crash); digits, 2 {where} workers pinned to cores 0 and 1, {epochs} epochs, a checkpoint "
                        f"every {EVERY} steps; kill -9 of task 1 at epoch {k}, step "
                        f"{Stat([x['killed_at_step'] for _, x in pairs]).fmt()}; wall with the kill "
                        f"{Stat([x['wall'] for _, x in pairs]).fmt('s')}, without {Stat([p['wall'] for p, _ in pairs]).fmt('s')}; "
                        f"the restart's phases: {parts}; steps redone {Stat(redone).fmt() if redone else '-'}")
                    if pairs else Row(figure(where, k), note="failed: every round had a failure besides the kill",
                                      target=TARGET))
    on = [(p["steps_per_s"], c["steps_per_s"]) for p, c in zip(plain, cold) if p["steps_per_s"] and c["steps_per_s"]]
    rows.append(Row(f"{TITLE}, {where}: steps per second, first {FIRST_S:g} s of training, standby on (baseline: off)",
                    Stat([a for a, _ in on]), Stat([c for _, c in on]), "steps/s", paired_ratio(*zip(*on)) if on else None,
                    SLOWDOWN_TARGET, f"the same rounds' runs without kill ({len(on)} pair(s)), task 0's global steps "
                    "by the launcher's progress history"))
    # the pace after a restart (the forked attempt's) against the same round's run without a kill over the same
    # global steps: an attempt's own pace changes along a run (its first epochs trace and warm up), so the steps
    # before the kill are no baseline for those after it
    paces = []
    for k in kills:
        for p, x in zip(plain, killed[k]):
            after = pace(x["history"][-1]) if len(x["history"]) == 2 and p["history"] else None
            same = pace(p["history"][0], steps=after[1]) if after else None
            if after and same:
                paces.append((after[0], same[0]))
    rows.append(Row(f"{TITLE}, {where}: steps per second after a restart (baseline: the same steps in the run "
                    "without a kill)", Stat([a for a, _ in paces]) if paces else None,
                    Stat([b_ for _, b_ in paces]) if paces else None, "steps/s",
                    paired_ratio(*zip(*paces)) if paces else None, SLOWDOWN_TARGET,
                    f"task 0's global steps per second from 2 s after the restarted attempt's first step to the run's "
                    f"end, and over the same global steps in the same round's run without a kill (the launcher's "
                    f"progress history), {len(paces)} pair(s)"))
    held = [p["memory_gb"] for p in plain if p["memory_gb"] is not None]
    rows.append(Row(f"{TITLE}, {where}: memory a standby adds per task", Stat(held) if held else None, None, "GB",
                    None, MEMORY_TARGET, "the most seen of any task: its fork server's and its supervisor's private "
                    "memory (anonymous pages and swap, worker.host.system.private_memory) as `status` shows it, and "
                    "its running attempt's reaper's"))
    return rows


def figure(where: str, kill_epoch: int) -> str:
    return f"{TITLE}, {where}, standby on: one kill -9 at epoch {kill_epoch}, in wall time (baseline: a cold start)"


def run(b: Bench) -> list[Row]:
    rounds = max(b.reps, 1 if b.quick else 3)
    epochs, kills = (QUICK_EPOCHS, QUICK_KILL) if b.quick else (EPOCHS, KILL_EPOCHS)
    rows = one(b, "local", lambda: local_hosts(2, [[0], [1]]), b.env(), lambda _d: LOCAL_DEFAULTS, rounds, epochs,
               kills)
    if b.quick:
        return rows + [Row(f"{TITLE}, over SSH", note="skipped: quick mode", target=TARGET)]
    try:
        th = b.hosts()
    except SkipBench as exc:
        return rows + [Row(f"{TITLE}, over SSH", note=f"skipped: {exc}", target=TARGET)]
    ssh_hosts = [{"address": a, "port": 20000, "cpus": [i]} for i, a in enumerate(th.addresses[:2])]
    return rows + one(b, "SSH (2 namespace hosts)", lambda: ssh_hosts, b.env(th.env()),
                      lambda d: {**LOCAL_DEFAULTS, "python": PY, "workdir": str(d)}, rounds, epochs, kills)


def one(b: Bench, where: str, *args) -> list[Row]:
    """measure(), or a row that says why it failed: one broken setting must not hide the others."""
    try:
        return measure(b, where, *args)
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        return [Row(f"{TITLE}, {where}, standby on", note=f"failed: {first}", target=TARGET)]
