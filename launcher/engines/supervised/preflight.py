"""Preflight: every host and port checked before anything starts. Per host: connect, sync, then ONE
worker.preflight.doctor command for all its tasks (with the cluster check folded in); local tasks on this
interpreter are checked in this process. Then Python and the backend's packages (TensorFlow and tf-keras,
or jax and keras) must match everywhere."""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import re
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, TypeVar

from launcher.preflight import devices, links
from launcher.plan import TaskPlan
from launcher.spec.cluster import HostsSpec
from launcher.engines.base import TaskCheck, parallel
from launcher.engines.supervised.sync import run_sync
from launcher.engines.supervised.transport import LocalTransport, Transport, env_line
from worker.host.env import Backend
from worker.host.spawn import module_argv
from worker.preflight.packages import PACKAGES
from worker.host.startpoint import Found, options
from worker.task.lines import printable

if TYPE_CHECKING:
    from worker.preflight.doctor import Report, TaskDoc, TaskReport
    from worker.preflight.ports import MeshTask

DOCTOR_TIMEOUT_S = 60.0
MESH_MAX_S = 10.0
HOSTS_AT_ONCE = 16
HOLD_S = 120.0  # how long a held doctor waits for the start
PROBLEM_MAX = 2000  # characters of one problem a host reports
T = TypeVar("T")
V = TypeVar("V")


def each(fn: Callable[[T], V], items: list[T], width: int) -> list[tuple[V | None, str | None]]:
    """fn over items, `width` at a time: (value, None) or (None, error message) per item, in order."""
    # an error with no message still fails its item, named by its kind
    return [(r.value, None) if r.ok else (None, str(r.error) or type(r.error).__name__)
            for r in parallel(fn, items, width)]


# --------------------------------------------------------------------------- what runs where

def same_interpreter(plan: TaskPlan) -> bool:
    """Whether a local task's python is this process's interpreter (same file and same venv)."""
    def identity(path: str | None) -> tuple[str, list[str]] | None:
        if not path:
            return None
        path = os.path.abspath(path)
        venv = [d for d in (os.path.dirname(path), os.path.dirname(os.path.dirname(path)))
                if os.path.isfile(os.path.join(d, "pyvenv.cfg"))]
        return os.path.realpath(path), venv[:1]

    python = plan.python
    if python == sys.executable:
        return True
    found = os.path.join(plan.cwd or "", python) if "/" in python else shutil.which(python)
    return bool(found and sys.executable) and identity(found) == identity(sys.executable)


def task_doc(spec: HostsSpec, plan: TaskPlan, cwd: bool) -> TaskDoc:
    """A task as worker.preflight.doctor reads it; `cwd`: the doctor runs elsewhere than the task's folder."""
    t = spec.training
    doc: TaskDoc = {"index": plan.index, "port": plan.host.port, "python": plan.python,
                    "writable": [posixpath.dirname(plan.run_dir)] + ([t.checkpoint_dir] if t.checkpoint_dir else [])}
    if t.entrypoint and options(plan.argv).folders:  # what the run would start from (launcher.commands.resume decides)
        doc["checkpoint"] = options(plan.argv).folders
    if cwd and plan.cwd:
        doc["cwd"] = plan.cwd
    if plan.host.gpus is not None:
        doc["gpus"] = plan.host.gpus
    if t.local_replicas:
        doc["local_replicas"] = t.local_replicas
    doc["address"] = plan.host.address  # the doctor names the interface that carries it
    return doc


def groups(plans: list[TaskPlan], transports: Mapping[int, Transport]) -> list[list[TaskPlan]]:
    """The tasks that one doctor checks together: one group per host and interpreter; local tasks on
    this interpreter form one group (checked in this process)."""
    found: dict[tuple[object, ...], list[TaskPlan]] = {}
    for p in plans:
        t = transports[p.index]
        if isinstance(t, LocalTransport) and same_interpreter(p):
            key: tuple[object, ...] = ("here",)
        else:  # a relative interpreter path is relative to the task's folder
            relative = "/" in p.python and not posixpath.isabs(p.python)
            key = (id(t), p.python, p.cwd if relative else None)
        found.setdefault(key, []).append(p)
    return list(found.values())


def doctor_argv(spec: HostsSpec, group: list[TaskPlan], shared_cwd: bool) -> list[str]:
    t = spec.training
    argv = module_argv(group[0].python, "worker.preflight.doctor")
    if t.entrypoint:
        argv += ["--entrypoint", t.entrypoint]
    else:
        assert t.command is not None  # the spec sets one of the two
        argv += ["--program", t.command[0]]
    argv += ["--backend", t.backend.value] if t.backend is not Backend.TENSORFLOW else []
    for p in group:
        argv += ["--task", json.dumps(task_doc(spec, p, cwd=not shared_cwd), separators=(",", ":"))]
    return argv


