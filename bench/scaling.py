"""Data-parallel scaling: samples/s of 2 workers (one core each) against 1 worker on the same
model and batch, measured inside the workers; each 2-worker run paired with a 1-worker run."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench.common import Bench, bench_line, job_argv
from bench.results import Row
from bench.timing import Stat, paired_ratio

TITLE = "data-parallel scaling"
TARGET = "ratio >= 1.8"


@dataclass
class Case:
    label: str
    short: str  # for the plot
    model: str
    batch: int
    steps: int
    extra: tuple[str, ...] = ()
    target: str = ""


CONV = "small conv net, global pooling (57 k params)"
MNIST = "seeds' MNIST CNN (1.39 M params)"
PACK = ("--bytes-per-pack", str(1 << 20))
PIN_ENV = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}


def cases(quick: bool) -> list[Case]:
    if quick:  # one case: the quick mode shows that the benchmark runs, not how scaling varies with size
        return [Case(f"{CONV}, batch 32", "conv net\nb32", "convnet", 32, 12, (), TARGET)]
    return [
        Case(f"{CONV}, batch 32", "conv net\nb32", "convnet", 32, 40, (), TARGET),
        Case(f"{MNIST}, batch 64", "MNIST CNN\nb64", "mnist", 64, 120),
        Case(f"{MNIST}, batch 64, fp16 gradients", "MNIST\nb64 fp16", "mnist", 64, 120, ("--fp16-grads",)),
        Case(f"{MNIST}, batch 1024", "MNIST\nb1024", "mnist", 1024, 30),
        Case(f"{MNIST}, batch 1024, fp16 gradients", "MNIST\nb1024\nfp16", "mnist", 1024, 30, ("--fp16-grads",)),
        Case(f"{MNIST}, batch 1024, packs of 1 MiB", "MNIST\nb1024\npack", "mnist", 1024, 30, PACK),
        Case(f"{MNIST}, batch 1024, fp16 gradients in packs of 1 MiB", "MNIST\nb1024\nfp16+pack", "mnist", 1024, 30,
             ("--fp16-grads", *PACK)),
        Case(f"{MNIST}, batch 4096, fp16 gradients in packs of 1 MiB", "MNIST\nb4096\nfp16+pack", "mnist", 4096, 16,
             ("--fp16-grads", *PACK)),
    ]


def one_run(b: Bench, case: Case, workers: int) -> dict:
    """The BENCH line of `case` on 1 or 2 workers, each pinned to its own core with 1 TF thread.

    workers=0: two workers that ignore each other (no all-reduce): the ceiling for 2 workers on
    this machine at that moment (both cores busy: memory bandwidth, other jobs, the host).
    """
    warmup = max(3, case.steps // 6)
    extra = (*case.extra, "--no-sync") if workers == 0 else case.extra
    hosts = workers or 2
    command = job_argv(case.model, case.batch, case.steps, warmup, "--threads", "1", *extra)
    res = b.up_local(f"scale-{case.model}-{case.batch}-{workers}w", command, hosts=hosts,
                     cpus=[[0], [1]][:hosts], env=PIN_ENV)
    b.need_ok(res, f"scaling {case.label} ({workers} worker(s))")
    lines = [bench_line(b.task_log(res.run, i)) for i in range(hosts)]
    if not all(lines):
        raise RuntimeError(f"no BENCH line in a task's log of {case.label} ({workers} worker(s))")
    if workers == 0:
        return {**lines[0], "samples_per_sec": sum(x["samples_per_sec"] for x in lines)}
    return lines[0]


def run(b: Bench) -> list[Row]:
    all_cases = cases(b.quick)
    ceiling_case = None if b.quick else next(c for c in all_cases if c.model == "mnist" and c.batch == 1024)
    single: dict[tuple, list[dict]] = {}  # one 1-worker run per model, batch and repetition
    double: dict[str, list[dict]] = {c.label: [] for c in all_cases}
    ceiling: list[dict] = []
    for i in range(b.reps):
        for case in all_cases:
            runs = single.setdefault((case.model, case.batch), [])
            for which in ((1, 2) if i % 2 == 0 else (2, 1)):
                if which == 1 and len(runs) <= i:
                    runs.append(one_run(b, case, 1))
                elif which == 2:
                    double[case.label].append(one_run(b, case, 2))
            b.log(f"    rep {i + 1} {case.label}: 1 worker {runs[-1]['samples_per_sec']:.0f}/s, "
                  f"2 workers {double[case.label][-1]['samples_per_sec']:.0f}/s")
        if ceiling_case:
            ceiling.append(one_run(b, ceiling_case, 0))

    rows, plot = [], []
    for case in all_cases:
        ones, twos = single[(case.model, case.batch)], double[case.label]
        one, two = [r["samples_per_sec"] for r in ones], [r["samples_per_sec"] for r in twos]
        # From the fastest 10% of steps of each run: what the pair does when no other job interrupts it.
        fast = Stat([2 * a["step_ms_p10"] / c["step_ms_p10"] for a, c in zip(ones, twos)])
        note = (f"median step {Stat([r['step_ms_median'] for r in ones]).fmt('ms')} (1 worker) vs "
                f"{Stat([r['step_ms_median'] for r in twos]).fmt('ms')} (2 workers); "
                f"ratio from the fastest 10% of steps {fast.fmt()}")
        rows.append(Row(f"scaling, 2 workers / 1 (samples/s): {case.label}", Stat(two), Stat(one), "samples/s",
                        paired_ratio(two, one), case.target, note))
        plot.append({"label": case.short, "one": statistics.median(one), "two": statistics.median(two),
                     "ratio": paired_ratio(two, one).median})
    if ceiling_case:
        one = [r["samples_per_sec"] for r in single[(ceiling_case.model, ceiling_case.batch)]]
        two = [r["samples_per_sec"] for r in ceiling]
        rows.append(Row(f"ceiling: 2 workers that never all-reduce / 1 worker, seeds' MNIST CNN, batch "
                        f"{ceiling_case.batch}", Stat(two), Stat(one), "samples/s", paired_ratio(two, one), "",
                        "what 2 pinned workers can reach on this machine at all; the gap to the rows above "
                        "is the all-reduce"))
        plot.append({"label": f"MNIST\nb{ceiling_case.batch} no\nall-reduce", "one": statistics.median(one),
                     "two": statistics.median(two), "ratio": paired_ratio(two, one).median})
    b.raw["scaling"] = {"single": {f"{k[0]}-{k[1]}": v for k, v in single.items()}, "double": double,
                        "ceiling": ceiling}
    b.plot["scaling"] = plot
    return rows
