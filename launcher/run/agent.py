"""The agent loop: start every task, watch exits and heartbeats, fail fast, restart the group.

It reads only typed events (worker.protocol) from its engine; output lines go straight to the
display and never through this loop, so a flood or a stalled terminal cannot delay fail-fast.
"""

from __future__ import annotations

import collections
import queue
import signal
import time

from launcher.run import interrupts
from launcher.engines import Engine, engine_for
from launcher.errors import Interrupted, RunFailed
from launcher.run.output import Output
from launcher.plan import TaskPlan
from launcher.run.record import Attempt, Owner, run_path
from launcher.spec import ClusterSpec
from worker import protocol
from worker.protocol import RunState, TaskState

TEARDOWN_SLACK_S = 8.0  # beyond stop_grace, how long to wait for exit reports before acting alone
SAVE_EVERY_S = 1.0
TICK_S = 0.5  # the agent wakes for events at once; this only paces its own checks (timeouts, grace)
TAIL_LINES = 15


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = "; SIGKILL often means out of memory, or a kill -9" if name == "SIGKILL" else ""
        return f"was killed by {name} (exit code {code}{hint})"
    return f"exited with code {code}"


class _AttemptSink:
    """What one attempt's tasks report; late reports of an earlier attempt are told apart."""

    def __init__(self, agent: "Agent", attempt: int):
        self.agent, self.attempt = agent, attempt

    def event(self, index: int, event: protocol.Event) -> None:
        self.agent.events.put((self.attempt, index, event))

    def output(self, index: int, lines: list[str], dropped: int) -> None:
        self.agent.tails[index].extend(lines)
        self.agent.out.task_lines(self.agent.plan_of[index], lines, dropped)

    def garbage(self, index: int, text: str) -> None:
        self.agent.out.logline(f"task {index}: a line from its supervisor that is not a record (ignored): {text}")
        self.output(index, [text], 0)


