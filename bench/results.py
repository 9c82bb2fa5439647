"""The results: one Row per figure, written as bench/results.md (table), results.png (plot)
and out/results.json (raw data)."""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from bench.timing import Stat


@dataclass
class Row:
    """One line of the table: ours against a baseline, and the target either applies to."""

    figure: str
    ours: Stat | None = None
    baseline: Stat | None = None
    unit: str = "s"
    ratio: Stat | None = None
    target: str = ""  # "ratio <= 1.05", "ratio >= 1.8", "ours <= 1" or "" (reported only)
    note: str = ""

    @property
    def met(self) -> bool | None:
        if not self.target:
            return None
        what, op, value = self.target.split()
        stat = self.ratio if what == "ratio" else self.ours
        if stat is None or not stat.values:
            return None
        return stat.median <= float(value) if op == "<=" else stat.median >= float(value)

    @property
    def ran(self) -> bool:
        return not self.note.startswith(("skipped", "failed"))

    def as_dict(self) -> dict:
        return {"figure": self.figure, "unit": self.unit, "target": self.target, "met": self.met, "note": self.note,
                **{k: getattr(self, k).as_dict() for k in ("ours", "baseline", "ratio") if getattr(self, k)}}

    def line(self) -> str:
        def cell(s: Stat | None, unit: str = "") -> str:
            return s.fmt(unit) if s else "-"
        met = {True: "met", False: "NOT met", None: "-"}[self.met]
        return (f"{self.figure}: ours {cell(self.ours, self.unit)}, baseline {cell(self.baseline, self.unit)}, "
                f"ratio {cell(self.ratio)}, target {self.target or '-'}: {met} {self.note[:160]}")


def machine() -> str:
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    versions = []
    for dist in ("tensorflow", "tf-keras", "fabric"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions.append(f"{dist} {md.version(dist)}")
    return (f"{os.cpu_count()} x {cpu}, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, {', '.join(versions)}")


def write_json(path: Path, rows: list[Row], raw: dict, **meta) -> Path:
    path.write_text(json.dumps({"machine": machine(), **meta, "rows": [r.as_dict() for r in rows], "raw": raw},
                               indent=1, default=str))
    return path


def write_table(path: Path, rows: list[Row], command: str, started: float, load: tuple, reps: int) -> Path:
    def cell(s: Stat | None, unit: str) -> str:
        return s.fmt(unit) if s else "-"

    lines = [
        "# mgpu-cluster benchmarks",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M', time.localtime(started))} with `{command}` in "
        f"{time.time() - started:.0f} s; {reps} repetition(s) unless a note says how many pairs; each figure "
        "against its baseline in the same run, interleaved; launcher/ and worker/ byte-compiled first, as an "
        "installed package is.",
        f"Machine: {machine()}; load average at start {load[0]:.1f}, at end {os.getloadavg()[0]:.1f} "
        "(shared with other jobs: figures are median [min-max]).",
        "",
        "| figure | ours | baseline | ratio | target | met? |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        met = {True: "yes", False: "**no**", None: "-"}[r.met] if r.ran else "not run"
        target = r.target.replace("<=", "≤").replace(">=", "≥") or "reported"
        lines.append(f"| {r.figure} | {cell(r.ours, r.unit)} | {cell(r.baseline, r.unit)} | "
                     f"{cell(r.ratio, '')} | {target} | {met} |")
    lines += ["", "Notes:", ""]
    lines += [f"- {r.figure}: {r.note}" for r in rows if r.note]
    lines += ["", "Ratios are ours / baseline per repetition (paired), then median [min-max]. Raw data: "
              "`out/results.json` beside this file. Plot: `results.png`.", ""]
    path.write_text("\n".join(lines))
    return path


def write_plot(path: Path, plot: dict, why_no_ssh: str = "quick mode") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    launch = plot.get("ssh_launch")
    if launch:
        ns = sorted(launch)
        ax1.plot(ns, [launch[n]["running_s"] for n in ns], "o-", label="`up` to every task running")
        ax1.plot(ns, [launch[n]["finished_s"] for n in ns], "s-", label="`up` to every task finished")
        if 2 in launch:
            ax1.axhline(1.5 * launch[2]["running_s"], ls=":", c="grey", label="target: 1.5 x 2 hosts (running)")
        if all(launch[n].get("cpu_per_host_s") is not None for n in ns):
            ax1.plot(ns, [launch[n]["cpu_per_host_s"] for n in ns], "^--", label="hosts' CPU per host (CPU s)")
        ax1.set_xscale("log", base=2)
        ax1.set_xticks(ns, [str(n) for n in ns])
        ax1.legend()
    else:
        ax1.text(0.5, 0.5, f"launch over SSH not measured\n({why_no_ssh})", ha="center", va="center",
                 transform=ax1.transAxes, wrap=True)
    ax1.set_xlabel("hosts (network namespaces with sshd)")
    ax1.set_ylabel("seconds (median)")
    ax1.set_title("launch time against number of hosts, trivial command")
    scaling = plot.get("scaling") or []
    if scaling:
        xs = range(len(scaling))
        w = 0.38
        ax2.bar([x - w / 2 for x in xs], [s["one"] for s in scaling], w, label="1 worker, 1 core")
        ax2.bar([x + w / 2 for x in xs], [s["two"] for s in scaling], w, label="2 workers, 1 core each")
        for x, s in zip(xs, scaling):
            ax2.text(x + w / 2, s["two"], f"x{s['ratio']:.2f}", ha="center", va="bottom", fontsize=7)
        ax2.set_xticks(list(xs), [s["label"] for s in scaling], fontsize=6)
        ax2.set_yscale("log")
        ax2.legend()
    else:
        ax2.text(0.5, 0.5, "scaling not measured", ha="center", va="center", transform=ax2.transAxes)
    ax2.set_ylabel("samples/s (median, log scale)")
    ax2.set_title("data-parallel scaling: samples/s for 1 and 2 workers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
