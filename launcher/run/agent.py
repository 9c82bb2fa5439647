"""The agent: the one restart policy, for every engine. Each attempt starts every task, follows its
events until it succeeds, fails, is preempted or loses a host; then the run succeeds, restarts, shrinks
or fails, and whatever ends it, its live tasks are torn down.

It reads only typed events (worker.host.protocol) from its engine; output lines go straight to the
display and never through this loop, so a flood or a stalled terminal cannot delay fail-fast. What an
event means is watch.py's; one attempt's live state is attempt.py's; stopping it is teardown.py's.
"""

from __future__ import annotations

import json
import os
import queue
import time

from launcher.diagnose.stacks import at_hang
from launcher.engines import engine_for
from launcher.engines.base import Inspecting, JobRecord, Launching, SchedulerCause, StandbyState
from launcher.errors import Interrupted, RunFailed
from launcher.run import interrupts, phases, teardown, watch
from launcher.run.attempt import AttemptSink, LiveAttempt
from launcher.run.elastic import Elastic
from launcher.run.failure import Failure, FailureKind, stop_words, told_once, with_stacks
from launcher.run.output import Output
from launcher.run.progress import EpochEnd, Progress, without_told
from launcher.run.record import PROGRESS_LOG, Attempt, Owner, run_path
from launcher.run.states import AttemptOutcome as Outcome
from launcher.run.states import Figures, RunPhase, RunState, TaskState
from launcher.spec.cluster import ClusterSpec
from worker.host import protocol

SAVE_EVERY_S = 1.0
TICK_S = 0.5  # the agent wakes for events at once; this only paces its own checks (timeouts, grace)


