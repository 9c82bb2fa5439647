#!/usr/bin/env python3
"""mgpu-cluster's benchmarks against their baselines: one command, a table and a plot.

    python bench/run.py [--quick] [--only NAME,...] [--reps N] [--out DIR]

Figures (NAME): help, overhead, scaling, failure, ssh-launch, status, ray. Each is measured
against a baseline in the same run (interleaved), as the median of several repetitions with
min and max, because the machine is shared and noisy. Writes DIR/results.md (the table),
DIR/results.png (launch time against hosts; samples/s for 1 and 2 workers) and the raw data
in DIR/out/results.json (DIR defaults to bench/). --quick: one repetition, smallest sizes, no
SSH and no Ray; under two minutes. The SSH figures need root, `ip` and `sshd`
(deploy/testhosts.py); the Ray peer gets its own venv in bench/.venv-ray (created on first use).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
JOB = BENCH / "jobs" / "train.py"
HAND = BENCH / "jobs" / "hand_launch.sh"
RAY_PEER = BENCH / "ray_peer.py"
RAY_VENV = BENCH / ".venv-ray"
PY = sys.executable
FIGURES = ("help", "overhead", "scaling", "failure", "ssh-launch", "status", "ray")
SSH_SIZES = (1, 2, 4, 8, 16)


# --------------------------------------------------------------------------- numbers

@dataclass
class Stat:
    """Repeated measurements of one quantity; shown as median [min-max]."""

    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def fmt(self, unit: str = "", digits: int = 3) -> str:
        def f(v: float) -> str:
            return f"{v:.{digits}g}" if abs(v) < 10 ** digits else f"{v:.0f}"
        if not self.values:
            return "-"
        text = f(self.median) + (f" {unit}" if unit else "")
        if len(self.values) > 1:
            text += f" [{f(min(self.values))}-{f(max(self.values))}]"
        return text

    def as_dict(self) -> dict:
        return {"median": self.median, "min": min(self.values), "max": max(self.values), "values": self.values}


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

    def as_dict(self) -> dict:
        return {"figure": self.figure, "unit": self.unit, "target": self.target, "met": self.met, "note": self.note,
                **{k: getattr(self, k).as_dict() for k in ("ours", "baseline", "ratio") if getattr(self, k)}}


def paired_ratio(ours: list[float], base: list[float]) -> Stat:
    return Stat([a / b for a, b in zip(ours, base) if b])


# --------------------------------------------------------------------------- processes

def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def mgpu_argv() -> list[str]:
    """The console script users run (next to this interpreter, not a pyenv shim), else -m launcher."""
    script = Path(PY).parent / "mgpu-cluster"
    if script.exists():
        return [str(script)]
    found = shutil.which("mgpu-cluster")
    return [found] if found else [PY, "-m", "launcher"]


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(v)


def write_spec(path: Path, hosts: list[dict], command: list[str], defaults: dict | None = None,
               launch: dict | None = None) -> Path:
    lines = []
    if defaults:
        lines += ["[defaults]"] + [f"{k} = {toml_value(v)}" for k, v in defaults.items()] + [""]
    for h in hosts:
        lines += ["[[hosts]]"] + [f"{k} = {toml_value(v)}" for k, v in h.items()] + [""]
    lines += ["[training]", f"command = {toml_value(command)}", ""]
    if launch:
        lines += ["[launch]"] + [f"{k} = {toml_value(v)}" for k, v in launch.items()] + [""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def job_argv(model: str, batch: int, steps: int, warmup: int, *extra: str) -> list[str]:
    return [PY, str(JOB), "--model", model, "--batch", str(batch), "--steps", str(steps),
            "--warmup", str(warmup), *extra]


def bench_line(text: str) -> dict | None:
    """The last `BENCH {json}` line of a worker's output."""
    found = None
    for line in text.splitlines():
        at = line.find("BENCH {")
        if at >= 0:
            with contextlib.suppress(ValueError):
                found = json.loads(line[at + 6:])
    return found


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def machine_cpu() -> float:
    """CPU seconds used by everything on this machine so far (/proc/stat: busy time of all cores)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait
        return busy / os.sysconf("SC_CLK_TCK")
    return 0.0


def alive(pid: int | None) -> bool:
    """A process that exists and is not a zombie (nothing reaps here: PID 1 doesn't)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_tree(proc: subprocess.Popen) -> None:
    """Stop what a bench step started (its own session) if it is still there."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


@dataclass
class UpResult:
    wall: float
    code: int
    run: dict
    output: str
    launcher_cpu: float
    machine_cpu: float = 0.0


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.quick: bool = args.quick
        self.reps: int = args.reps or (1 if args.quick else 3)
        self.out_dir: Path = args.out.resolve()
        self.scratch: Path = self.out_dir / "out"
        self.home = self.scratch / "mgpu-home"
        self.rows: list[Row] = []
        self.raw: dict = {}
        self.plot: dict = {}
        self.log = print
        self._hosts = None
        self._hosts_error: str | None = None
        self._seq = 0

    # ---- plumbing shared by the figures
    def fresh(self, name: str) -> Path:
        self._seq += 1
        d = self.scratch / f"{self._seq:03d}-{name}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def env(self, base: dict | None = None) -> dict:
        env = dict(os.environ if base is None else base)
        env.update(MGPU_HOME=str(self.home), COLUMNS="200", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
        return env

    def runs(self) -> set[str]:
        d = self.home / "runs"
        return {p.name for p in d.iterdir()} if d.exists() else set()

    def run_state(self, run_id: str) -> dict:
        with contextlib.suppress(OSError, ValueError):
            return json.loads((self.home / "runs" / run_id / "state.json").read_text())
        return {}

    def up(self, spec: Path, env: dict | None = None, timeout: float = 600, args: tuple = ()) -> UpResult:
        """`mgpu-cluster up SPEC`, timed from start to exit; the run's state.json with it."""
        before = self.runs()
        log = spec.with_suffix(".out")
        cpu0, mcpu0 = children_cpu(), machine_cpu()
        with open(log, "w") as out:
            t0 = time.time()
            proc = subprocess.Popen([*mgpu_argv(), "up", str(spec), *args], stdout=out, stderr=subprocess.STDOUT,
                                    env=env or self.env(), cwd=spec.parent, start_new_session=True)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                kill_tree(proc)
                raise RuntimeError(f"mgpu-cluster up {spec} did not finish within {timeout:.0f} s; see {log}")
            wall = time.time() - t0
        new = sorted(self.runs() - before)
        run = self.run_state(new[-1]) if new else {}
        run["_t0"] = t0
        return UpResult(wall, code, run, log.read_text(errors="replace"), children_cpu() - cpu0,
                        machine_cpu() - mcpu0)

    def task_log(self, run: dict, index: int, workdir: Path | None = None) -> str:
        run_dir = Path(run["tasks"][index]["run_dir"])
        if not run_dir.is_absolute() and workdir:
            run_dir = workdir / run_dir
        with contextlib.suppress(OSError):
            return (run_dir / "worker.log").read_text(errors="replace")
        return ""

    def need_ok(self, res: UpResult, what: str) -> None:
        if res.code != 0:
            tail = "\n".join(res.output.splitlines()[-25:])
            raise RuntimeError(f"{what}: mgpu-cluster up exited {res.code}:\n{tail}")

    # ---- SSH test hosts (deploy/testhosts.py), made once and shared by the SSH figures
    def hosts(self, n: int):
        if self._hosts is None and self._hosts_error is None:
            try:
                if os.geteuid() != 0:
                    raise RuntimeError("needs root (network namespaces)")
                if not Path("/usr/sbin/sshd").exists():
                    raise RuntimeError("needs /usr/sbin/sshd (apt-get install -y openssh-server)")
                sys.path.insert(0, str(REPO / "deploy"))
                from testhosts import TestHosts

                th = TestHosts(max(SSH_SIZES), self.scratch / "testhosts")
                t0 = time.time()
                th.up()
                self._hosts = th
                self.log(f"  {th.n} namespace hosts with sshd up in {time.time() - t0:.1f} s")
            except Exception as exc:  # noqa: BLE001 - any failure here skips the SSH figures, with the reason
                self._hosts_error = f"{type(exc).__name__}: {exc}".strip()[:400]
        if self._hosts is None:
            raise SkipFigure(f"SSH test hosts unavailable ({self._hosts_error})")
        return self._hosts

    def close(self) -> None:
        if self._hosts is not None:
            with contextlib.suppress(Exception):
                self._hosts.down()
            self._hosts = None


class SkipFigure(Exception):
    pass


# --------------------------------------------------------------------------- 5b. --help

def fig_help(b: Bench) -> list[Row]:
    reps = 3 if b.quick else 10
    ours, base = [], []
    for i in range(reps):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            argv = [*mgpu_argv(), "--help"] if which == 0 else [PY, "-c", "pass"]
            t0 = time.time()
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=b.env(), check=True)
            (ours if which == 0 else base).append(time.time() - t0)
    b.raw["help"] = {"ours": ours, "baseline": base, "argv": mgpu_argv()}
    return [Row("`mgpu-cluster --help` (baseline: `python -c pass`)", Stat(ours), Stat(base), "s",
                paired_ratio(ours, base), "ours <= 0.3")]


