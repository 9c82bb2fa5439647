"""The agent: start every task, watch exits and heartbeats, fail fast, and decide restarts,
preemptions and shrinking, for every engine (the one restart policy).

It reads only typed events (worker.protocol) from its engine; output lines go straight to the
display and never through this loop, so a flood or a stalled terminal cannot delay fail-fast.
"""

from __future__ import annotations

import collections
import queue
import time

from launcher.engines import Engine, engine_for
from launcher.engines.base import SchedulerCause
from launcher.errors import Interrupted, RunFailed
from launcher.run import interrupts
from launcher.run.failure import Failure, FailureKind, stop_words
from launcher.run.output import Output
from launcher.run.record import Attempt, Owner, run_path
from launcher.run.watch import TAIL_LINES, Watch
from launcher.spec import ClusterSpec
from worker import protocol
from worker.protocol import AttemptOutcome as Outcome
from worker.protocol import RunState, TaskState

TEARDOWN_SLACK_S = 8.0  # beyond stop_grace, how long to wait for exit reports before acting alone
SAVE_EVERY_S = 1.0
TICK_S = 0.5  # the agent wakes for events at once; this only paces its own checks (timeouts, grace)


class _AttemptSink:
    """What one attempt's tasks report; late reports of an earlier attempt are told apart."""

    def __init__(self, agent: "Agent", attempt: int):
        self.agent, self.attempt = agent, attempt

    def event(self, index: int, event: protocol.Event) -> None:
        self.agent.events.put((self.attempt, index, event))

    def output(self, index: int, lines: list[str], dropped: int) -> None:
        self.agent.tails[index].extend(lines)
        self.agent.out.task_lines(index, self.agent.run.tasks[index].host, lines, dropped)

    def garbage(self, index: int, text: str) -> None:
        self.agent.out.logline(f"task {index}: a line from its supervisor that is not a record (ignored): {text}")
        self.output(index, [text], 0)