def report_problem(plan: TaskPlan, shared_cwd: bool, code: int, out: str, err: str) -> str | None:
    """What went wrong when a doctor gave no report (for every task of its group), else None."""
    if shared_cwd and plan.cwd and code != 0 and "cd:" in err:
        return workdir_missing(plan)
    if code in (126, 127):
        return (f"interpreter {plan.python!r} cannot be run there: "
                f"{printable(err.strip() or 'not found')}; set 'python' for this host in the spec")
    if code != 0 or not out.strip():
        last = printable((err.strip().splitlines() or ["no output"])[-1])
        if re.search(r"No module named '?worker\b", err):
            last = (f"the 'worker' package is not importable by {plan.python}; install mgpu-cluster "
                    "there (pip install mgpu-cluster), or set 'python' to an interpreter that has it")
        return f"host check failed: {last}"
    return None


def told(problem: object) -> str:
    """A problem a host reported (untrusted): one line, bounded."""
    return printable(str(problem), PROBLEM_MAX)


def workdir_missing(plan: TaskPlan) -> str:
    return (f"workdir {plan.cwd!r} does not exist there; create it "
            "(or list files under 'sync', which creates it)")


def check_group(spec: HostsSpec, group: list[TaskPlan], transport: Transport,
                mesh: list[str] | None, hold: bool = False) -> Report | str:
    """One doctor for the group: its report, or the problem of all of the group's tasks.

    hold (`up`, a remote host with one task): the doctor stays, to become the task's supervisor. Without it
    (`check`), the doctor also imports the entrypoint, with the environment of the group's first task."""
    imports = not hold and spec.training.entrypoint is not None
    if isinstance(transport, LocalTransport) and same_interpreter(group[0]):
        from worker.preflight import doctor

        docs = [task_doc(spec, p, cwd=True) for p in group]
        return doctor.check_host(docs, spec.training.entrypoint, spec.training.command[0] if spec.training.command
                                 else None, env=group[0].env if imports else None,
                                 backend=spec.training.backend)
    shared_cwd = len({p.cwd for p in group}) == 1
    argv = doctor_argv(spec, group, shared_cwd) + (mesh or []) + (["--group", str(group[0].index)] if mesh else [])
    timeout = DOCTOR_TIMEOUT_S + (4 * mesh_seconds(spec) if mesh else 0)
    lead = group[0] if shared_cwd else dataclasses.replace(group[0], cwd=None)
    if hold and len(group) == 1 and transport.can_hold:
        argv += ["--hold", f"{HOLD_S:g}", "--", *lead.supervisor_args(0, lifeline=spec.launch.lifeline)]
        code, out, err = transport.call_and_hold(lead, argv, timeout)
    elif imports:  # the task's environment travels on stdin, never on a command line
        code, out, err = transport.call(lead, argv + ["--import"], timeout, stdin=env_line(group[0]))
    else:
        code, out, err = transport.call(lead, argv, timeout)
    problem = report_problem(group[0], shared_cwd, code, out, err)
    if problem:
        return problem
    report: Report = json.loads(out.strip().splitlines()[-1])  # Any: the host's JSON line, read by key below
    return report


def version_problems(checks: list[TaskCheck], backend: Backend = Backend.TENSORFLOW) -> None:
    """Python and the backend's packages (TensorFlow and tf-keras, or jax, jaxlib and keras) must match on every
    host: add a problem where they don't."""
    for key in ("python", *PACKAGES[backend]):
        seen: dict[str | None, list[str]] = {}
        for c in checks:
            if c.versions:
                seen.setdefault(c.versions.get(key), []).append(c.plan.host.label)
        if len(seen) > 1:
            listing = "; ".join(f"{v or 'missing'} on {', '.join(dict.fromkeys(hosts))}" for v, hosts in seen.items())
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


# --------------------------------------------------------------------------- cluster check

def mesh_seconds(spec: HostsSpec) -> float:
    return max(3.0, min(spec.launch.connect_timeout, MESH_MAX_S))


def mesh_args(spec: HostsSpec, plans: list[TaskPlan], found_groups: list[list[TaskPlan]]) -> list[str]:
    """The doctor's cluster-check options, the same for every host but --group (its lowest task index)."""
    group_of = {p.index: g[0].index for g in found_groups for p in g}
    peers = [[p.index, p.host.address, p.host.port, group_of[p.index]] for p in plans]
    return ["--mesh", json.dumps(peers, separators=(",", ":")), "--token", secrets.token_hex(8),
            "--seconds", f"{mesh_seconds(spec):g}"]


