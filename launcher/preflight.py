"""Preflight: every host and port checked before anything starts (no task is started).

In order, all hosts in parallel at each step, every host's outcome kept:
  1. reach and authenticate every host (SSH; nothing to do for local ones);
  2. copy the spec's `sync` files to the remote hosts (only when every host was reached);
  3. worker.doctor on each task's host: interpreter, `worker` package, entrypoint or program,
     port free (with its holder), GPUs, writable folders, versions;
  4. Python, TensorFlow and tf-keras versions equal on every host;
  5. cluster check (when the cluster has remote hosts and all else passed): every task listens on
     its port for a moment and connects to every other task's address:port, as TensorFlow will.
     Each listener is gone when its command returns, before any worker starts.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from launcher.plan import TaskPlan
from launcher.spec import ClusterSpec
from launcher.transport import LocalTransport, Transport, parallel

DOCTOR_TIMEOUT_S = 60.0
MESH_MAX_S = 10.0
SKIP_DIRS = {"__pycache__"}


@dataclass
class TaskCheck:
    plan: TaskPlan
    problems: list[str] = field(default_factory=list)
    versions: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


def doctor_argv(spec: ClusterSpec, plan: TaskPlan) -> list[str]:
    t = spec.training
    argv = [plan.python, "-m", "worker.doctor", "--port", str(plan.host.port),
            "--writable", posixpath.dirname(plan.run_dir)]
    if t.entrypoint:
        argv += ["--entrypoint", t.entrypoint]
    else:
        argv += ["--program", t.command[0]]
    if isinstance(plan.host.gpus, list):
        argv += ["--gpus", ",".join(map(str, plan.host.gpus))]
    if t.checkpoint_dir:
        argv += ["--writable", t.checkpoint_dir]
    return argv


def check_task(spec: ClusterSpec, plan: TaskPlan, transport: Transport) -> TaskCheck:
    code, out, err = transport.call(plan, doctor_argv(spec, plan), DOCTOR_TIMEOUT_S)
    if plan.cwd and code != 0 and "cd:" in err:
        return TaskCheck(plan, [f"workdir {plan.cwd!r} does not exist on {plan.host.label}; create it there "
                                "(or list files under 'sync', which creates it)"])
    if code in (126, 127):
        return TaskCheck(plan, [f"interpreter {plan.python!r} cannot be run on {plan.host.label}: "
                                f"{err.strip() or 'not found'}; set 'python' for this host in the spec"])
    if code != 0 or not out.strip():
        last = (err.strip().splitlines() or ["no output"])[-1]
        if re.search(r"No module named '?worker\b", err):
            last = (f"the 'worker' package is not importable by {plan.python}; install mgpu-cluster "
                    "there (pip install mgpu-cluster), or set 'python' to an interpreter that has it")
        return TaskCheck(plan, [f"host check failed: {last}"])
    report = json.loads(out.strip().splitlines()[-1])
    return TaskCheck(plan, report["problems"], report["versions"])


def version_problems(checks: list[TaskCheck]) -> None:
    """Python, TensorFlow and tf-keras must match on every host: add a problem where they don't."""
    for key in ("python", "tensorflow", "tf-keras"):
        seen = {}
        for c in checks:
            if c.versions:
                seen.setdefault(c.versions.get(key), []).append(c.plan.host.label)
        if len(seen) > 1:
            listing = "; ".join(f"{v or 'missing'} on {', '.join(hosts)}" for v, hosts in seen.items())
            for c in checks:
                if c.versions:
                    c.problems.append(f"{key} versions differ across hosts ({listing}); install the same everywhere")


def address_problems(plans: list[TaskPlan]) -> dict[int, str]:
    """A cluster that mixes localhost with remote hosts: the remote workers cannot reach 'localhost'."""
    local = [p for p in plans if p.host.is_local]
    if not local or len(local) == len(plans):
        return {}
    return {p.index: f"address {p.host.address!r} means a different machine on every host, so the remote "
                     "workers cannot reach this task; use this machine's network address (its name or IP) instead"
            for p in local}


# --------------------------------------------------------------------------- sync

