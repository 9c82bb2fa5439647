"""The agent loop: start every task, watch exits and heartbeats, fail fast, restart the group."""

from __future__ import annotations

import collections
import queue
import signal
import time

from launcher import state as runstate
from launcher.errors import Interrupted, RunFailed
from launcher.output import Output
from launcher.plan import TaskPlan
from launcher.spec import ClusterSpec
from launcher.transport import Event, Handle, Transport, parallel

TEARDOWN_SLACK_S = 8.0  # beyond stop_grace, how long to wait for stop reports before acting alone
SAVE_EVERY_S = 1.0


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = "; SIGKILL often means out of memory, or a kill -9" if name == "SIGKILL" else ""
        return f"was killed by {name} (exit code {code}{hint})"
    return f"exited with code {code}"


class Agent:
    def __init__(self, spec: ClusterSpec, plans: list[TaskPlan], transports: list[Transport],
                 run: runstate.RunState, out: Output):
        self.spec, self.plans, self.transports, self.run, self.out = spec, plans, transports, run, out
        self.handles: dict[int, Handle] = {}
        self.tails = {p.index: collections.deque(maxlen=15) for p in plans}
        self.saved_at = 0.0
        self.events: queue.Queue = queue.Queue()

    # -- the state machine: attempt -> (succeeded | restart | failed), teardown always
    def execute(self) -> runstate.RunState:
        run = self.run
        run.state = "pending"
        try:
            while True:
                failure = self.attempt(run.attempt)
                if failure is None:
                    run.state = "succeeded"
                    return run
                if run.attempt < self.spec.launch.max_restarts:
                    run.attempt += 1
                    self.out.say(f"restarting the whole group (restart {run.attempt} of "
                                 f"{self.spec.launch.max_restarts}); it resumes from its last checkpoint")
                    continue
                run.state, run.failure = "failed", failure
                raise RunFailed(failure)
        except (KeyboardInterrupt, Interrupted):
            run.state, run.failure = "stopped", "interrupted (Ctrl-C or SIGTERM); every task was stopped"
            self.teardown("interrupted")
            raise Interrupted(run.failure) from None
        finally:
            if self.handles:
                self.teardown("launcher exiting")
            run.ended_at = time.time()
            runstate.save(run)

    def attempt(self, attempt: int) -> str | None:
        self.events = events = queue.Queue()
        for t in self.run.tasks:
            t.state, t.exit_code, t.pid, t.heartbeat, t.progress = "pending", None, None, None, None
            t.restarts = attempt
        spawn_at = time.time()
        self.run.phases.setdefault("spawn_started", spawn_at)
        results = parallel(lambda p: self.transports[p.index].start(p, attempt, events), self.plans)
        failed = []  # every host's outcome: one that fails to start must not hide another
        for plan, result in zip(self.plans, results):
            if isinstance(result, Exception):
                failed.append(f"{plan.label} could not be started: {result}")
            else:
                self.handles[plan.index] = result
        failure = "\n".join(failed) or None
        self.save(force=True)
        while failure is None:
            try:
                event = events.get(timeout=0.2)
            except queue.Empty:
                event = None
            if event is not None:
                failure = self.on_event(event)
            failure = failure or self.check_timeouts(spawn_at)
            if all(t.state == "succeeded" for t in self.run.tasks):
                self.handles.clear()
                self.mark_phase("end")
                return None
            self.save()
        self.out.say(f"attempt {attempt} failed: stopping every task")
        self.teardown("another task failed")
        return failure

    def on_event(self, ev: Event) -> str | None:
        task, plan = self.run.tasks[ev.index], self.plans[ev.index]
        now = time.time()
        if ev.kind == "line":
            self.tails[ev.index].append(ev.data)
            self.out.task_line(plan, ev.data)
        elif ev.kind == "started":
            task.state, task.pid, task.supervisor_pid, task.started_at = "running", ev.data["pid"], ev.data["supervisor_pid"], now
            if all(t.state == "running" for t in self.run.tasks):
                self.run.state = "running"
                self.mark_phase("all_started")
                self.save(force=True)
        elif ev.kind == "stats":
            task.cpu_percent, task.rss = ev.data.get("cpu_percent"), ev.data.get("rss")
        elif ev.kind == "progress":
            task.progress, task.heartbeat = ev.data, now
            if (ev.data.get("global_step") or 0) > 0:
                self.mark_phase("first_step")
        elif ev.kind == "exit":
            task.exit_code, task.ended_at = ev.data["code"], now
            if task.exit_code == 0:
                task.state = "succeeded"
                self.handles.pop(ev.index, None)
                self.save(force=True)
                return None
            task.state = "failed"
            self.handles.pop(ev.index, None)
            return self.report(plan, describe_exit(task.exit_code))
        elif ev.kind == "lost":
            task.state, task.ended_at = "lost", now
            self.handles.pop(ev.index, None)
            return self.report(plan, f"was lost: {ev.data}")
        return None

    def check_timeouts(self, spawn_at: float) -> str | None:
        now, launch = time.time(), self.spec.launch
        for task, plan in zip(self.run.tasks, self.plans):
            if task.state == "pending" and now - spawn_at > launch.start_timeout:
                task.state = "failed"
                return self.report(plan, f"did not start within start_timeout = {launch.start_timeout:g} s")
            if task.state == "running" and task.heartbeat and now - task.heartbeat > launch.heartbeat_timeout:
                task.state = "failed"
                return self.report(plan, f"sent no progress for {now - task.heartbeat:.0f} s "
                                         f"(heartbeat_timeout = {launch.heartbeat_timeout:g} s): hung, or its host is cut off")
        return None

    def report(self, plan: TaskPlan, what: str) -> str:
        tail = "\n".join(f"    {line}" for line in self.tails[plan.index]) or "    (no output)"
        return (f"{plan.label} {what}. Every other task was stopped. Last lines of its log "
                f"({plan.host.label}:{plan.run_dir}/worker.log):\n{tail}\n"
                f"Read the whole log with 'mgpu-cluster logs {self.run.run_id} --task {plan.index}'.")

    def teardown(self, reason: str) -> None:
        """Stop every live task, then wait (bounded) for each one's exit report."""
        live = dict(self.handles)
        self.handles.clear()
        for handle in live.values():
            handle.stop()
        if live:
            self.out.say(f"stopping {len(live)} task(s): {reason}")
        deadline = time.time() + self.spec.launch.stop_grace + TEARDOWN_SLACK_S
        while live and time.time() < deadline:
            try:
                ev = self.events.get(timeout=0.2)
            except queue.Empty:
                continue
            if ev.kind == "line":
                self.tails[ev.index].append(ev.data)
                self.out.task_line(self.plans[ev.index], ev.data)
            elif ev.kind in ("exit", "lost") and ev.index in live:
                del live[ev.index]
                task = self.run.tasks[ev.index]
                task.exit_code = ev.data.get("code") if isinstance(ev.data, dict) else None
                task.state, task.ended_at = "stopped", time.time()
        if live:
            self.out.say(f"tasks {sorted(live)} did not confirm their stop; stopping them from their folders")
            stuck = [self.plans[i] for i in live]
            results = parallel(lambda p: self.transports[p.index].stop_tasks([p]), stuck)
            for plan, result in zip(stuck, results):  # an unreachable host must not end the teardown
                self.run.tasks[plan.index].state = "lost" if isinstance(result, Exception) else "stopped"
                if isinstance(result, Exception):
                    self.out.say(f"{plan.label} could not be stopped: {result}")
        self.save(force=True)

    def mark_phase(self, name: str) -> None:
        self.run.phases.setdefault(name, time.time())

    def save(self, force: bool = False) -> None:
        if force or time.time() - self.saved_at >= SAVE_EVERY_S:
            runstate.save(self.run)
            self.saved_at = time.time()