# --------------------------------------------------------------------------- 1. launcher overhead

def overhead_job(b: Bench) -> list[str]:
    steps = 20 if b.quick else 150  # about the reference job: ~11 s when launched by hand
    return job_argv("mnist", 64, steps, 5)


def run_ours_local(b: Bench, name: str, command: list[str], hosts: int = 2, cpus: list | None = None,
                   env: dict | None = None, launch: dict | None = None) -> UpResult:
    d = b.fresh(name)
    ports = free_ports(hosts)
    host_tables = []
    for i, port in enumerate(ports):
        h = {"address": "localhost", "port": port}
        if cpus:
            h["cpus"] = cpus[i]
        host_tables.append(h)
    defaults = {"gpus": "none", "env": {"TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}}
    spec = write_spec(d / "cluster.toml", host_tables, command, defaults, launch)
    return b.up(spec)


def run_hand(b: Bench, name: str, command: list[str], cpus: tuple[str, str] | None = None,
             env: dict | None = None) -> tuple[float, int, Path]:
    d = b.fresh(name)
    p0, p1 = free_ports(2)
    argv = ["bash", str(HAND), str(p0), str(p1), str(d), *(cpus or ()), "--", *command]
    t0 = time.time()
    with open(d / "hand.out", "w") as out:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env={**b.env(), **(env or {})},
                              cwd=d, timeout=600).returncode
    return time.time() - t0, code, d


def fig_overhead(b: Bench) -> list[Row]:
    command = overhead_job(b)
    ours, base, phases = [], [], []
    for i in range(b.reps if b.quick else max(5, b.reps)):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            if which == 0:
                res = run_ours_local(b, "overhead-up", command)
                b.need_ok(res, "overhead")
                ours.append(res.wall)
                ph = res.run.get("phases", {})
                phases.append({"preflight_s": ph.get("preflight_s"),
                               "spawn_started_s": round(ph.get("spawn_started", 0) - res.run["_t0"], 3),
                               "all_started_s": round(ph.get("all_started", 0) - res.run["_t0"], 3),
                               "launcher_cpu_s": round(res.launcher_cpu, 3)})
            else:
                wall, code, d = run_hand(b, "overhead-hand", command)
                if code != 0:
                    raise RuntimeError(f"hand launch failed ({code}); see {d}")
                base.append(wall)
    b.raw["overhead"] = {"ours": ours, "baseline": base, "phases": phases, "command": command}
    pre = Stat([p["preflight_s"] for p in phases if p["preflight_s"] is not None])
    started = Stat([p["all_started_s"] for p in phases])
    extra = Stat([a - c for a, c in zip(ours, base)])
    note = (f"the job: the seeds' MNIST CNN, 2 local workers, batch 64, {command[command.index('--steps') + 1]} steps; "
            f"ours - baseline {extra.fmt('s')}; of ours: preflight {pre.fmt('s')}, "
            f"`up` to every task started {started.fmt('s')}")
    return [Row("launcher overhead: `mgpu-cluster up` vs shell script (wall)", Stat(ours), Stat(base), "s",
                paired_ratio(ours, base), "ratio <= 1.05", note)]


# --------------------------------------------------------------------------- 2. data-parallel scaling

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


def scaling_cases(quick: bool) -> list[Case]:
    if quick:
        return [Case(f"{CONV}, batch 32", "conv net\nb32", "convnet", 32, 12, (), "ratio >= 1.8"),
                Case(f"{MNIST}, batch 64", "MNIST CNN\nb64", "mnist", 64, 30)]
    return [
        Case(f"{CONV}, batch 32", "conv net\nb32", "convnet", 32, 40, (), "ratio >= 1.8"),
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


PIN_ENV = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}


def scaling_run(b: Bench, case: Case, workers: int) -> dict:
    """Samples/s of `case` on 1 or 2 workers, each pinned to its own core with 1 TF thread.

    workers=0: two workers that ignore each other (no all-reduce): the ceiling for 2 workers on
    this machine at that moment (both cores busy: memory bandwidth, other jobs, the host).
    """
    warmup = max(3, case.steps // 6)
    extra = (*case.extra, "--no-sync") if workers == 0 else case.extra
    hosts = workers or 2
    command = job_argv(case.model, case.batch, case.steps, warmup, "--threads", "1", *extra)
    res = run_ours_local(b, f"scale-{case.model}-{case.batch}-{workers}w", command, hosts=hosts,
                         cpus=[[0], [1]][:hosts], env=PIN_ENV)
    b.need_ok(res, f"scaling {case.label} ({workers} worker(s))")
    lines = [bench_line(b.task_log(res.run, i)) for i in range(hosts)]
    if not all(lines):
        raise RuntimeError(f"no BENCH line in a task's log of {case.label} ({workers} worker(s))")
    if workers == 0:
        return {**lines[0], "samples_per_sec": sum(x["samples_per_sec"] for x in lines)}
    return lines[0]


def fig_scaling(b: Bench) -> list[Row]:
    cases = scaling_cases(b.quick)
    ceiling_case = None if b.quick else next(c for c in cases if c.model == "mnist" and c.batch == 1024)
    ceiling: list[dict] = []
    single: dict[tuple, list[dict]] = {}
    double: dict[str, list[dict]] = {c.label: [] for c in cases}
    for i in range(b.reps):
        for case in cases:
            key = (case.model, case.batch)
            runs = single.setdefault(key, [])
            order = ("1", "2") if i % 2 == 0 else ("2", "1")
            for which in order:
                if which == "1" and len(runs) <= i:  # one single-worker baseline per model, batch and rep
                    runs.append(scaling_run(b, case, 1))
                elif which == "2":
                    double[case.label].append(scaling_run(b, case, 2))
            b.log(f"    rep {i + 1} {case.label}: 1 worker {runs[-1]['samples_per_sec']:.0f}/s, "
                  f"2 workers {double[case.label][-1]['samples_per_sec']:.0f}/s")
        if ceiling_case:
            ceiling.append(scaling_run(b, ceiling_case, 0))
            b.log(f"    rep {i + 1} ceiling ({ceiling_case.label}, no all-reduce): {ceiling[-1]['samples_per_sec']:.0f}/s")
    rows, plot = [], []
    for case in cases:
        one = [r["samples_per_sec"] for r in single[(case.model, case.batch)]]
        two = [r["samples_per_sec"] for r in double[case.label]]
        steps2 = Stat([r["step_ms_median"] for r in double[case.label]])
        steps1 = Stat([r["step_ms_median"] for r in single[(case.model, case.batch)]])
        # From the fastest 10% of steps of each run: what the pair does when no other job interrupts it.
        fast = Stat([2 * a["step_ms_p10"] / c["step_ms_p10"]
                     for a, c in zip(single[(case.model, case.batch)], double[case.label])])
        note = (f"median step {steps1.fmt('ms')} (1 worker) vs {steps2.fmt('ms')} (2 workers); "
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
        plot.append({"label": f"MNIST\nb{ceiling_case.batch} no\nall-reduce",
                     "one": statistics.median(one), "two": statistics.median(two),
                     "ratio": paired_ratio(two, one).median})
    b.raw["scaling"] = {"single": {f"{k[0]}-{k[1]}": v for k, v in single.items()}, "double": double,
                        "ceiling": ceiling}
    b.plot["scaling"] = plot
    return rows


# --------------------------------------------------------------------------- 4. failure detection

def wait_for(cond: Callable[[], object], timeout: float, what: str, poll: float = 0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def kill_and_time(victim: int, others: list[int], limit: float, gone: dict | None = None) -> float | None:
    """kill -9 `victim`; seconds until every pid in `others` is gone (None: still there at `limit`).

    `gone`, when given, gets each pid's own time."""
    os.kill(victim, signal.SIGKILL)
    t0 = time.time()
    gone = {} if gone is None else gone
    while time.time() - t0 < limit:
        for p in others:
            if p not in gone and not alive(p):
                gone[p] = round(time.time() - t0, 3)
        if len(gone) == len(others):
            return time.time() - t0
        time.sleep(0.01)
    return None


def failure_ours(b: Bench, name: str, spec: Path, env: dict, workdir: Path | None = None) -> float:
    """Start `up`, wait until both workers train, kill -9 task 1, time until task 0 is gone."""
    before = b.runs()
    out = open(spec.with_suffix(".out"), "w")
    proc = subprocess.Popen([*mgpu_argv(), "up", str(spec)], stdout=out, stderr=subprocess.STDOUT, env=env,
                            cwd=spec.parent, start_new_session=True)
    try:
        def training():
            new = sorted(b.runs() - before)
            run = b.run_state(new[-1]) if new else {}
            if run.get("state") == "running" and all(
                    "BENCH-READY" in b.task_log(run, t["index"], workdir) for t in run["tasks"]):
                return run
            if proc.poll() is not None:
                raise RuntimeError(f"{name}: up exited {proc.returncode} early; see {spec.with_suffix('.out')}")
            return None

        run = wait_for(training, 180, f"{name}: both workers training")
        t0, t1 = run["tasks"]
        gone: dict = {}
        took = kill_and_time(t1["pid"], [t0["pid"], t0["supervisor_pid"]], 30, gone)
        b.raw.setdefault("failure_detail", []).append(
            {"name": name, "worker_gone_s": gone.get(t0["pid"]), "supervisor_gone_s": gone.get(t0["supervisor_pid"])})
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if took is None:
            raise RuntimeError(f"{name}: task 0 still running 30 s after task 1 was killed")
        return took
    finally:
        kill_tree(proc)
        out.close()


def failure_hand(b: Bench, command: list[str], limit: float) -> float | None:
    """Baseline: hand-launched workers, kill -9 worker 1, time until worker 0 exits on its own."""
    d = b.fresh("failure-hand")
    p0, p1 = free_ports(2)
    proc = subprocess.Popen(["bash", str(HAND), str(p0), str(p1), str(d), "--", *command], env=b.env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=d, start_new_session=True)
    try:
        def logs_ready():
            texts = [(d / f"worker{i}.log").read_text(errors="replace") if (d / f"worker{i}.log").exists() else ""
                     for i in (0, 1)]
            return all("BENCH-READY" in t for t in texts)

        wait_for(logs_ready, 180, "hand-launched workers training")
        import psutil

        workers = {}
        for child in psutil.Process(proc.pid).children():
            with contextlib.suppress(psutil.Error, ValueError):
                workers[json.loads(child.environ()["TF_CONFIG"])["task"]["index"]] = child.pid
        return kill_and_time(workers[1], [workers[0]], limit)
    finally:
        kill_tree(proc)


def fig_failure(b: Bench) -> list[Row]:
    command = job_argv("mnist", 64, 1_000_000, 5)
    rows = []
    local = []
    for _ in range(b.reps):
        d = b.fresh("failure-up")
        spec = write_spec(d / "cluster.toml", [{"address": "localhost", "port": p} for p in free_ports(2)], command,
                          {"gpus": "none", "env": {"TF_CPP_MIN_LOG_LEVEL": "2"}})
        local.append(failure_ours(b, "failure (local)", spec, b.env()))
    base = None
    if not b.quick:
        limit = 60.0
        took = failure_hand(b, command, limit)
        base = Stat([took if took is not None else limit])
        b.raw["failure_hand_hung"] = took is None
    detail = [d for d in b.raw.get("failure_detail", []) if d["name"] == "failure (local)"]
    note = ("gone = the surviving worker and its supervisor; worker itself gone after "
            f"{Stat([d['worker_gone_s'] for d in detail if d['worker_gone_s'] is not None]).fmt('s')}; "
            "baseline: the same workers started by hand, the survivor left to TensorFlow's own detection" +
            (" (still running at 60 s: shown as 60)" if b.raw.get("failure_hand_hung") else ""))
    rows.append(Row("failure detection, local: kill -9 of one worker -> every other worker gone", Stat(local), base,
                    "s", paired_ratio(local, base.values * len(local)) if base else None, "ours <= 2", note))
    b.raw["failure_local"] = local
    if b.quick:
        return rows
    try:
        th = b.hosts(2)
    except SkipFigure as exc:
        rows.append(Row("failure detection over SSH", note=f"skipped: {exc}", target="ours <= 2"))
        return rows
    remote = []
    for _ in range(b.reps):
        d = b.fresh("failure-ssh")
        spec = write_spec(d / "cluster.toml", [{"address": a, "port": 20000} for a in th.addresses[:2]], command,
                          {"gpus": "none", "python": PY, "workdir": str(d), "env": {"TF_CPP_MIN_LOG_LEVEL": "2"}})
        remote.append(failure_ours(b, "failure (SSH)", spec, b.env(th.env()), d))
    b.raw["failure_ssh"] = remote
    rows.append(Row("failure detection over SSH (2 namespace hosts)", Stat(remote), base, "s",
                    paired_ratio(remote, base.values * len(remote)) if base else None, "ours <= 2",
                    "same job and baseline as the local row"))
    return rows


# --------------------------------------------------------------------------- 3. launch scaling over SSH

def fig_ssh_launch(b: Bench) -> list[Row]:
    if b.quick:
        raise SkipFigure("quick mode")
    th = b.hosts(max(SSH_SIZES))
    data: dict[int, list[dict]] = {n: [] for n in SSH_SIZES}
    for i in range(b.reps):
        for n in (SSH_SIZES if i % 2 == 0 else SSH_SIZES[::-1]):
            d = b.fresh(f"ssh-launch-{n}")
            (d / "work").mkdir()
            spec = write_spec(d / "cluster.toml", [{"address": a, "port": 20000} for a in th.addresses[:n]],
                              ["true"], {"python": PY, "workdir": str(d / "work")})
            res = b.up(spec, b.env(th.env()), timeout=300)
            b.need_ok(res, f"launch over SSH on {n} hosts")
            ph, t0 = res.run.get("phases", {}), res.run["_t0"]
            # A trivial task may end before the last one starts: "every task running" is when the
            # launcher got the last task's "started" report (per task in state.json).
            started = max(t["started_at"] for t in res.run["tasks"])
            data[n].append({"running_s": started - t0, "finished_s": res.wall,
                            "preflight_s": ph.get("preflight_s"), "spawn_s": started - ph["spawn_started"],
                            "launcher_cpu_s": res.launcher_cpu, "machine_cpu_s": res.machine_cpu})
        b.log(f"    rep {i + 1}: " + ", ".join(f"{n} hosts {data[n][-1]['running_s']:.2f}/{data[n][-1]['finished_s']:.2f} s"
                                               for n in SSH_SIZES))
    b.raw["ssh_launch"] = data
    b.plot["ssh_launch"] = {n: {k: statistics.median(r[k] for r in rows) for k in ("running_s", "finished_s")}
                            for n, rows in data.items()}
    rows = []
    for key, what in (("running_s", "every task running"), ("finished_s", "every task finished")):
        ours = [r[key] for r in data[16]]
        base = [r[key] for r in data[2]]
        pre16 = Stat([r["preflight_s"] for r in data[16]])
        cpu16 = Stat([r["launcher_cpu_s"] for r in data[16]])
        all16 = Stat([r["machine_cpu_s"] for r in data[16]])
        all2 = Stat([r["machine_cpu_s"] for r in data[2]])
        note = (f"1/2/4/8/16 hosts: " + " / ".join(f"{statistics.median(r[key] for r in data[n]):.2f}" for n in SSH_SIZES)
                + f" s; 16 hosts: preflight {pre16.fmt('s')}, launcher process CPU {cpu16.fmt('s')}, CPU of all "
                  f"processes on the machine {all16.fmt('s')} (2 hosts: {all2.fmt('s')}) on {os.cpu_count()} cores"
                if key == "running_s"
                else "1/2/4/8/16 hosts: " + " / ".join(f"{statistics.median(r[key] for r in data[n]):.2f}" for n in SSH_SIZES) + " s")
        rows.append(Row(f"launch over SSH, 16 hosts vs 2: `up` to {what}", Stat(ours), Stat(base), "s",
                        paired_ratio(ours, base), "ratio <= 1.5", note))
    return rows


# --------------------------------------------------------------------------- 5. status --json over 16 hosts

def fig_status(b: Bench) -> list[Row]:
    if b.quick:
        raise SkipFigure("quick mode")
    th = b.hosts(16)
    d = b.fresh("status")
    work = d / "work"  # run_dir in state.json may be relative to it
    work.mkdir()
    spec = write_spec(d / "cluster.toml", [{"address": a, "port": 20000} for a in th.addresses[:16]],
                      ["sleep", "600"], {"python": PY, "workdir": str(d / "work")})
    env = b.env(th.env())
    res = b.up(spec, env, timeout=300, args=("--detach",))
    b.need_ok(res, "status: up --detach on 16 hosts")
    run_id = sorted(b.runs())[-1]
    run = b.run_state(run_id)
    ours, base, cpu = [], [], []
    try:
        reps = max(5, b.reps)
        for i in range(reps):
            for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                if which == 0:
                    t0, m0, c0 = time.time(), machine_cpu(), children_cpu()
                    r = subprocess.run([*mgpu_argv(), "status", "--json", run_id], capture_output=True, text=True,
                                       env=env, timeout=120)
                    ours.append(time.time() - t0)
                    cpu.append((children_cpu() - c0, machine_cpu() - m0))
                    snap = json.loads(r.stdout)
                    states = {t["state"] for t in snap["tasks"]}
                    if r.returncode != 0 or states != {"running"}:
                        raise RuntimeError(f"status --json: exit {r.returncode}, task states {states}: {r.stderr[-500:]}")
                else:
                    # Baseline: ask every host at once with OpenSSH, as a shell loop with `&` would.
                    t0 = time.time()
                    procs = [subprocess.Popen(th.ssh_argv(i_, "cat", f"{work / t['run_dir']}/pid"),
                                              stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL, env=env)
                             for i_, t in enumerate(run["tasks"])]
                    codes = [p.wait(120) for p in procs]
                    base.append(time.time() - t0)
                    if any(codes):
                        raise RuntimeError(f"ssh baseline failed: exit codes {codes}")
    finally:
        subprocess.run([*mgpu_argv(), "down", run_id], capture_output=True, env=env, timeout=120)
    b.raw["status"] = {"ours": ours, "baseline": base, "cpu_status_process_and_machine": cpu}
    return [Row("`status --json` over 16 SSH hosts (baseline: 16 parallel `ssh host cat pid`)", Stat(ours),
                Stat(base), "s", paired_ratio(ours, base), "ours <= 1",
                "a fresh `mgpu-cluster status --json` process each time: start, read the live launcher's record (the supervisors relay progress, CPU, RSS), print; `--probe` goes to every host; "
                f"CPU of the status process {Stat([c[0] for c in cpu]).fmt('s')}, of all processes on the machine "
                f"{Stat([c[1] for c in cpu]).fmt('s')} on {os.cpu_count()} cores")]


# --------------------------------------------------------------------------- 6. the peer: Ray Train

def ray_python() -> Path:
    """bench/.venv-ray's python with ray[train] (created on first use; it sees TensorFlow via system site)."""
    py = RAY_VENV / "bin" / "python"
    ok = py.exists() and subprocess.run([str(py), "-c", "import ray.train.tensorflow"], capture_output=True,
                                        timeout=120).returncode == 0
    if not ok:
        subprocess.run([PY, "-m", "venv", "--system-site-packages", str(RAY_VENV)], check=True, capture_output=True)
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", "ray[train]", "tf-keras"], capture_output=True,
                           text=True, timeout=1200)
        if r.returncode != 0:
            raise SkipFigure("ray could not be installed: " + (r.stderr.strip().splitlines() or ["?"])[-1][:300])
    return py


def fig_ray(b: Bench) -> list[Row]:
    if b.quick:
        raise SkipFigure("quick mode")
    py = ray_python()
    command = overhead_job(b)
    ours, peer, ray_lines, ray_times = [], [], [], []
    for i in range(b.reps):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            if which == 0:
                res = run_ours_local(b, "ray-ours", command)
                b.need_ok(res, "ray figure, ours")
                ours.append(res.wall)
            else:
                d = b.fresh("ray-peer")
                t0 = time.time()
                r = subprocess.run([str(py), str(RAY_PEER), "--storage", str(d), "--", *command[2:]],
                                   capture_output=True, text=True, env=b.env(), cwd=d, timeout=600)
                wall = time.time() - t0
                (d / "ray.out").write_text(r.stdout + r.stderr)
                if r.returncode != 0:
                    raise RuntimeError(f"Ray peer failed (exit {r.returncode}); see {d / 'ray.out'}:\n"
                                       + "\n".join((r.stdout + r.stderr).splitlines()[-15:]))
                peer.append(wall)
                ray_lines.append(bench_line(r.stdout + r.stderr))
                ray_times.append(next((ln[len("RAY-TIMES "):] for ln in r.stdout.splitlines()
                                       if ln.startswith("RAY-TIMES ")), None))
    b.raw["ray"] = {"ours": ours, "ray": peer, "ray_bench": ray_lines, "ray_times": ray_times}
    import importlib.metadata as md

    version = subprocess.run([str(py), "-c", "import ray; print(ray.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    times = [ln for ln in ray_times if ln]
    return [Row(f"peer: same job via Ray Train TensorflowTrainer {version} (2 CPU workers), wall", Stat(ours),
                Stat(peer), "s", paired_ratio(ours, peer), "ratio <= 0.5",
                f"baseline column = Ray; the job of the overhead row; Ray - ours "
                f"{Stat([p - o for p, o in zip(peer, ours)]).fmt('s')}; Ray's driver: {times[-1] if times else '?'}; "
                f"tensorflow {md.version('tensorflow')}")]


# --------------------------------------------------------------------------- report

RUNNERS: dict[str, Callable[[Bench], list[Row]]] = {
    "help": fig_help, "overhead": fig_overhead, "scaling": fig_scaling, "failure": fig_failure,
    "ssh-launch": fig_ssh_launch, "status": fig_status, "ray": fig_ray,
}
TITLES = {"help": "`mgpu-cluster --help`", "overhead": "launcher overhead", "scaling": "data-parallel scaling",
          "failure": "failure detection", "ssh-launch": "launch scaling over SSH", "status": "`status --json`, 16 SSH hosts",
          "ray": "peer: Ray Train"}


TARGETS = {"help": "ours <= 0.3", "overhead": "ratio <= 1.05", "scaling": "ratio >= 1.8", "failure": "ours <= 2",
           "ssh-launch": "ratio <= 1.5", "status": "ours <= 1", "ray": "ratio <= 0.5"}


def machine() -> str:
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import importlib.metadata as md

    versions = []
    for dist in ("tensorflow", "tf-keras", "fabric"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions.append(f"{dist} {md.version(dist)}")
    return (f"{os.cpu_count()} x {cpu}, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, {', '.join(versions)}")


def write_table(b: Bench, args, started: float, load: tuple) -> Path:
    def cell(s: Stat | None, unit: str) -> str:
        return s.fmt(unit) if s else "-"

    lines = [
        "# mgpu-cluster benchmarks",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M', time.localtime(started))} with "
        f"`python bench/run.py{' --quick' if b.quick else ''}{' --only ' + args.only if args.only else ''}` "
        f"in {time.time() - started:.0f} s; {b.reps} repetition(s) (more for `--help` and `status`), "
        "each figure against its baseline in the same run, interleaved.",
        f"Machine: {machine()}; load average at start {load[0]:.1f}, at end {os.getloadavg()[0]:.1f} "
        "(shared with other jobs: figures are median [min-max]).",
        "",
        "| figure | ours | baseline | ratio | target | met? |",
        "|---|---|---|---|---|---|",
    ]
    for r in b.rows:
        met = {True: "yes", False: "**no**", None: "-"}[r.met]
        if r.note.startswith("skipped") or r.note.startswith("failed"):
            met = "not run"
        lines.append(f"| {r.figure} | {cell(r.ours, r.unit)} | {cell(r.baseline, r.unit)} | "
                     f"{cell(r.ratio, '')} | {r.target.replace('<=', '≤').replace('>=', '≥') or 'reported'} | {met} |")
    lines += ["", "Notes:", ""]
    for r in b.rows:
        if r.note:
            lines.append(f"- {r.figure}: {r.note}")
    lines += ["", "Ratios are ours / baseline per repetition (paired), then median [min-max]. Raw data: "
              "`out/results.json` beside this file. Plot: `results.png`.", ""]
    path = b.out_dir / "results.md"
    path.write_text("\n".join(lines))
    return path


def write_plot(b: Bench) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    launch = b.plot.get("ssh_launch")
    if launch:
        ns = sorted(launch)
        ax1.plot(ns, [launch[n]["running_s"] for n in ns], "o-", label="`up` to every task running")
        ax1.plot(ns, [launch[n]["finished_s"] for n in ns], "s-", label="`up` to every task finished")
        if 2 in launch:
            ax1.axhline(1.5 * launch[2]["running_s"], ls=":", c="grey", label="target: 1.5 x 2 hosts (running)")
        ax1.set_xscale("log", base=2)
        ax1.set_xticks(ns, [str(n) for n in ns])
        ax1.legend()
    else:
        ax1.text(0.5, 0.5, "launch over SSH not measured\n(" + b.raw.get("ssh_launch_skipped", "quick mode") + ")",
                 ha="center", va="center", transform=ax1.transAxes, wrap=True)
    ax1.set_xlabel("hosts (network namespaces with sshd)")
    ax1.set_ylabel("seconds (median)")
    ax1.set_title("launch time against number of hosts, trivial command")
    scaling = b.plot.get("scaling") or []
    if scaling:
        xs = range(len(scaling))
        w = 0.38
        ax2.bar([x - w / 2 for x in xs], [s["one"] for s in scaling], w, label="1 worker, 1 core")
        ax2.bar([x + w / 2 for x in xs], [s["two"] for s in scaling], w, label="2 workers, 1 core each")
        for x, s in zip(xs, scaling):
            ax2.text(x + w / 2, s["two"], f"x{s.get('ratio', s['two'] / s['one']):.2f}", ha="center", va="bottom",
                     fontsize=7)
        ax2.set_xticks(list(xs), [s["label"] for s in scaling], fontsize=6)
        ax2.set_yscale("log")
        ax2.legend()
    else:
        ax2.text(0.5, 0.5, "scaling not measured", ha="center", va="center", transform=ax2.transAxes)
    ax2.set_ylabel("samples/s (median, log scale)")
    ax2.set_title("data-parallel scaling: samples/s for 1 and 2 workers")
    fig.tight_layout()
    path = b.out_dir / "results.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 repetition, smallest sizes, no SSH, no Ray (< 2 min)")
    p.add_argument("--only", default="", help=f"comma-separated figures: {','.join(FIGURES)}")
    p.add_argument("--reps", type=int, default=0, help="repetitions (default 3; 1 with --quick)")
    p.add_argument("--out", type=Path, default=BENCH, help="folder for results.md, results.png and out/ (default bench/)")
    args = p.parse_args(argv)
    chosen = [f.strip() for f in args.only.split(",") if f.strip()] or list(FIGURES)
    unknown = [f for f in chosen if f not in FIGURES]
    if unknown:
        p.error(f"unknown figure(s) {unknown}; choose from {', '.join(FIGURES)}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        p.error("the plot needs matplotlib: pip install matplotlib (or pip install -e '.[test]')")
    b = Bench(args)
    shutil.rmtree(b.scratch, ignore_errors=True)
    b.scratch.mkdir(parents=True)
    started, load = time.time(), os.getloadavg()
    try:
        for name in chosen:
            t0 = time.time()
            b.log(f"[bench] {TITLES[name]} ...")
            try:
                rows = RUNNERS[name](b)
            except SkipFigure as exc:
                rows = [Row(TITLES[name], note=f"skipped: {exc}", target=TARGETS.get(name, ""))]
                if name == "ssh-launch":
                    b.raw["ssh_launch_skipped"] = str(exc)
            except Exception as exc:  # noqa: BLE001 - one broken figure must not hide the others
                (b.scratch / f"{name}.error.txt").write_text(traceback.format_exc())
                msg = str(exc).strip().splitlines()
                rows = [Row(TITLES[name], note=f"failed: {type(exc).__name__}: {msg[0] if msg else ''} "
                                                f"(details: out/{name}.error.txt)", target=TARGETS.get(name, ""))]
            b.rows += rows
            for r in rows:
                b.log(f"  {r.figure}: ours {r.ours.fmt(r.unit) if r.ours else '-'}, "
                      f"baseline {r.baseline.fmt(r.unit) if r.baseline else '-'}, "
                      f"ratio {r.ratio.fmt() if r.ratio else '-'}, target {r.target or '-'}: "
                      f"{ {True: 'met', False: 'NOT met', None: '-'}[r.met]} {r.note[:160]}")
            b.log(f"  ({time.time() - t0:.0f} s)")
    finally:
        b.close()
    (b.scratch / "results.json").write_text(json.dumps(
        {"machine": machine(), "quick": b.quick, "reps": b.reps, "rows": [r.as_dict() for r in b.rows],
         "raw": b.raw}, indent=1, default=str))
    table = write_table(b, args, started, load)
    plot = write_plot(b)
    b.log(f"[bench] wrote {table} and {plot} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
