"""Launcher overhead on a short job: `up` of a user's script through `command` (two local
workers) against the same workers started by a hand-written shell script, in alternated pairs."""

from __future__ import annotations

import subprocess

from bench.common import LOCAL_DEFAULTS, Bench, bench_line, job_argv, local_hosts, mgpu_argv, write_spec
from bench.results import Row
from bench.timing import Stat, alternated, paired_ratio, timed

TITLE = "launcher overhead"
TARGET = "ratio <= 1.05"
PAIRS = 15  # the job's own time varies by up to a second from run to run: with 9 pairs the median still swings by ±0.02


def job_span(lines: list[dict | None]) -> float | None:
    """From the first worker's start (its first line of Python) to the last one's end of training, from
    the workers' BENCH lines; None when a worker printed none."""
    if not all(lines):
        return None
    return max(x["end"] for x in lines) - min(x["start"] for x in lines)


def job(b: Bench) -> list[str]:
    """The short job: the seeds' MNIST CNN, batch 64 (also the Ray peer's job)."""
    return job_argv("mnist", 64, 20 if b.quick else 150, 5)


def run(b: Bench) -> list[Row]:
    command = job(b)
    phases: list[dict] = []
    spans: dict[str, list[float | None]] = {"ours": [], "hand": []}

    def ours() -> float:
        res = b.up_local("overhead-up", command)
        b.need_ok(res, "overhead")
        spans["ours"].append(job_span([bench_line(b.task_log(res.run, i)) for i in range(2)]))
        ph, t0 = res.run.get("phases", {}), res.run["_t0"]
        phases.append({"preflight_s": ph.get("preflight_s"),
                       "all_started_s": round(ph["all_started"] - t0, 3) if "all_started" in ph else None,
                       "launcher_cpu_s": round(res.launcher_cpu, 3)})
        return res.wall

    def hand() -> float:
        wall, code, d = b.hand("overhead-hand", command)
        if code != 0:
            raise RuntimeError(f"hand launch failed ({code}); see {d}")
        spans["hand"].append(job_span([bench_line((d / f"worker{i}.log").read_text(errors="replace"))
                                       for i in range(2)]))
        return wall

    ours_s, hand_s = alternated(b.reps if b.quick else max(PAIRS, b.reps), ours, hand)

    # Where the launcher's own time goes, outside the pairs: `check` and `up --dry-run` of such a spec.
    spec = write_spec(b.fresh("overhead-parts") / "cluster.toml", local_hosts(2), command, LOCAL_DEFAULTS)
    parts: dict[str, list[float]] = {"check": [], "dry_run": []}
    for _ in range(1 if b.quick else 3):
        for key, args in (("check", ["check", str(spec)]), ("dry_run", ["up", "--dry-run", str(spec)])):
            wall, r = timed(lambda: subprocess.run([*mgpu_argv(), *args], capture_output=True, text=True,
                                                   env=b.env(), cwd=spec.parent, timeout=120))
            if r.returncode != 0:
                raise RuntimeError(f"mgpu-cluster {' '.join(args)} exited {r.returncode}: {r.stdout[-800:]}{r.stderr[-800:]}")
            parts[key].append(wall)

    b.raw["overhead"] = {"ours": ours_s, "baseline": hand_s, "phases": phases, "parts": parts, "command": command,
                         "spans": spans}
    pre = Stat([p["preflight_s"] for p in phases if p["preflight_s"] is not None])
    started = Stat([p["all_started_s"] for p in phases if p["all_started_s"] is not None])
    note = (f"the job: a script through `command`, the seeds' MNIST CNN, 2 local workers, batch 64, "
            f"{command[command.index('--steps') + 1]} steps; {len(ours_s)} alternated pairs; "
            f"ours - baseline {Stat([a - c for a, c in zip(ours_s, hand_s)]).fmt('s')}; of ours: preflight "
            f"{pre.fmt('s')}, `up` to every task started {started.fmt('s')}; alone: `check` {Stat(parts['check']).fmt('s')}, "
            f"`up --dry-run` {Stat(parts['dry_run']).fmt('s')}")
    rows = [Row("launcher overhead: `mgpu-cluster up` vs shell script (wall)", Stat(ours_s), Stat(hand_s), "s",
                paired_ratio(ours_s, hand_s), TARGET, note)]
    if None not in spans["ours"] + spans["hand"]:
        around_ours = [w - s for w, s in zip(ours_s, spans["ours"])]
        around_hand = [w - s for w, s in zip(hand_s, spans["hand"])]
        job_s = Stat(spans["hand"])
        rows.append(Row("launcher overhead: time around the job (wall less the workers' own span)",
                        Stat(around_ours), Stat(around_hand), "s",
                        Stat([(j + a) / w for j, a, w in zip(spans["hand"], around_ours, hand_s)]), "",
                        "the same pairs; around = `up`'s wall less the span from the first worker's start to the "
                        "last one's end of training (from their BENCH lines): the launcher's start, the "
                        "supervisors', teardown and exit, without the job's own variance (its training time "
                        f"moves by up to a second from run to run); the job itself {job_s.fmt('s')}; "
                        "ratio = (job + ours) / (job + baseline) per pair"))
    return rows
