"""Preflight: every host and port checked before anything starts (reads only, starts nothing)."""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field

from launcher.plan import TaskPlan
from launcher.spec import ClusterSpec
from launcher.transport import Transport, parallel

DOCTOR_TIMEOUT_S = 60.0


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
    if code in (126, 127):
        return TaskCheck(plan, [f"interpreter {plan.python!r} cannot be run: {err.strip() or 'not found'}; "
                                "set 'python' for this host in the spec"])
    if code != 0 or not out.strip():
        last = (err.strip().splitlines() or ["no output"])[-1]
        if "No module named worker" in err:
            last = f"the 'worker' package is not importable by {plan.python}; install mgpu-cluster there"
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


def preflight(spec: ClusterSpec, plans: list[TaskPlan], transports: list[Transport]) -> list[TaskCheck]:
    results = parallel(lambda p: check_task(spec, p, transports[p.index]), plans)
    checks = [r if isinstance(r, TaskCheck) else TaskCheck(p, [str(r)]) for p, r in zip(plans, results)]
    version_problems(checks)
    return checks
