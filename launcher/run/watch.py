"""What the agent makes of each task's events: states, heartbeats, the hung task, failures as data."""

from __future__ import annotations

import collections
import json
import os
import time

from launcher.diagnose.stacks import at_hang
from launcher.run.failure import Failure, FailureKind, describe_exit, of_exit, of_task, signal_name, with_stacks
from launcher.run.progress import typed
from launcher.run.record import run_path
from worker import protocol
from worker.protocol import ProgressState, RunState, TaskState

TAIL_LINES = 15
STOPPED = ("stopped", "tracing-stop")  # psutil's status of a process stopped by SIGSTOP or a debugger
NOTICE_STATES = (ProgressState.PREEMPTING, ProgressState.PREEMPTED)


def step_of(progress, key: str = "global_step") -> int:
    """A (typed) progress record's global step; 0 when it gives none."""
    return (progress or {}).get(key) or 0


class Watch:
    """The agent's event side; the Agent (agent.py) adds the policy and the teardown."""

    def label(self, index: int) -> str:
        """'task 1 (node7:20000)': where the task runs, as the record knows it (a scheduler's node too)."""
        t = self.run.tasks[index]
        return f"task {index} ({t.host}:{t.port})" if t.port else f"task {index} ({t.host})"

    def task_failure(self, index: int, kind: FailureKind, what: str, code: int | None = None) -> Failure:
        t = self.run.tasks[index]
        log = f"{t.host}:{self.plan_of[index].run_dir}/worker.log"
        return of_task(kind, what, index, self.label(index), t.host, log, list(self.tails[index]), self.run.run_id,
                       code)

    def on_event(self, index: int, ev: protocol.Event) -> Failure | None:
        task = self.run.tasks[index]
        now = self.heard[index] = time.time()
        if isinstance(ev, protocol.Started):
            task.state, task.pid, task.create_time = TaskState.RUNNING, ev.pid, ev.create_time
            task.supervisor_pid, task.started_at = ev.supervisor_pid, now
            task.host, task.port = ev.host or task.host, ev.port or task.port  # where a scheduler put it
            if all(self.run.tasks[p.index].state == TaskState.RUNNING for p in self.plans):
                self.run.set_state(RunState.RUNNING)
                self.mark_phase("all_started")
                self.owner.save()
        elif isinstance(ev, protocol.Stats):
            if ev.status is not None:  # else a beat without figures
                task.cpu_percent, task.rss, task.proc_status = ev.cpu_percent, ev.rss, ev.status
        elif isinstance(ev, protocol.Progress):
            task.progress = p = typed(ev.progress)  # written by the training: untrusted
            # the heartbeat counts once the task has trained a step (imports, set-up, tracing are no hang)
            if task.heartbeat or step_of(p) > step_of(p, "first_global_step"):
                task.heartbeat = now
            if step_of(p) > 0:
                self.mark_phase("first_step")
            self.remember(index, p, now)
        elif isinstance(ev, protocol.Note):
            self.out.say(f"{self.label(index)}: {ev.text}")
        elif isinstance(ev, protocol.Exit):
            return self.on_exit(index, ev, now)
        elif isinstance(ev, protocol.Lost):
            self.live.discard(index)
            task.state, task.ended_at = TaskState.LOST, now
            return self.task_failure(index, FailureKind.LOST, f"was lost: {ev.reason}")
        return None

    def on_exit(self, index: int, ev: protocol.Exit, now: float) -> Failure | None:
        task = self.run.tasks[index]
        self.live.discard(index)
        task.exit_code, task.ended_at = ev.code, now
        if ev.tail:
            self.tails[index] = collections.deque(ev.tail[-TAIL_LINES:], maxlen=TAIL_LINES)
        # a notice is a preemption whether or not the task managed to save (killed at the end of its grace)
        notice = bool(ev.notice) or ProgressState.of(task.progress) in NOTICE_STATES
        if ev.code == protocol.EXIT_PREEMPTED or notice or self.preempted_at is not None:
            # not a failure: the peers are saving the same checkpoint; let them finish
            task.state = TaskState.PREEMPTED
            if self.preempted_at is None:
                self.preempted_at = now
                how = describe_exit(ev.code)
                if ev.notice:  # a kill at the end of its grace is no mystery (out of memory) to hint at
                    how = f"notice {ev.notice}, " + (f"stopped with {signal_name(ev.code)} at the end of preempt_grace"
                                                     if ev.code < 0 else how)
                self.out.say(f"{self.label(index)} was preempted ({how}); waiting up to "
                             f"preempt_grace = {self.spec.launch.preempt_grace:g} s for the others to save")
            self.owner.save()
            return None
        if ev.code == 0:
            task.state = TaskState.SUCCEEDED
            self.owner.save()
            return None
        task.state = TaskState.FAILED
        kind, what = of_exit(ev)
        return self.task_failure(index, kind, what, ev.code)

    def check_timeouts(self, spawn_at: float) -> Failure | None:
        now, launch = time.time(), self.spec.launch
        for plan in self.plans:
            task = self.run.tasks[plan.index]
            if task.state == TaskState.PENDING and task.index in self.live and now - spawn_at > launch.start_timeout:
                task.state = TaskState.FAILED
                return self.task_failure(plan.index, FailureKind.NOT_STARTED,
                                         f"did not start within start_timeout = {launch.start_timeout:g} s")
        # the heartbeat is armed by on_event once the task has trained a step
        running = [self.run.tasks[p.index] for p in self.plans]
        running = [t for t in running if t.state == TaskState.RUNNING and t.heartbeat]
        if not any(now - t.heartbeat > launch.heartbeat_timeout for t in running):
            return self.check_silence(now)
        # a hang stalls its peers too (they wait in the all-reduce): name the task that stopped, not
        # a waiting peer: a process that is stopped (SIGSTOP), else the one furthest behind, longest silent
        culprit = min(running, key=lambda t: (t.proc_status not in STOPPED, step_of(t.progress), t.heartbeat))
        culprit.state = TaskState.FAILED
        stopped = " (its process is stopped, e.g. by SIGSTOP or a debugger)" if culprit.proc_status in STOPPED else ""
        failure = self.task_failure(culprit.index, FailureKind.HUNG,
                                    f"sent no progress for {now - culprit.heartbeat:.0f} s{stopped} (heartbeat_timeout = "
                                    f"{launch.heartbeat_timeout:g} s): hung, or its host is cut off")
        return with_stacks(failure, at_hang(self.engine, [(t.index, t.host, t.pid) for t in running], culprit.index,
                                            self.out))

    def check_silence(self, now: float) -> Failure | None:
        """Before its first step a task has no heartbeat, but its core still sends a record every
        protocol.BEAT_S: one silent for the lifeline is lost (its host cut off while TensorFlow started)."""
        launch = self.spec.launch
        for plan in self.plans:
            task, heard = self.run.tasks[plan.index], self.heard.get(plan.index)
            if task.state == TaskState.RUNNING and heard and now - heard > launch.lifeline:
                task.state = TaskState.FAILED
                return self.task_failure(plan.index, FailureKind.LOST, (
                    f"sent no progress and no sign of life for {now - heard:.0f} s (its supervisor reports every "
                    f"{protocol.BEAT_S:g} s; the limit is {launch.lifeline:g} s, from heartbeat_timeout = "
                    f"{launch.heartbeat_timeout:g} s): its host is cut off or down, or its supervisor is stopped"))
        return None

    def remember(self, index: int, progress: dict, now: float) -> None:
        """Each progress record, appended to the run's progress.jsonl (for `report`); a full disk skips it."""
        line = json.dumps({"time": now, "task": index, "attempt": self.run.attempt, "progress": progress},
                          default=str)
        try:
            fd = os.open(run_path(self.run.run_id) / "progress.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)
        except OSError:
            pass  # the record's own save reports a full MGPU_HOME

    def mark_phase(self, name: str) -> None:
        self.run.phases.setdefault(name, time.time())
