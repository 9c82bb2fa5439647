"""The supervised engine: our supervisor runs each task on its host (a local process, or over SSH)."""

from __future__ import annotations

import dataclasses
import os
import shlex
from pathlib import Path
from typing import BinaryIO, Callable, Sequence

from launcher.engines.base import (BackupCopy, Claim, EngineKind, Inspecting, Landed, Launching, ProbeRow, Result,
                                   Sink, TaskCheck, parallel)
from launcher.engines.supervised.standbys import Standbys, Started
from launcher.engines.supervised.transport import Handle, LocalTransport, LogUnreadable, Transport
from launcher.plan import TaskPlan, mask_env, plan_tasks
from launcher.spec.cluster import HostsSpec
from worker.host import layout
from worker.host.env import with_findings


def transports_for(spec: HostsSpec, plans: list[TaskPlan]) -> list[Transport]:
    """The transport of each task: one local transport, one SSH transport per remote host."""
    local = LocalTransport()
    remote: dict[tuple[str, str | None, int | None], Transport] = {}
    out: list[Transport] = []
    for plan in plans:
        if plan.host.is_local:
            out.append(local)
            continue
        key = (plan.host.address, plan.host.user, plan.host.ssh_port)
        if key not in remote:
            from launcher.engines.supervised.ssh import SSHTransport  # fabric is imported only when a host needs it

            remote[key] = SSHTransport(plan.host, spec.launch)
        out.append(remote[key])
    return out


class SupervisedEngine(Launching, Inspecting):
    """Launches (our supervisor per task) and inspects (each task's folder on its host)."""

    kind = EngineKind.SUPERVISED
    spec: HostsSpec

    def __init__(self, spec: HostsSpec, run_id: str, only: list[int] | None = None, landed: Landed | None = None):
        super().__init__(spec, run_id, only, landed)
        self.transports = dict(zip((p.index for p in self.plans), transports_for(spec, self.plans)))
        self.handles: dict[int, Handle] = {}
        self.standbys = Standbys(self.transports, lambda i, state: self.on_standby(i, state),
                                 lambda i, text: self.on_note(i, text))

    def plan_tasks(self, only: list[int] | None) -> list[TaskPlan]:
        return plan_tasks(self.spec, self.run_id, only)

    def dry_run(self, say: Callable[[str], None]) -> None:
        for p in self.plans:
            host = p.host
            where = "local process" if host.is_local else f"ssh {host.user + '@' if host.user else ''}{host.address}"
            say(f"{p.label} via {where}")
            say(f"  folder:  {p.cwd or ('(login folder)' if not host.is_local else os.getcwd())}")
            say(f"  run dir: {p.run_dir}")
            say(f"  command: {shlex.join(p.supervisor_argv(0))}")
            for k, v in mask_env(p.env).items():
                say(f"  env {k}={v}")

    def preflight(self, base: Path | None, say: Callable[[str], None], for_start: bool = False) -> list[TaskCheck]:
        from launcher.engines.supervised.preflight import preflight

        return preflight(self.spec, self.plans, [self.transports[p.index] for p in self.plans], base=base, say=say,
                         hold=for_start)

    def claim_ports(self) -> Sequence[Claim]:
        from launcher.run.lock import claim_ports

        return claim_ports(self.run_id, self.plans)

    def start(self, attempt: int, sink: Sink) -> dict[int, str]:
        plans: dict[int, TaskPlan] = {}
        if any(p.warm for p in self.plans):
            sink = Started(sink, lambda i: self.standbys.want(plans[i], attempt + 1))

        def one(plan: TaskPlan) -> None:
            found = self.landed.found_env(plan.index) if self.landed is not None else {}
            plan = plans[plan.index] = dataclasses.replace(plan, env=with_findings(found, plan.env))
            # kept at once: a stop (Ctrl-C) that comes while other tasks still start must find it
            self.handles[plan.index] = self.standbys.take(plan, attempt, sink) or \
                self.transports[plan.index].start(plan, attempt, sink)

        results = parallel(one, self.plans)
        return {p.index: str(r.error) for p, r in zip(self.plans, results) if not r.ok}

    def regroup(self, indices: list[int]) -> list[int]:
        return [i for i in indices if i not in self.handles or not self.handles[i].regroup()]

    def stop(self, indices: list[int], broken: bool = False) -> None:
        for i in indices:
            handle = self.handles.pop(i, None)
            if handle is not None:
                handle.stop(broken)

    def _grouped(self, indices: list[int], fn: Callable[[Transport, list[TaskPlan]], list[ProbeRow]]
                 ) -> list[Result[ProbeRow]]:
        """fn(transport, plans) once per host, in parallel; per task, in the order of `indices`."""
        groups: dict[Transport, list[TaskPlan]] = {}
        for i in indices:
            groups.setdefault(self.transports[i], []).append(self.plan[i])
        items = list(groups.items())
        found: dict[int, Result[ProbeRow]] = {}
        for (transport, plans), res in zip(items, parallel(lambda g: fn(*g), items)):
            for n, plan in enumerate(plans):
                found[plan.index] = Result(value=res.value[n]) if res.value is not None else Result(error=res.error)
        return [found[i] for i in indices]

    def stop_from_folders(self, indices: list[int]) -> list[Result[ProbeRow]]:
        return self._grouped(indices, lambda t, plans: t.stop_tasks(plans))

    def probe(self, indices: list[int]) -> list[Result[ProbeRow]]:
        return self._grouped(indices, lambda t, plans: t.probe(plans))

    def call(self, index: int, argv: list[str], timeout: float) -> tuple[int, str, str]:
        return self.transports[index].call(self.plan[index], argv, timeout)

    def open_file(self, index: int, path: str) -> BinaryIO:
        return self.transports[index].open_file(path)

    def read_log(self, index: int, offset: int, tail: int | None = None) -> tuple[bytes, int]:
        plan = self.plan[index]
        try:
            return self.transports[index].read_log(plan, offset, tail)
        except LogUnreadable as exc:
            where = plan.cwd or (os.getcwd() if plan.host.is_local else "the login folder")
            raise LogUnreadable(f"{plan.label}: cannot read {layout.file(plan.run_dir, layout.WORKER_LOG)} (relative "
                                f"to {where}): {exc}; the task may not have started yet, or its folder was "
                                "removed") from None

    def reachable(self, indices: list[int]) -> list[Result[float]]:
        return parallel(lambda i: self.transports[i].connect(), indices)

    def share_backup(self, first: bool) -> BackupCopy | None:
        from launcher.engines.supervised.backups import share

        return share(self.spec, self.run_id, self.plans, self.transports, first)

    def close(self) -> None:
        self.standbys.close()
        for t in set(self.transports.values()):
            t.close()