class Agent:
    def __init__(self, spec: ClusterSpec, engine: Engine, owner: Owner, out: Output):
        self.spec, self.plans, self.engine, self.owner, self.out = spec, engine.plans, engine, owner, out
        self.run = owner.record
        self.plan_of = {p.index: p for p in self.plans}
        self.live: set[int] = set()  # tasks started in this attempt whose exit is not known yet
        self.preempted_at: float | None = None
        self.tails = {p.index: collections.deque(maxlen=TAIL_LINES) for p in self.plans}
        self.events: queue.Queue = queue.Queue()
        self.heard: dict[int, float] = {}  # when each task of this attempt last sent any record

    # -- the state machine: attempt -> (succeeded | preempted | restart | shrink | failed), teardown always
    def execute(self) -> None:
        run, launch = self.run, self.spec.launch
        try:
            while True:
                outcome, reason = self.attempt(run.attempt)
                if outcome == "succeeded":
                    run.state = RunState.SUCCEEDED
                    return
                if outcome == "preempted" and run.preemptions < launch.max_preemptions:
                    run.preemptions += 1
                    self.out.say(f"attempt {run.attempt} was preempted: {reason}")
                    self.out.say(f"restarting the whole group after preemption {run.preemptions} (not counted "
                                 "against max_restarts); it resumes from the checkpoint taken on notice")
                elif outcome == "failed" and self.shrink():
                    self.out.say(f"attempt {run.attempt} lost a host: {reason}")
                    self.out.say(f"going on with {len(self.plans)} task(s) ({', '.join(p.host.label for p in self.plans)}); "
                                 "they resume from the last checkpoint with a new TF_CONFIG")
                elif run.restarts < launch.max_restarts:
                    run.restarts += 1
                    self.out.say(f"attempt {run.attempt} failed: {reason}")
                    self.out.say(f"restarting the whole group (restart {run.restarts} of {launch.max_restarts}) "
                                 "after that failure; it resumes from its last checkpoint")
                else:
                    if outcome == "preempted":
                        reason = f"preempted more than max_preemptions = {launch.max_preemptions} times; last: {reason}"
                    run.state, run.failure = RunState.FAILED, reason
                    raise RunFailed(reason)
                run.attempt += 1
        except KeyboardInterrupt:
            why = interrupts.reason()
            if (run_path(run.run_id) / "down.request").exists():
                why = "stopped by 'mgpu-cluster down'"
            with interrupts.shield(self.out.say):
                self.teardown(why)
                run.state, run.failure = RunState.STOPPED, f"{why}; every task was stopped"
                self.end_attempt("stopped", why)
            raise Interrupted(run.failure) from None
        finally:
            with interrupts.shield(self.out.say):
                if self.live:
                    self.teardown("the launcher is exiting")
                run.ended_at = time.time()
                self.owner.save()

    def shrink(self) -> bool:
        """Elastic runs (min_hosts): leave out the hosts that no longer answer, if enough remain."""
        min_hosts = self.spec.launch.min_hosts
        if min_hosts is None:
            return False
        indices = [p.index for p in self.plans]
        answers = self.engine.reachable(indices)
        gone = [i for i, a in zip(indices, answers) if not a.ok]
        left = [i for i in indices if i not in gone]
        if not gone or len(left) < min_hosts:
            return False
        for i in gone:
            self.run.tasks[i].state = TaskState.LOST
            self.run.hosts_lost.append(i)
            self.out.say(f"{self.plan_of[i].label} is left out: {answers[indices.index(i)].error}")
        self.engine.close()
        self.engine = engine_for(self.spec, self.run.run_id, only=left)
        self.plans = self.engine.plans
        self.plan_of = {p.index: p for p in self.plans}
        return True

    def attempt(self, number: int) -> tuple[str, str | None]:
        """Run one attempt of the group: ("succeeded" | "failed" | "preempted", why)."""
        run = self.run
        run.state = RunState.STARTING
        active = [run.tasks[p.index] for p in self.plans]
        run.attempts.append(Attempt(number=number, started_at=time.time(), tasks=[p.index for p in self.plans]))
        for t in active:
            t.state, t.exit_code, t.pid, t.create_time, t.heartbeat, t.progress = TaskState.PENDING, None, None, None, None, None
            t.proc_status, t.restarts = None, number
        self.events, self.heard = queue.Queue(), {}
        self.preempted_at: float | None = None
        spawn_at = time.time()
        run.phases.setdefault("spawn_started", spawn_at)
        self.owner.save()
        self.live = {p.index for p in self.plans}
        failed = self.engine.start(number, _AttemptSink(self, number))
        if self.engine.restarts_itself:  # a scheduler's start() returns once its job left the queue:
            spawn_at = time.time()  # time in the queue is no start-up hang
        failure = "\n".join(f"{self.plan_of[i].label} could not be started: {why}" for i, why in sorted(failed.items()))
        for i in failed:  # every host's outcome: one that fails to start must not hide another
            self.live.discard(i)
            run.tasks[i].state = TaskState.FAILED
        failure = failure or None
        self.owner.save()
        while failure is None:
            try:
                got = self.events.get(timeout=TICK_S)
            except queue.Empty:
                got = None
            if got is not None and got[0] == number:
                failure = self.on_event(got[1], got[2])
            if self.preempted_at is not None:
                if not self.live or time.time() - self.preempted_at > self.spec.launch.preempt_grace:
                    return self.wind_down(number)
                continue
            failure = failure or self.check_timeouts(spawn_at)
            if failure is None and all(t.state == TaskState.SUCCEEDED for t in active):
                self.mark_phase("end")
                self.end_attempt("succeeded", None)
                return "succeeded", None
            self.owner.save(every=SAVE_EVERY_S)
        self.end_attempt("failed", failure)
        if not self.engine.restarts_itself:  # else the scheduler ends the attempt and starts the next itself;
            self.out.say(f"attempt {number} failed: stopping every task")  # execute() stops the rest if none follows
            with interrupts.shield(self.out.say):
                self.teardown("another task failed")
        return "failed", failure

    def wind_down(self, number: int) -> tuple[str, str]:
        """A preemption: the group saved (or had preempt_grace to); stop what is left."""
        names = [self.plan_of[t.index].label for t in self.run.tasks if t.state == TaskState.PREEMPTED]
        reason = (f"{', '.join(names) or 'a task'} got notice to stop (SIGTERM from its host or scheduler) and "
                  "the group saved a checkpoint")
        self.end_attempt("preempted", reason)
        if not self.engine.restarts_itself:
            with interrupts.shield(self.out.say):
                self.teardown("the group was preempted")
        return "preempted", reason

    def end_attempt(self, outcome: str, reason: str | None) -> None:
        current = self.run.attempts[-1] if self.run.attempts else None
        if current is not None and current.ended_at is None:
            current.ended_at, current.outcome, current.reason = time.time(), outcome, reason
            self.owner.save()

    def on_event(self, index: int, ev: protocol.Event) -> str | None:
        task, plan = self.run.tasks[index], self.plan_of[index]
        now = self.heard[index] = time.time()
        if isinstance(ev, protocol.Started):
            task.state, task.pid, task.create_time = TaskState.RUNNING, ev.pid, ev.create_time
            task.supervisor_pid, task.started_at = ev.supervisor_pid, now
            if ev.host:
                task.host = ev.host
            if ev.port:
                task.port = ev.port
            if all(self.run.tasks[p.index].state == TaskState.RUNNING for p in self.plans):
                self.run.state = RunState.RUNNING
                self.mark_phase("all_started")
                self.owner.save()
        elif isinstance(ev, protocol.Stats):
            if ev.status is not None:  # else a beat without figures
                task.cpu_percent, task.rss, task.proc_status = ev.cpu_percent, ev.rss, ev.status
        elif isinstance(ev, protocol.Progress):
            task.progress, p = ev.progress, ev.progress
            # the heartbeat counts once the task has trained a step (imports, set-up, tracing are no hang)
            if task.heartbeat or (p.get("global_step") or 0) > (p.get("first_global_step") or 0):
                task.heartbeat = now
            if (ev.progress.get("global_step") or 0) > 0:
                self.mark_phase("first_step")
        elif isinstance(ev, protocol.Exit):
            self.live.discard(index)
            task.exit_code, task.ended_at = ev.code, now
            if ev.tail:
                self.tails[index] = collections.deque(ev.tail[-TAIL_LINES:], maxlen=TAIL_LINES)
            notice = (task.progress or {}).get("state") in ("preempting", "preempted")
            if ev.code == protocol.EXIT_PREEMPTED or notice or self.preempted_at is not None:
                # not a failure: the peers are saving the same checkpoint; let them finish
                task.state = TaskState.PREEMPTED
                if self.preempted_at is None:
                    self.preempted_at = now
                    self.out.say(f"{plan.label} was preempted ({describe_exit(ev.code)}); waiting up to "
                                 f"preempt_grace = {self.spec.launch.preempt_grace:g} s for the others to save")
                self.owner.save()
                return None
            if ev.code == 0:
                task.state = TaskState.SUCCEEDED
                self.owner.save()
                return None
            task.state = TaskState.FAILED
            return self.report(plan, ev.reason or describe_exit(ev.code))
        elif isinstance(ev, protocol.Lost):
            self.live.discard(index)
            task.state, task.ended_at = TaskState.LOST, now
            return self.report(plan, f"was lost: {ev.reason}")
        return None

    def check_timeouts(self, spawn_at: float) -> str | None:
        now, launch = time.time(), self.spec.launch
        for plan in self.plans:
            task = self.run.tasks[plan.index]
            if task.state == TaskState.PENDING and task.index in self.live and now - spawn_at > launch.start_timeout:
                task.state = TaskState.FAILED
                return self.report(plan, f"did not start within start_timeout = {launch.start_timeout:g} s")
        # the heartbeat is armed by on_event once the task has trained a step
        running = [self.run.tasks[p.index] for p in self.plans]
        running = [t for t in running if t.state == TaskState.RUNNING and t.heartbeat]
        if not any(now - t.heartbeat > launch.heartbeat_timeout for t in running):
            return self.check_silence(now)
        # a hang stalls its peers too (they wait in the all-reduce): name the task that stopped, not
        # a waiting peer: a process that is stopped (SIGSTOP), else the one furthest behind, longest silent
        culprit = min(running, key=lambda t: (t.proc_status not in ("stopped", "tracing-stop"),
                                              (t.progress or {}).get("global_step") or 0, t.heartbeat))
        culprit.state = TaskState.FAILED
        stopped = " (its process is stopped, e.g. by SIGSTOP or a debugger)" if culprit.proc_status in (
            "stopped", "tracing-stop") else ""
        return self.report(self.plan_of[culprit.index],
                           f"sent no progress for {now - culprit.heartbeat:.0f} s{stopped} (heartbeat_timeout = "
                           f"{launch.heartbeat_timeout:g} s): hung, or its host is cut off")

    def check_silence(self, now: float) -> str | None:
        """Before its first step a task has no heartbeat, but its supervisor still sends a record every
        protocol.BEAT_S: one silent for the lifeline (the bound the supervisors keep towards us) is lost,
        e.g. its host was cut off while TensorFlow was starting."""
        if not self.engine.beats:
            return None
        launch = self.spec.launch
        for plan in self.plans:
            task, heard = self.run.tasks[plan.index], self.heard.get(plan.index)
            if task.state == TaskState.RUNNING and heard and now - heard > launch.lifeline:
                task.state = TaskState.FAILED
                return self.report(plan, f"sent no progress and no sign of life for {now - heard:.0f} s (its supervisor "
                                         f"reports every {protocol.BEAT_S:g} s; the limit is {launch.lifeline:g} s, from "
                                         f"heartbeat_timeout = {launch.heartbeat_timeout:g} s): its host is cut off or "
                                         "down, or its supervisor is stopped")
        return None

    def report(self, plan: TaskPlan, what: str) -> str:
        tail = "\n".join(f"    {line}" for line in self.tails[plan.index]) or "    (no output)"
        return (f"{plan.label} {what}. Every other task was stopped. Last lines of its log "
                f"({plan.host.label}:{plan.run_dir}/worker.log):\n{tail}\n"
                f"Read the whole log with 'mgpu-cluster logs {self.run.run_id} --task {plan.index}'.")

    def teardown(self, reason: str) -> None:
        """Stop every live task, then wait (bounded) for each one's exit report."""
        live, self.live = set(self.live), set()
        if not live:
            return
        self.out.say(f"stopping {len(live)} task(s): {reason}")
        self.engine.stop(sorted(live))
        number = self.run.attempt
        deadline = time.time() + self.spec.launch.stop_grace + TEARDOWN_SLACK_S
        while live and time.time() < deadline:
            try:
                attempt, index, ev = self.events.get(timeout=TICK_S)
            except queue.Empty:
                continue
            if attempt != number or index not in live:
                continue
            if isinstance(ev, (protocol.Exit, protocol.Lost)):
                live.discard(index)
                task = self.run.tasks[index]
                task.exit_code = getattr(ev, "code", None)
                if task.state != TaskState.PREEMPTED:
                    task.state = TaskState.STOPPED if isinstance(ev, protocol.Exit) else TaskState.LOST
                task.ended_at = time.time()
            elif isinstance(ev, protocol.Started):
                self.on_event(index, ev)
        if live:
            self.out.say(f"tasks {sorted(live)} did not confirm their stop; stopping them from their folders")
            stuck = sorted(live)
            for index, res in zip(stuck, self.engine.stop_from_folders(stuck)):
                task = self.run.tasks[index]
                task.state, task.ended_at = (TaskState.STOPPED if res.ok else TaskState.LOST), time.time()
                if not res.ok:  # an unreachable host must not end the teardown
                    self.out.say(f"{self.plan_of[index].label} could not be stopped: {res.error}")
        for p in self.plans:
            task = self.run.tasks[p.index]
            if task.state in (TaskState.PENDING, TaskState.RUNNING):
                task.state = TaskState.STOPPED
        self.owner.save()

    def mark_phase(self, name: str) -> None:
        self.run.phases.setdefault(name, time.time())