class Agent(Watch):
    def __init__(self, spec: ClusterSpec, engine: Engine, owner: Owner, out: Output):
        self.spec, self.engine, self.owner, self.out = spec, engine, owner, out
        self.plans = engine.plans
        self.run = owner.record
        self.plan_of = {p.index: p for p in self.plans}
        self.live: set[int] = set()  # tasks started in this attempt whose exit is not known yet
        self.preempted_at: float | None = None
        self.tails = {p.index: collections.deque(maxlen=TAIL_LINES) for p in self.plans}
        self.events: queue.Queue = queue.Queue()
        self.heard: dict[int, float] = {}  # when each task of this attempt last sent any record
        owner.warn = out.say
        engine.on_job = self.job_known

    def job_known(self, job: dict) -> None:
        """A scheduler's job for the run (its id while it waits in the queue): recorded at once."""
        self.run.job = job
        self.owner.save()

    # -- the policy: attempt -> (succeeded | preempted | restart | shrink | failed), teardown always
    def execute(self) -> None:
        run, launch = self.run, self.spec.launch
        try:
            while True:
                outcome, failure, reason = self.attempt(run.attempt)
                final = failure is not None and failure.kind == FailureKind.SCHEDULER  # no restart would come
                if outcome == Outcome.SUCCEEDED:
                    run.set_state(RunState.SUCCEEDED)
                    return
                if outcome == Outcome.PREEMPTED and run.preemptions < launch.max_preemptions:
                    run.preemptions += 1
                    self.out.say(f"attempt {run.attempt} was preempted: {reason}")
                    self.restarting(f"restarting the whole group after preemption {run.preemptions} (not counted "
                                    "against max_restarts); it resumes from its last checkpoint")
                elif outcome == Outcome.FAILED and not final and self.shrink():
                    self.out.say(f"attempt {run.attempt} lost a host: {reason}")
                    self.restarting(f"going on with {len(self.plans)} task(s) ({', '.join(map(self.label, self.plan_of))});"
                                    " they resume from the last checkpoint with a new TF_CONFIG")
                elif outcome == Outcome.FAILED and not final and run.restarts < launch.max_restarts:
                    run.restarts += 1
                    self.out.say(f"attempt {run.attempt} failed: {reason}")
                    self.restarting(f"restarting the whole group (restart {run.restarts} of {launch.max_restarts}) "
                                    "after that failure; it resumes from its last checkpoint")
                else:
                    if outcome == Outcome.PREEMPTED:
                        failure = Failure(kind=FailureKind.SCHEDULER, message=(
                            f"preempted more than max_preemptions = {launch.max_preemptions} times; last: {reason}"))
                    run.set_state(RunState.FAILED, failure)
                    raise RunFailed(failure.message)
                run.attempt += 1
        except KeyboardInterrupt:
            why = interrupts.reason()
            if (run_path(run.run_id) / "down.request").exists():
                why = "stopped by 'mgpu-cluster down'"
            with interrupts.shield(self.out.say):
                unreached = self.teardown(why)
                stopped = Failure(kind=FailureKind.STOPPED, message=f"{why}; {self.stop_words(unreached)}")
                run.set_state(RunState.STOPPED, stopped)
                self.end_attempt(Outcome.STOPPED, why, stopped)
            raise Interrupted(stopped.message) from None
        finally:
            with interrupts.shield(self.out.say):
                if self.live:
                    self.teardown("the launcher is exiting")
                self.owner.save()

    def restarting(self, words: str) -> None:
        """Say that the group goes on, unless a Ctrl-C or `down` came while the attempt was torn down."""
        interrupts.raise_pending()
        self.out.say(words)

    def stop_words(self, unreached: list[int]) -> str:
        return stop_words([str(i) for i in self.plan_of if i not in unreached], list(map(self.label, unreached)),
                          self.spec.launch.lifeline)

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
            self.out.say(f"{self.label(i)} is left out: {answers[indices.index(i)].error}")
        if self.run.attempts:
            self.run.attempts[-1].outcome = Outcome.SHRUNK
        self.engine.close()
        self.engine = engine_for(self.spec, self.run.run_id, only=left)
        self.engine.on_job = self.job_known
        self.plans = self.engine.plans
        self.plan_of = {p.index: p for p in self.plans}
        return True

    def attempt(self, number: int) -> tuple[Outcome, Failure | None, str | None]:
        """Run one attempt of the group: its outcome, its failure (None unless it failed), and why."""
        run = self.run
        run.set_state(RunState.STARTING)
        active = [run.tasks[p.index] for p in self.plans]
        run.attempts.append(Attempt(number=number, started_at=time.time(), tasks=[p.index for p in self.plans]))
        for t in active:
            t.state, t.exit_code, t.pid, t.create_time, t.heartbeat, t.progress = TaskState.PENDING, None, None, None, None, None
            t.proc_status, t.restarts = None, number
        self.events, self.heard, self.preempted_at = queue.Queue(), {}, None
        run.phases.setdefault("spawn_started", time.time())
        self.owner.save()
        self.live = {p.index for p in self.plans}
        not_started = self.engine.start(number, _AttemptSink(self, number))
        spawn_at = time.time()  # a scheduler's start() returns once its job left the queue
        failure = None
        for i, why in sorted(not_started.items()):  # every host's outcome: one must not hide another
            self.live.discard(i)
            run.tasks[i].state = TaskState.FAILED
            failure = failure or self.task_failure(i, FailureKind.NOT_STARTED, f"could not be started: {why}")
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
                    break
                continue
            failure = failure or self.check_timeouts(spawn_at)
            if failure is None and all(t.state == TaskState.SUCCEEDED for t in active):
                self.mark_phase("end")
                self.end_attempt(Outcome.SUCCEEDED, None)
                return Outcome.SUCCEEDED, None, None
            self.owner.save(every=SAVE_EVERY_S)
        return self.conclude(number, failure)

    def conclude(self, number: int, failure: Failure | None) -> tuple[Outcome, Failure | None, str]:
        """An attempt that did not succeed: the scheduler's verdict first (a requeue is a preemption;
        a time limit or an outside cancel ends the run), else a preemption or the failure itself."""
        verdict = self.engine.verdict(number)
        if verdict is not None and verdict.cause == SchedulerCause.REQUEUED:
            self.settle("the scheduler requeued the job")  # Slurm ends them; the job runs again by itself
            self.end_attempt(Outcome.PREEMPTED, verdict.reason)
            return Outcome.PREEMPTED, None, verdict.reason
        if verdict is not None:
            failure = Failure(kind=FailureKind.SCHEDULER, message=(
                f"{verdict.reason}. Tasks that saved on notice are recorded preempted; the run ends here (no "
                f"restart follows a scheduler's end). 'mgpu-cluster logs {self.run.run_id}' shows their logs."))
        elif failure is None:  # a preemption: the group saved, or had preempt_grace to
            names = [self.label(t.index) for t in self.run.tasks if t.state == TaskState.PREEMPTED]
            reason = (f"{', '.join(names) or 'a task'} got notice to stop (a signal from its host or scheduler); "
                      "the group saved a checkpoint, or had preempt_grace to")
            with interrupts.shield(self.out.say):
                self.teardown("the group was preempted")
            self.end_attempt(Outcome.PREEMPTED, reason)
            return Outcome.PREEMPTED, None, reason
        self.out.say(f"attempt {number} failed: stopping every task")
        with interrupts.shield(self.out.say):
            self.teardown("another task failed")
        self.end_attempt(Outcome.FAILED, failure.message, failure)
        return Outcome.FAILED, failure, failure.message

    def end_attempt(self, outcome: Outcome, reason: str | None, failure: Failure | None = None) -> None:
        current = self.run.attempts[-1] if self.run.attempts else None
        if current is not None and current.ended_at is None:
            current.ended_at, current.outcome, current.reason, current.failure = time.time(), outcome, reason, failure
            self.owner.save()

    def settle(self, reason: str) -> None:
        """Wait (bounded) for the exit reports of tasks that something else is ending, stopping nothing."""
        self.collect(set(self.live), self.spec.launch.stop_grace + TEARDOWN_SLACK_S)
        for i in self.live:
            self.run.tasks[i].state = TaskState.STOPPED
            self.out.say(f"{self.label(i)} sent no exit report ({reason})")
        self.live = set()

    def collect(self, live: set[int], seconds: float) -> None:
        """Take exit reports of `live` tasks of this attempt for up to `seconds`; they leave `live`."""
        number, deadline = self.run.attempt, time.time() + seconds
        while live and time.time() < deadline:
            try:
                attempt, index, ev = self.events.get(timeout=TICK_S)
            except queue.Empty:
                continue
            if attempt != number or index not in live:
                continue
            if isinstance(ev, (protocol.Exit, protocol.Lost)):
                live.discard(index)
                self.live.discard(index)
                task = self.run.tasks[index]
                task.exit_code, task.ended_at = getattr(ev, "code", None), time.time()
                if isinstance(ev, protocol.Exit) and (ev.notice or ev.code == protocol.EXIT_PREEMPTED):
                    task.state = TaskState.PREEMPTED
                elif task.state != TaskState.PREEMPTED:
                    task.state = TaskState.STOPPED if isinstance(ev, protocol.Exit) else TaskState.LOST
            elif isinstance(ev, (protocol.Started, protocol.Note)):
                self.on_event(index, ev)

    def teardown(self, reason: str) -> list[int]:
        """Stop every live task, then wait (bounded) for each one's exit report; the tasks that could
        not be reached to stop them."""
        live, self.live = set(self.live), set()
        if not live:
            return []
        self.out.say(f"stopping {len(live)} task(s): {reason}")
        self.engine.stop(sorted(live))
        self.collect(live, self.spec.launch.stop_grace + TEARDOWN_SLACK_S)
        unreached = []
        if live:
            self.out.say(f"tasks {sorted(live)} did not confirm their stop; stopping them from their folders")
            stuck = sorted(live)
            for index, res in zip(stuck, self.engine.stop_from_folders(stuck)):
                task = self.run.tasks[index]
                task.state, task.ended_at = (TaskState.STOPPED if res.ok else TaskState.LOST), time.time()
                if not res.ok:  # an unreachable host must not end the teardown
                    unreached.append(index)
                    self.out.say(f"{self.label(index)} could not be stopped: {res.error}")
        for p in self.plans:
            task = self.run.tasks[p.index]
            if task.state in (TaskState.PENDING, TaskState.RUNNING):
                task.state = TaskState.STOPPED
        self.owner.save()
        return unreached

