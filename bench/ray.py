"""The peer: the overhead benchmark's job through Ray Train's TensorflowTrainer (2 CPU workers)
against `up` of the same job, alternated; Ray gets its own venv, bench/.venv-ray."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import time

from bench import overhead
from bench.common import BENCH, PY, Bench, SkipBench, bench_line, tail
from bench.results import Row
from bench.timing import Stat, alternated, paired_ratio

TITLE = "peer: Ray Train"
TARGET = "ratio <= 0.5"
PEER = BENCH / "jobs" / "ray_peer.py"
VENV = BENCH / ".venv-ray"


def ray_python():
    """bench/.venv-ray's python with ray[train] (created on first use; it sees TensorFlow via system site)."""
    py = VENV / "bin" / "python"
    ok = py.exists() and subprocess.run([str(py), "-c", "import ray.train.tensorflow"], capture_output=True,
                                        timeout=120).returncode == 0
    if not ok:
        subprocess.run([PY, "-m", "venv", "--system-site-packages", str(VENV)], check=True, capture_output=True)
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", "ray[train]", "tf-keras"], capture_output=True,
                           text=True, timeout=1200)
        if r.returncode != 0:
            raise SkipBench("ray could not be installed: " + (r.stderr.strip().splitlines() or ["?"])[-1][:300])
    return py


def run(b: Bench) -> list[Row]:
    if b.quick:
        raise SkipBench("quick mode")
    py = ray_python()
    command = overhead.job(b)
    ray_lines, ray_times = [], []

    def ours() -> float:
        res = b.up_local("ray-ours", command)
        b.need_ok(res, "ray benchmark, ours")
        return res.wall

    def peer() -> float:
        d = b.fresh("ray-peer")
        t0 = time.time()
        r = subprocess.run([str(py), str(PEER), "--storage", str(d), "--", *command[2:]], capture_output=True,
                           text=True, env=b.env(), cwd=d, timeout=600)
        wall = time.time() - t0
        (d / "ray.out").write_text(r.stdout + r.stderr)
        if r.returncode != 0:
            raise RuntimeError(f"Ray peer failed (exit {r.returncode}); see {d / 'ray.out'}:\n"
                               + tail(r.stdout + r.stderr, 15))
        ray_lines.append(bench_line(r.stdout + r.stderr))
        ray_times.append(next((ln[len("RAY-TIMES "):] for ln in r.stdout.splitlines()
                               if ln.startswith("RAY-TIMES ")), None))
        return wall

    ours_s, ray_s = alternated(b.reps, ours, peer)
    b.raw["ray"] = {"ours": ours_s, "ray": ray_s, "ray_bench": ray_lines, "ray_times": ray_times}
    version = subprocess.run([str(py), "-c", "import ray; print(ray.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    times = [t for t in ray_times if t]
    return [Row(f"peer: same job via Ray Train TensorflowTrainer {version} (2 CPU workers), wall", Stat(ours_s),
                Stat(ray_s), "s", paired_ratio(ours_s, ray_s), TARGET,
                f"baseline column = Ray; the job of the overhead row; Ray - ours "
                f"{Stat([p - o for p, o in zip(ray_s, ours_s)]).fmt('s')}; Ray's driver: {times[-1] if times else '?'}; "
                f"tensorflow {md.version('tensorflow')}")]
