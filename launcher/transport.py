"""How tasks are started, watched and stopped on a host: one interface, local and SSH behind it.

A started task reports through `events`, a queue of Event(index, kind, data):
  line      one line of the task's output (data: str)
  started   the supervisor runs the program (data: {"pid", "supervisor_pid"})
  progress  progress.json changed (data: the progress dict)
  stats     the task's CPU% and RSS, every few seconds (data: {"cpu_percent", "rss"})
  exit      the supervisor finished (data: {"code"}); a negative code is a signal
  lost      the connection to the task's supervisor ended with no exit report (data: reason)
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from launcher.plan import TaskPlan

MARK = "\x1emgpu "  # the supervisor's marker; kept equal to worker.supervisor.MARK


@dataclass
class Event:
    index: int
    kind: str
    data: Any = None


def read_events(index: int, lines: Iterable[str], events: queue.Queue) -> bool:
    """Turn a supervisor's output lines into events; True when its exit was reported."""
    exited = False
    for line in lines:
        line = line.rstrip("\r\n")
        if line.startswith(MARK):
            try:
                msg = json.loads(line[len(MARK):])
            except ValueError:
                continue
            kind = msg.pop("event", "")
            if kind == "progress":
                events.put(Event(index, "progress", msg["progress"]))
            elif kind in ("started", "exit", "stats"):
                exited |= kind == "exit"
                events.put(Event(index, kind, msg))
        else:
            events.put(Event(index, "line", line))
    return exited


class Handle:
    """A started task; `stop()` asks its supervisor to stop it (idempotent)."""

    def stop(self) -> None:
        raise NotImplementedError


class Transport:
    def start(self, plan: TaskPlan, attempt: int, events: queue.Queue) -> Handle:
        raise NotImplementedError

    def probe(self, plans: list[TaskPlan]) -> list[dict]:
        """Per task what its folder says (worker.probe.probe_many), in plan order."""
        raise NotImplementedError

    def stop_tasks(self, plans: list[TaskPlan]) -> list[dict]:
        """Stop tasks from their folders alone (no live handle needed)."""
        raise NotImplementedError

    def call(self, plan: TaskPlan, argv: list[str], timeout: float) -> tuple[int, str, str]:
        """Run a short command in the task's folder on its host: (exit code, stdout, stderr)."""
        raise NotImplementedError

    def connect(self) -> float:
        """Reach and authenticate with the host now (preflight); seconds it took."""
        return 0.0

    def sync(self, files: list[tuple[str, str]], workdir: str | None) -> dict | None:
        """Copy (local path, relative path) files below the host's workdir; None: same file system."""
        return None

    def close(self) -> None:
        pass


class LocalHandle(Handle):
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass


class LocalTransport(Transport):
    """Tasks on localhost: the supervisor is our child; its stdin pipe is its lifeline."""

    def call(self, plan: TaskPlan, argv: list[str], timeout: float) -> tuple[int, str, str]:
        try:
            done = subprocess.run(argv, cwd=plan.cwd, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError as exc:
            if plan.cwd and exc.filename == plan.cwd:
                return 1, "", f"cd: {plan.cwd}: No such file or directory"
            return 127, "", f"{argv[0]}: not found"
        except PermissionError:
            return 126, "", f"{argv[0]}: permission denied"
        return done.returncode, done.stdout, done.stderr

    def start(self, plan: TaskPlan, attempt: int, events: queue.Queue) -> Handle:
        proc = subprocess.Popen(
            plan.supervisor_argv(attempt), cwd=plan.cwd, env={**os.environ, **plan.env},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, text=True, errors="replace", bufsize=1,
        )

        def pump() -> None:
            exited = read_events(plan.index, proc.stdout, events)
            code = proc.wait()
            if not exited:
                events.put(Event(plan.index, "lost", f"its supervisor ended with code {code} and no report"))

        threading.Thread(target=pump, daemon=True).start()
        return LocalHandle(proc)

    def probe(self, plans: list[TaskPlan]) -> list[dict]:
        from worker.probe import probe_many

        return probe_many([_abs(p) for p in plans])

    def stop_tasks(self, plans: list[TaskPlan]) -> list[dict]:
        from worker.probe import stop

        return parallel(lambda p: stop(_abs(p)), plans)


def _abs(plan: TaskPlan) -> str:
    return os.path.join(plan.cwd or os.getcwd(), plan.run_dir)


def parallel(fn: Callable, items: list) -> list:
    """fn over items in threads; each item's result or exception, in order."""
    results: list = [None] * len(items)

    def one(i: int) -> None:
        try:
            results[i] = fn(items[i])
        except Exception as exc:  # kept per item: one host's failure never hides another's
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def transports_for(spec, plans: list[TaskPlan]) -> list[Transport]:
    """The transport of each task: one local transport, one SSH transport per remote host."""
    local = LocalTransport()
    remote: dict[tuple, Transport] = {}
    out = []
    for plan in plans:
        if plan.host.is_local:
            out.append(local)
            continue
        key = (plan.host.address, plan.host.user, plan.host.ssh_port)
        if key not in remote:
            from launcher.ssh import SSHTransport  # fabric is imported only when a host needs it

            remote[key] = SSHTransport(plan.host, spec.launch)
        out.append(remote[key])
    return out