class Agent:
    """Runs a spec's attempts on an engine that takes the Launching role (start, stop, verdict,
    reachable, on_job); a teardown past its deadline stops from folders through its Inspecting role."""

    def __init__(self, spec: ClusterSpec, engine: Launching, owner: Owner, out: Output):
        self.spec, self.engine, self.owner, self.out = spec, engine, owner, out
        self.run = owner.record
        self.current: LiveAttempt | None = None  # the attempt that a Ctrl-C or an exit tears down
        self.epochs_told: dict[int, list[EpochEnd]] = {}  # per task: the epoch summaries its last history line held
        self.marks: phases.Phases | None = None  # the current attempt's phases (phases.py)
        self.carried: Figures = {}  # what the attempt before gives the next one's phases
        # an elastic run's group: left out, taken back (elastic.py)
        self.elastic = Elastic(spec, self.run, out.say, lambda i: watch.label(self.run, i), out.logline) \
            if spec.launch.min_hosts is not None else None
        owner.warn = out.say
        self.listen(engine)

    @property
    def attempt_phases(self) -> phases.Phases:
        """The current attempt's phases: there from the start of the first attempt on."""
        assert self.marks is not None, "no attempt has begun"
        return self.marks

    def listen(self, engine: Launching) -> None:
        """What `engine` tells outside an attempt's records comes here."""
        engine.on_job, engine.on_standby, engine.on_note = self.job_known, self.standby_known, self.note_known

    def job_known(self, job: JobRecord) -> None:
        """A scheduler's job for the run (its id while it waits in the queue): recorded at once."""
        self.run.job_known(job)
        self.owner.save()

    def standby_known(self, index: int, standby: StandbyState | None) -> None:
        """A task's standby as its engine last heard of it (on the engine's thread: the next save keeps it)."""
        if not self.run.ended:
            self.run.task(index).standby_is(standby)

    def note_known(self, index: int, text: str) -> None:
        """A line about a task, shown as the task's: its supervisor's Note, or one from outside its attempt (its
        standby's, on the engine's thread)."""
        if not self.run.ended:
            self.out.say(f"{watch.label(self.run, index)}: {text}")

    # -- the policy: attempt -> (succeeded | preempted | shrink | restart | failed), teardown always
    def execute(self) -> None:
        run = self.run
        try:
            while not self.next_after(self.attempt(run.attempt)):
                run.next_attempt()
        except KeyboardInterrupt:
            why = interrupts.reason()
            if (run_path(run.run_id) / "down.request").exists():
                why = "stopped by 'mgpu-cluster down'"
            with interrupts.shield(self.out.say):
                unreached = self.teardown(why)
                stopped = Failure(kind=FailureKind.STOPPED, message=f"{why}; {self.stop_words(unreached)}")
                run.set_state(RunState.STOPPED, stopped)
                if run.attempts:
                    self.end_attempt(Outcome.STOPPED, why, stopped)
            raise Interrupted(stopped.message) from None
        finally:
            with interrupts.shield(self.out.say):
                if self.elastic is not None:
                    self.elastic.close()
                self.teardown("the launcher is exiting")
                self.owner.save()

    def next_after(self, ended: Attempt) -> bool:
        """After an attempt: True when the run succeeded; False when another attempt follows; RunFailed else."""
        run, launch, reason = self.run, self.spec.launch, ended.reason
        final = ended.failure is not None and ended.failure.kind == FailureKind.SCHEDULER  # no restart would come
        if ended.outcome == Outcome.SUCCEEDED:
            run.set_state(RunState.SUCCEEDED)
            return True
        if ended.outcome == Outcome.REGROUPED and self.elastic is not None:
            back = self.elastic.grown()
            self.regroup(sorted({p.index for p in self.engine.plans} | set(back)))
            left = ", ".join(watch.label(run, p.index) for p in self.engine.plans)
            self.restarting(f"going on with {len(self.engine.plans)} task(s) ({left}), {self.elastic.names(back)} "
                            "taken back; they resume from the checkpoint the group just saved with a new TF_CONFIG")
        elif ended.outcome == Outcome.PREEMPTED and run.preemptions < launch.max_preemptions:
            run.preempted_again()
            self.out.say(f"attempt {ended.number} was preempted: {reason}")
            self.restarting(f"restarting the whole group after preemption {run.preemptions} (not counted "
                            "against max_restarts); it resumes from its last checkpoint")
        elif ended.outcome == Outcome.FAILED and not final and self.shrink(ended):
            self.out.say(f"attempt {ended.number} lost a host: {self.told(ended)}")
            left = ", ".join(watch.label(run, p.index) for p in self.engine.plans)
            self.restarting(f"going on with {len(self.engine.plans)} task(s) ({left}); they resume from the "
                            "last checkpoint with a new TF_CONFIG")
        elif ended.outcome == Outcome.FAILED and not final and run.restarts < launch.max_restarts:
            run.restarted()
            self.out.say(f"attempt {ended.number} failed: {self.told(ended)}")
            self.restarting(f"restarting the whole group (restart {run.restarts} of {launch.max_restarts}) "
                            "after that failure; it resumes from its last checkpoint")
        else:
            failure = ended.failure or Failure(kind=FailureKind.SCHEDULER, message=(
                f"preempted more than max_preemptions = {launch.max_preemptions} times; last: {reason}"))
            run.set_state(RunState.FAILED, failure)
            raise RunFailed(told_once(failure, self.out))  # after the record: a stalled screen cannot delay it
        return False

    def told(self, ended: Attempt) -> str:
        """An attempt's failure in words, without the log lines the screen showed already."""
        return told_once(ended.failure, self.out) if ended.failure else ended.reason or ""

    def restarting(self, words: str) -> None:
        """Say that the group goes on, unless a Ctrl-C or `down` came while the attempt was torn down."""
        interrupts.raise_pending()
        self.out.say(words)

    def stop_words(self, unreached: list[int]) -> str:
        stopped = [str(p.index) for p in self.engine.plans if p.index not in unreached]
        return stop_words(stopped, [watch.label(self.run, i) for i in unreached], self.spec.launch.lifeline)

    def shrink(self, ended: Attempt) -> bool:
        """Elastic runs (min_hosts): leave out the hosts that no longer answer, if enough remain."""
        if self.elastic is None:
            return False
        indices = [p.index for p in self.engine.plans]
        left = self.elastic.left(indices, self.engine.reachable(indices))
        if left is None:
            return False
        ended.shrunk()
        self.regroup(left)
        return True

    def regroup(self, tasks: list[int]) -> None:
        """The group goes on with these tasks: an engine of their own (of the kind that started the run)."""
        self.engine.close()
        engine = engine_for(self.spec, self.run.run_id, only=tasks, landed=self.run)
        assert isinstance(engine, Launching)
        self.engine = engine
        self.listen(self.engine)

    def grow(self, live: LiveAttempt) -> None:
        """Lost hosts that answer and passed the preflight again: the group is told to save and end (a notice),
        and the next attempt takes them back."""
        if self.elastic is None or self.run.state != RunState.RUNNING or not live.live:
            return
        if self.spec.training.entrypoint is not None and "first_step_s" not in self.run.attempts[-1].phases:
            return  # the built-in runner saves on notice once it trains: not while it starts
        back = self.elastic.to_take_back()
        if back and len(self.engine.regroup(live.live)) < len(live.live):
            self.elastic.noticed(back, len(live.tasks))

    # -- one attempt
    def attempt(self, number: int) -> Attempt:
        """Run attempt `number` of the group to its end; its record (outcome, reason, failure)."""
        run = self.run
        run.set_state(RunState.STARTING)
        tasks = [p.index for p in self.engine.plans]
        begun = run.begin_attempt(tasks)
        self.marks, self.carried = phases.Phases(begun, self.carried, phases.reached(run)), {}
        if self.elastic is not None:
            self.elastic.attempt_begins()
        self.share_backup(number)
        for i in tasks:
            run.task(i).begin(number)
        run.mark(RunPhase.SPAWN_STARTED)
        self.owner.save()
        live = self.current = LiveAttempt(number, tasks)
        self.marks.spawning()
        not_started = self.engine.start(number, AttemptSink(live, run, self.out))
        live.spawned_at = time.monotonic()  # a scheduler's start() returns once its job left the queue
        failure = None
        for i, why in sorted(not_started.items()):  # every host's outcome: one must not hide another
            live.give_up(i)
            run.task(i).failed()
            failure = failure or watch.task_failure(run, live, i, FailureKind.NOT_STARTED,
                                                    f"could not be started: {why}")
        self.owner.save()
        failure = failure or self.follow(live)
        if failure is None and live.preempted_at is None:
            run.mark(RunPhase.END)
            return self.end_attempt(Outcome.SUCCEEDED, None)
        return self.conclude(live, failure)

    def share_backup(self, number: int) -> None:
        """Before a restart's tasks start (or the first's, of a run that goes on from another), every host holds
        the run's newest backup (copied where it lacks it: a phase of the attempt); a copy that cannot be made ends
        the run, as replicas must never start from different weights."""
        copy = self.engine.share_backup(first=number == 0)
        if copy is None:
            return
        if copy.error:
            failure = Failure(kind=FailureKind.NOT_STARTED, message=copy.error, task=copy.task, host=copy.host)
            self.run.set_state(RunState.FAILED, failure)
            self.end_attempt(Outcome.FAILED, failure.message, failure)
            raise RunFailed(told_once(failure, self.out))
        self.attempt_phases.copied(copy)
        if copy.source is None and self.attempt_phases.reached > 0:
            self.out.say("no live host holds a backup of this run: the group starts again from its first step (each "
                         "host keeps its own checkpoint folder, and a backup on a lost host is lost with it)")
        elif copy.copied and copy.source is not None:
            self.out.say(phases.copy_line(copy, [watch.label(self.run, i) for i in copy.copied],
                                          watch.label(self.run, copy.source), number))
        elif len(copy.same) > 1:
            self.out.say(f"every host holds the run's backup (global step {copy.steps_done}) already, the same bytes "
                         f"(shared storage): nothing copied ({copy.seconds:.1f} s to check)")

    def follow(self, live: LiveAttempt) -> Failure | None:
        """The attempt's events until it ends: its failure, or None (every task succeeded, or a preemption's
        grace is over). The run is running once every task has started: any end counts as a start."""
        launch = self.spec.launch
        while True:
            try:
                index, ev = live.events.get(timeout=TICK_S)
            except queue.Empty:
                pass
            else:
                failure = self.on_event(live, index, ev)
                if failure is not None:  # a peer's exit may name the hung task (watch.abandoned)
                    return self.hang_stacks(live, failure)
            if live.preempted_at is not None:
                if not live.live or time.monotonic() - live.preempted_at > launch.preempt_grace:
                    return None
                continue
            failure = watch.overdue(self.run, live, launch)
            if failure is not None:
                self.attempt_phases.failed(self.run, failure.task, None)
                return self.hang_stacks(live, failure)
            if self.run.state == RunState.STARTING and live.all_started:
                self.attempt_phases.all_started(time.time(), sum(self.run.task(i).warm for i in live.tasks))
                if self.spec.training.entrypoint is None:  # a command tells no steps: it is back once started
                    self.attempt_phases.started_untold(time.time())
                    if self.elastic is not None:
                        self.elastic.first_step()
                self.run.set_state(RunState.RUNNING)
                self.run.mark(RunPhase.ALL_STARTED)
                self.owner.save()
            if not live.live:  # all ended, none failed or was preempted
                return None
            self.grow(live)
            self.owner.save(every=SAVE_EVERY_S)

    def on_event(self, live: LiveAttempt, index: int, ev: protocol.Event) -> Failure | None:
        if isinstance(ev, protocol.Note):
            self.note_known(index, ev.text)
            return None
        preempted = live.preempted_at is not None
        failure = watch.apply(self.run, live, index, ev)
        if failure is not None and failure.kind == FailureKind.HUNG:  # when the task it names last progressed
            self.attempt_phases.failed(self.run, failure.task, None)
        elif failure is not None or live.preempted_at is not None:
            self.attempt_phases.failed(self.run, index, ev)
        if isinstance(ev, protocol.Progress):
            self.remember(index, self.run.task(index).progress)
            mark = self.attempt_phases.progress(self.run.task(index).progress or {}, time.time())
            if mark is phases.Mark.FIRST_STEP and self.elastic is not None:
                self.elastic.first_step()
            if mark is not None and live.number > 0:
                ph = self.run.attempts[-1].phases
                self.out.say(phases.restart_line(live.number, ph) if mark is phases.Mark.FIRST_STEP else
                             phases.back_line(live.number, ph))
        if isinstance(ev, protocol.Exit) and not preempted and live.preempted_at is not None:
            self.out.say(watch.preempted_words(self.run, index, ev, self.spec.launch.preempt_grace))
        if isinstance(ev, (protocol.Exit, protocol.Lost)) and failure is None:
            self.owner.save()
        return failure

    def hang_stacks(self, live: LiveAttempt, failure: Failure) -> Failure:
        """A hang: every live task's stacks taken before anything is stopped; the hung one's in its failure."""
        engine = self.engine
        if failure.kind != FailureKind.HUNG or not isinstance(engine, Inspecting):  # (stacks: Inspecting.call)
            return failure
        assert failure.task is not None  # a hang names the task that hung
        tasks = [(i, self.run.host_of(i)[0], self.run.task(i).pid, self.run.task(i).create_time) for i in live.live]
        return with_stacks(failure, at_hang(engine, tasks, failure.task, self.out))

    def conclude(self, live: LiveAttempt, failure: Failure | None) -> Attempt:
        """An attempt that did not succeed: the scheduler's verdict first (a requeue is a preemption;
        a time limit or an outside cancel ends the run), else a preemption or the failure itself."""
        self.attempt_phases.decided_at = time.time()
        verdict = self.engine.verdict(live.number)
        if verdict is not None and verdict.cause == SchedulerCause.REQUEUED:
            # Slurm ends them; the job runs again by itself
            teardown.settle(self.run, live, "the scheduler requeued the job", self.spec.launch.stop_grace, self.out.say)
            self.owner.save()
            return self.end_attempt(Outcome.PREEMPTED, verdict.reason)
        if verdict is not None:
            failure = Failure(kind=FailureKind.SCHEDULER, message=(
                f"{verdict.reason}. Tasks that saved on notice are recorded preempted; the run ends here (no "
                f"restart follows a scheduler's end). 'mgpu-cluster logs {self.run.run_id}' shows their logs."))
        elif failure is None and self.elastic is not None and self.elastic.regrouping:  # the notice was ours
            reason = (f"the group saved to take back {self.elastic.names(self.elastic.regrouping)}, whose host "
                      "answers again")
            with interrupts.shield(self.out.say):
                self.teardown("the group regroups")
            return self.end_attempt(Outcome.REGROUPED, reason)
        elif failure is None:  # a preemption: the group saved, or had preempt_grace to
            names = [watch.label(self.run, t.index) for t in self.run.tasks if t.state == TaskState.PREEMPTED]
            reason = (f"{', '.join(names) or 'a task'} got notice to stop (a signal from its host or scheduler); "
                      "the group saved a checkpoint, or had preempt_grace to")
            with interrupts.shield(self.out.say):
                self.teardown("the group was preempted")
            return self.end_attempt(Outcome.PREEMPTED, reason)
        self.out.say(f"attempt {live.number} failed: stopping every task")
        with interrupts.shield(self.out.say):
            # the built-in runner's TERM is a save with the whole group, which cannot land now; a `command`
            # keeps its stop_grace (it may clean up on TERM)
            self.teardown("another task failed", broken=self.spec.training.entrypoint is not None)
        return self.end_attempt(Outcome.FAILED, failure.message, failure)

    def end_attempt(self, outcome: Outcome, reason: str | None, failure: Failure | None = None) -> Attempt:
        """The current attempt's record, ended (once: a later call leaves it as it was)."""
        current = self.run.attempts[-1]
        if current.end(outcome, reason, failure):
            assert current.ended_at is not None  # end() set it
            # what the next attempt's phases take from its end
            self.carried = self.attempt_phases.ended(current.ended_at)
            self.owner.save()
        return current

    def teardown(self, reason: str, broken: bool = False) -> list[int]:
        """Stop the current attempt's live tasks (see teardown.py); the ones that could not be reached."""
        if self.current is None or not self.current.live:
            return []
        unreached = teardown.teardown(self.engine, self.run, self.current, reason, self.spec.launch.stop_grace,
                                      self.out.say, broken)
        self.owner.save()
        return unreached

    def remember(self, index: int, progress: Progress | None) -> None:
        """Each progress record, appended to the run's progress.jsonl (for `report`), each finished epoch's
        summary once; a full disk skips it."""
        told, self.epochs_told[index] = self.epochs_told.get(index, []), (progress or {}).get("epoch_ends") or []
        line = json.dumps({"time": time.time(), "task": index, "attempt": self.run.attempt,
                           "progress": without_told(progress, told)}, default=str)
        try:
            fd = os.open(run_path(self.run.run_id) / PROGRESS_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)
        except OSError:
            pass  # the record's own save reports a full MGPU_HOME