def sync_files(items: list[str], base: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """The spec's `sync` entries as (local file, path relative to the workdir), and problems.

    A relative entry keeps its path below the spec's folder (`data/x.csv` -> `<workdir>/data/x.csv`);
    an absolute one, or one outside that folder, lands under its own name. Folders are copied
    whole, without __pycache__."""
    files: list[tuple[str, str]] = []
    problems = []
    base = Path(os.path.abspath(base))
    for item in items:
        src = Path(os.path.normpath(base / os.path.expanduser(item)))  # an absolute item stays itself
        try:
            rel = src.relative_to(base)
        except ValueError:
            rel = Path(src.name)
        if not src.exists():
            problems.append(f"sync: {item!r} does not exist ({src})")
            continue
        if src.is_file():
            files.append((str(src), rel.as_posix()))
            continue
        for folder, dirs, names in os.walk(src):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
            for name in sorted(names):
                path = Path(folder) / name
                if path.is_file():
                    files.append((str(path), (rel / path.relative_to(src)).as_posix()))
    return files, problems


def run_sync(spec: ClusterSpec, plans: list[TaskPlan], transports: list[Transport], base: Path,
             say: Callable[[str], None]) -> dict[int, str]:
    """Copy the sync files to each remote (host, workdir) once; problems by task index."""
    files, problems = sync_files(spec.sync, base)
    if problems:
        return {p.index: "; ".join(problems) for p in plans}
    targets: dict[tuple, list[TaskPlan]] = {}
    for p in plans:
        targets.setdefault((id(transports[p.index]), p.cwd), []).append(p)
    groups = list(targets.values())

    def one(group: list[TaskPlan]):
        t0 = time.monotonic()
        result = transports[group[0].index].sync(files, group[0].cwd)
        return result, time.monotonic() - t0

    found = {}
    for group, res in zip(groups, parallel(one, groups)):
        if isinstance(res, Exception):
            for p in group:
                found[p.index] = str(res)
            continue
        result, took = res
        if result is not None:
            where = group[0].cwd or "the login folder"
            say(f"sync {group[0].host.label}:{where}: {result['copied']} file(s) copied "
                f"({result['bytes'] / 1e6:.1f} MB), {result['unchanged']} unchanged, in {took:.2f} s")
    return found


# --------------------------------------------------------------------------- cluster check

def mesh_seconds(spec: ClusterSpec) -> float:
    return max(3.0, min(spec.launch.connect_timeout, MESH_MAX_S))


def mesh_argv(spec: ClusterSpec, plans: list[TaskPlan], plan: TaskPlan, token: str) -> list[str]:
    argv = [plan.python, "-m", "worker.doctor", "--listen", str(plan.host.port), "--token", token,
            "--index", str(plan.index), "--seconds", f"{mesh_seconds(spec):g}"]
    for other in plans:
        if other.index != plan.index:
            argv += ["--peer", f"{other.index}={other.host.address}:{other.host.port}"]
    return argv


def mesh_check(spec: ClusterSpec, plans: list[TaskPlan], transports: list[Transport],
               checks: list[TaskCheck]) -> None:
    """Every task must reach every other task's port: add a problem per pair that does not."""
    token = secrets.token_hex(8)
    timeout = mesh_seconds(spec) + DOCTOR_TIMEOUT_S / 2

    def one(plan: TaskPlan) -> dict:
        code, out, err = transports[plan.index].call(plan, mesh_argv(spec, plans, plan, token), timeout)
        if code != 0 or not out.strip():
            raise RuntimeError((err.strip().splitlines() or [f"exit code {code}, no output"])[-1])
        return json.loads(out.strip().splitlines()[-1])

    for plan, res, check in zip(plans, parallel(one, plans), checks):
        if isinstance(res, Exception):
            check.problems.append(f"cluster check (port reachability) failed: {res}")
            continue
        if res.get("listen_error"):
            check.problems.append(f"cannot listen on port {plan.host.port} for the cluster check: "
                                  f"{res['listen_error']}")
        for j, miss in sorted(res.get("unreached", {}).items(), key=lambda kv: int(kv[0])):
            check.problems.append(
                f"cannot reach task {j} at {miss['address']} from {plan.host.label}: {miss['reason']}. "
                "Workers must reach each other's ports (TensorFlow's gRPC): check firewalls and the addresses "
                "in the spec")


# --------------------------------------------------------------------------- all of it

def preflight(spec: ClusterSpec, plans: list[TaskPlan], transports: list[Transport], base: Path | None = None,
              say: Callable[[str], None] | None = None) -> list[TaskCheck]:
    """Every check, on all hosts in parallel; `base` (the spec's folder) enables `sync`."""
    say = say or (lambda _msg: None)
    checks = [TaskCheck(p) for p in plans]
    for index, problem in address_problems(plans).items():
        checks[index].problems.append(problem)

    unique = list(dict.fromkeys(transports))
    t0 = time.monotonic()
    reached = dict(zip(unique, parallel(lambda t: t.connect(), unique)))
    remote = [t for t in unique if not isinstance(t, LocalTransport)]
    if remote and all(not isinstance(r, Exception) for r in reached.values()):
        say(f"connected to {len(remote)} host(s) in {time.monotonic() - t0:.2f} s")
    for c, t in zip(checks, transports):
        if isinstance(reached[t], Exception):
            c.problems.append(str(reached[t]))
    if any(isinstance(r, Exception) for r in reached.values()):
        return checks  # nothing more is done on any host when one cannot be reached

    if spec.sync and base is not None:
        for index, problem in run_sync(spec, plans, transports, base, say).items():
            checks[index].problems.append(problem)
        if not all(c.ok for c in checks):
            return checks

    results = parallel(lambda p: check_task(spec, p, transports[p.index]), plans)
    for c, r in zip(checks, results):
        if isinstance(r, TaskCheck):
            c.problems += r.problems
            c.versions = r.versions
        else:
            c.problems.append(str(r))
    version_problems(checks)
    if remote and len(plans) > 1 and all(c.ok for c in checks):
        t0 = time.monotonic()
        mesh_check(spec, plans, transports, checks)
        if all(c.ok for c in checks):
            say(f"every worker reaches every other worker's port ({len(plans) * (len(plans) - 1)} pairs, "
                f"{time.monotonic() - t0:.2f} s)")
    return checks
