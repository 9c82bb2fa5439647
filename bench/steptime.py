"""What the straggler timing costs: steps/s of one digits worker pinned to a core, with the step clock
(compute_ms and wait_ms in progress.json) against the same run without it, in alternated pairs."""

from __future__ import annotations

import os
import json
import subprocess

from bench.common import PY, REPO, Bench, SkipBench
from bench.results import Row
from bench.timing import Stat, alternated, paired_ratio

TITLE = "straggler timing, steps/s with / without"
TARGET = "ratio >= 0.98"  # the timing costs under 2% of the steps
STEPS = 1500
BATCH = 32


def run(b: Bench) -> list[Row]:
    if b.quick:
        raise SkipBench("quick mode")
    d = b.fresh("steptime")

    def steps_per_s(clock: bool) -> float:
        env = {**b.env(), "MGPU_RUN_DIR": str(d), "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "",
               "MGPU_STEP_CLOCK": "1" if clock else "0"}
        argv = ["taskset", "-c", "0", PY, "-m", "worker", "--entrypoint", "worker.examples.digits:task",
                "--epochs", "1", "--steps-per-epoch", str(STEPS), "--batch-size-per-replica", str(BATCH)]
        r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        try:  # the epoch's steady rate, after its first step (tracing): fit's own wall time would hide the cost
            rate = json.loads((d / "progress.json").read_text())["samples_per_sec"] / BATCH
        except (OSError, ValueError, KeyError, TypeError):
            rate = None
        if r.returncode != 0 or not rate:
            raise RuntimeError(f"worker exit {r.returncode}: {(r.stdout + r.stderr)[-500:]}")
        return rate

    ours, base = alternated(max(5, b.reps), lambda: steps_per_s(True), lambda: steps_per_s(False))
    b.raw["steptime"] = {"with": ours, "without": base}
    return [Row(f"{TITLE} (one digits worker on core 0, {STEPS} steps)", Stat(ours), Stat(base), "steps/s",
                paired_ratio(ours, base), TARGET,
                f"a tf.timestamp() in the train step where the gradients are ready, and a callback first in fit's "
                f"list; {os.cpu_count()} cores, the worker pinned to core 0")]