def mesh_problems(plan: TaskPlan, res: MeshTask | None) -> list[str]:
    problems: list[str] = []
    if res is None:  # its host said nothing of it
        return problems
    if res.get("listen_error"):
        problems.append(f"cannot listen on port {plan.host.port} for the cluster check: "
                        f"{printable(str(res['listen_error']))}")
    for j, miss in sorted(res.get("unreached", {}).items(), key=lambda kv: int(kv[0])):
        problems.append(  # said alike by every host that cannot reach it: told once, naming them
            f"cannot reach task {j} at {printable(str(miss['address']))}: {printable(str(miss['reason']))}. "
            "Workers must reach each other's ports (TensorFlow's gRPC): check firewalls and the addresses "
            "in the spec")
    return problems


# --------------------------------------------------------------------------- all of it

def preflight(spec: HostsSpec, plans: list[TaskPlan], transports: list[Transport], base: Path | None = None,
              say: Callable[[str], None] | None = None, hold: bool = False) -> list[TaskCheck]:
    """Every check, hosts in parallel; `base` (the spec's folder) enables `sync`."""
    say = say or (lambda _msg: None)
    checks = [TaskCheck(p) for p in plans]
    by_index = {c.plan.index: c for c in checks}  # an elastic run's tasks keep their indices: not 0..n-1
    at = {p.index: t for p, t in zip(plans, transports)}
    addressing = address_problems(plans)
    for index, problem in addressing.items():
        by_index[index].problems.append(problem)

    remote = [t for t in dict.fromkeys(transports) if not isinstance(t, LocalTransport)]
    t0 = time.monotonic()
    reached = dict(zip(remote, each(lambda t: t.connect(), remote, HOSTS_AT_ONCE)))
    if remote and all(error is None for _v, error in reached.values()):
        say(f"connected to {len(remote)} host(s) in {time.monotonic() - t0:.2f} s")
    for c, t in zip(checks, transports):
        unreached = reached[t][1] if t in reached else None
        if unreached is not None:
            c.problems.append(unreached)
    if any(error is not None for _v, error in reached.values()):
        return checks  # nothing more is done on any host when one cannot be reached

    if spec.sync and base is not None:
        for index, problem in run_sync(spec, plans, at, base, say, HOSTS_AT_ONCE).items():
            by_index[index].problems.append(problem)
        if not all(c.ok for c in checks):
            return checks

    found_groups = groups(plans, at)
    with_mesh = bool(remote) and len(plans) > 1 and not addressing
    mesh = mesh_args(spec, plans, found_groups) if with_mesh else None
    t0 = time.monotonic()
    results = each(lambda g: check_group(spec, g, at[g[0].index], mesh, hold), found_groups,
                   len(found_groups) if with_mesh else HOSTS_AT_ONCE)  # the mesh needs all at once
    meshes: dict[int, MeshTask] = {}
    entries: dict[int, TaskReport] = {}
    for group, (report, error) in zip(found_groups, results):
        failed = error or (report if isinstance(report, str) else None)
        if failed:
            for p in group:
                by_index[p.index].problems.append(failed)
            continue
        assert isinstance(report, dict)  # a doctor that did not fail reported
        tasks = {t["index"]: t for t in report["tasks"]}
        for p in group:
            c = by_index[p.index]
            entry = entries[p.index] = tasks[p.index]
            c.problems += [workdir_missing(p)] if entry["no_workdir"] else [told(e) for e in entry["problems"]]
            c.versions = dict(report["versions"])
            c.checkpoint = Found.from_json(entry.get("checkpoint"))
            if report.get("mesh") and str(p.index) in report["mesh"]:
                meshes[p.index] = report["mesh"][str(p.index)]
    version_problems(checks, spec.training.backend)
    devices.apply(checks, entries, say)  # equal device counts; loopback warnings; NCCL_SOCKET_IFNAME
    if with_mesh and all(c.ok for c in checks):  # else a peer's own failure would show here twice
        for c in checks:
            c.problems += mesh_problems(c.plan, meshes.get(c.plan.index))
        if all(c.ok for c in checks):
            say(f"every worker reaches every other worker's port ({len(plans) * (len(plans) - 1)} pairs; "
                f"all host checks {time.monotonic() - t0:.2f} s)")
            if hold:  # `up`: a slow link told before the first step (`check` lists every link)
                links.preflight_probe(plans, transports, say)
    return checks
