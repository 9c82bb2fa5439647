"""The command line: run the chosen benchmarks, then write the table, the plot and the raw data."""

from __future__ import annotations

import argparse
import compileall
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

from bench import check_scale, failure, help, overhead, ray, restart, scaling, ssh_launch, status, steptime
from bench.common import BENCH, REPO, Bench, SkipBench
from bench.results import Row, write_json, write_plot, write_table

HELP = """mgpu-cluster's benchmarks against their baselines: one command, a table and a plot.

    python -m bench [--quick] [--only NAME,...] [--reps N] [--out DIR]     (or python bench/run.py)

NAME: help, overhead, check-scale, scaling, failure, restart, ssh-launch, status, steptime, ray (one module each in
bench/). Each is measured against a baseline in the same run (interleaved), as the median of
several repetitions with min and max, because the machine is shared and noisy. Writes
DIR/results.md (the table), DIR/results.png (launch time and hosts' CPU against hosts; samples/s
for 1 and 2 workers) and the raw data in DIR/out/results.json (DIR defaults to bench/). --quick:
one repetition, smallest sizes, no SSH and no Ray; about three minutes. The SSH benchmarks need
root, `ip` and `sshd` (deploy/testhosts/); the Ray peer gets its own venv in bench/.venv-ray
(created on first use).
"""

BENCHMARKS = {"help": help, "overhead": overhead, "check-scale": check_scale, "scaling": scaling,
              "failure": failure, "restart": restart, "ssh-launch": ssh_launch, "status": status, "steptime": steptime,
              "ray": ray}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 repetition, smallest sizes, no SSH, no Ray (~3 min)")
    p.add_argument("--only", default="", help=f"comma-separated benchmarks: {','.join(BENCHMARKS)}")
    p.add_argument("--reps", type=int, default=0, help="repetitions (default 3; 1 with --quick)")
    p.add_argument("--out", type=Path, default=BENCH, help="folder for results.md, results.png and out/ (default bench/)")
    args = p.parse_args(argv)
    chosen = [n.strip().replace("_", "-") for n in args.only.split(",") if n.strip()] or list(BENCHMARKS)
    unknown = [n for n in chosen if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        p.error("the plot needs matplotlib: pip install matplotlib (or pip install -e '.[test]')")

    # An installed package has its bytecode. A checkout run with PYTHONDONTWRITEBYTECODE=1 (as on these
    # machines) would compile launcher/ and worker/ at every start: we would time the compiler.
    for package in ("launcher", "worker"):
        compileall.compile_dir(REPO / package, quiet=1)
    b = Bench(args.quick, args.reps or (1 if args.quick else 3), args.out)
    shutil.rmtree(b.scratch, ignore_errors=True)
    b.scratch.mkdir(parents=True)
    started, load = time.time(), os.getloadavg()
    rows: list[Row] = []
    try:
        for name in chosen:
            module, t0 = BENCHMARKS[name], time.time()
            b.log(f"[bench] {module.TITLE} ...")
            try:
                new = module.run(b)
            except SkipBench as exc:
                new = [Row(module.TITLE, note=f"skipped: {exc}", target=module.TARGET)]
                b.raw.setdefault("skipped", {})[name] = str(exc)
            except Exception as exc:  # noqa: BLE001 - one broken benchmark must not hide the others
                (b.scratch / f"{name}.error.txt").write_text(traceback.format_exc())
                first = (str(exc).strip().splitlines() or [""])[0]
                new = [Row(module.TITLE, note=f"failed: {type(exc).__name__}: {first} (details: out/{name}.error.txt)",
                           target=module.TARGET)]
            rows += new
            for r in new:
                b.log("  " + r.line())
            b.log(f"  ({time.time() - t0:.0f} s)")
    finally:
        b.close()
    command = "python -m bench" + " ".join(["", *(argv if argv is not None else sys.argv[1:])]).rstrip()
    write_json(b.scratch / "results.json", rows, b.raw, quick=b.quick, reps=b.reps, command=command)
    table = write_table(b.out_dir / "results.md", rows, command, started, load, b.reps)
    plot = write_plot(b.out_dir / "results.png", b.plot, b.raw.get("skipped", {}).get("ssh-launch", "not chosen"))
    b.log(f"[bench] wrote {table} and {plot} in {time.time() - started:.0f} s")
    return 0
