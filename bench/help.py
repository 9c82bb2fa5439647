"""`mgpu-cluster --help` against `python -c pass` (the interpreter's own start), alternated."""

from __future__ import annotations

import subprocess

from bench.common import PY, Bench, mgpu_argv
from bench.results import Row
from bench.timing import Stat, alternated, paired_ratio, timed

TITLE = "`mgpu-cluster --help`"
TARGET = "ours <= 0.3"


def run(b: Bench) -> list[Row]:
    def call(argv: list[str]) -> float:
        return timed(lambda: subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            env=b.env(), check=True))[0]

    ours, base = alternated(3 if b.quick else max(10, b.reps),
                            lambda: call([*mgpu_argv(), "--help"]), lambda: call([PY, "-c", "pass"]))
    b.raw["help"] = {"ours": ours, "baseline": base, "argv": mgpu_argv()}
    return [Row("`mgpu-cluster --help` (baseline: `python -c pass`)", Stat(ours), Stat(base), "s",
                paired_ratio(ours, base), TARGET, f"{len(ours)} alternated pairs")]
