"""Each attempt's phases (Attempt.phases, in seconds): for a restart, how long its failure took to reach the
agent, the teardown, the spawn, the wait for the first step, the steps trained again since the last
checkpoint, and when the group was back at the step it had reached (what the crash cost the run); for the
first attempt, its spawn and first step (the cold start). Told in one line each, an estimate as "about"."""

from __future__ import annotations

import enum
import math
import time
from typing import Literal, Mapping, NamedTuple

from launcher.engines.base import BackupCopy
from launcher.run.progress import Progress, step
from launcher.run.record import Attempt, RunRecord
from launcher.run.states import AttemptPhase, Figures, RunPhase
from worker.host import protocol

# the parts of a restart, in order, and their words
Part = Literal["detected_s", "teardown_s", "copy_s", "spawn_s", "first_step_s"]
PARTS: tuple[tuple[Part, str], ...] = (("detected_s", "detected"), ("teardown_s", "teardown"), ("copy_s", "backup copy"),
                                       ("spawn_s", "spawn"), ("first_step_s", "to first step"))
ESTIMATED = AttemptPhase.ESTIMATED
UNPRINTED = AttemptPhase.UNPRINTED


def seconds(since: float, until: float) -> float:
    return round(max(0.0, until - since), 3)


def estimated(ph: Mapping[str, object], name: str) -> bool:
    """Whether the phases `ph` give `name` as an estimate."""
    names = ph.get(ESTIMATED) or ()
    return isinstance(names, (list, tuple)) and name in names


def failed_at(run: RunRecord, index: int | None, ev: protocol.Event | None, now: float) -> float:
    """When the failing task ended as it reported it: its Exit's time (its host's clock, kept within the
    last minute: a skewed clock must not make up a phase); a hung task, or one lost (its end unreported), when it
    last progressed; else now."""
    if isinstance(ev, protocol.Exit) and 0 <= now - ev.time <= 60:
        return ev.time
    beat = run.task(index).heartbeat if (ev is None or isinstance(ev, protocol.Lost)) and index is not None else None
    if beat:
        return min(now, beat)
    return now


class Mark(enum.Enum):
    """What a progress record marked in a restarted attempt (each once)."""
    FIRST_STEP = "first step"
    BACK = "back at the step reached"


# a step count read from a progress record may be up to a write interval (1 s) behind the failure: it is carried
# forward at the group's rate, over at most this long (a task that stopped stepping long before it failed: a hang)
EXTRAPOLATE_MAX_S = 3.0
# a task whose record says so trains no further step: it saved on a notice (the group stopped at that step), or is done
STOPPED_STEPPING = (protocol.ProgressState.PREEMPTED, protocol.ProgressState.DONE)


def reached(run: RunRecord) -> int:
    """The furthest global step any task reported in the attempt that just ended (before a new one begins)."""
    return max((step(t.progress) for t in run.tasks), default=0)


class Phases:
    """The marks of one attempt, on the wall clock (the record keeps what they add up to)."""

    def __init__(self, attempt: Attempt, carried: Figures, reached_step: int):
        """`reached_step`: where the attempt before got to (reached(), before the tasks' progress is reset; its
        own marks carry it forward to its failure); `carried`: what its end gave (ended())."""
        carried = carried.copy()
        told, guessed = carried.pop("epoch_told", None), carried.pop("estimated", [])
        self.told: int | None = None if told is None else int(told)  # the last epoch whose line reached us
        self.told_before = self.told  # (or the epoch before the run's first)
        self.attempt, self.reached = attempt, max(reached_step, int(carried.get("reached_step", 0)))
        attempt.measured(carried)  # detected_s, teardown_s, failed_at and reached_step of the attempt before
        if "reached_step" in carried:
            attempt.measured({"reached_step": self.reached})
            self.mark(AttemptPhase.REACHED_STEP, AttemptPhase.REACHED_STEP in guessed and self.reached > reached_step)
        self.spawn_at: float | None = None
        self.started_at: float | None = None
        self.detected: tuple[float, float] | None = None  # (when the failing task ended, when the agent knew)
        self.decided_at: float | None = None  # when the agent decided to stop the attempt
        self.points: list[tuple[float, float]] = []  # the group's last two (global step, the task's time) of this attempt
        self.last: dict[int | None, tuple[int, float]] = {}  # each task's last (global step, time) read
        self.idle = False  # the last record read was of a group not training (validating, saving, at an epoch's end)
        self.total = self.per_epoch = 0  # the training's steps in all and per epoch, where its progress says

    def mark(self, name: AttemptPhase, estimate: bool) -> None:
        """Phase `name` is an estimate (or measured) from now on."""
        ph = self.attempt.phases
        names = [n for n in ph.get("estimated", []) if n != name] + ([name.value] if estimate else [])
        self.attempt.measured({"estimated": names})

    def failed(self, run: RunRecord, index: int | None, ev: protocol.Event | None) -> None:
        """A task's end failed the attempt (or gave notice; `ev` None: a hang or a silence): the first one counts."""
        if self.detected is None:
            now = time.time()
            self.detected = (failed_at(run, index, ev, now), now)

    def ended(self, stopped_at: float) -> Figures:
        """What the attempt's end gives the next attempt's phases (nothing where no stop was decided: it succeeded)."""
        if self.decided_at is None:
            return {}
        failure_at, detected_at = self.detected or (None, None)
        carried = ended(failure_at, detected_at, self.decided_at, stopped_at)
        if failure_at is not None and self.points:
            carried["reached_step"] = self.step_at(failure_at)
            if carried["reached_step"] > self.points[-1][0]:
                carried["estimated"] = [AttemptPhase.REACHED_STEP]
        if self.told is not None:
            carried["epoch_told"] = self.told
        return carried

    def step_at(self, when: float) -> int:
        """The group's global step at `when` (its failure), where a step was read: the last one read, carried
        forward at the rate between the last two reads (a step counts once done), never past its epoch's last
        step (validation and the save follow it), and not at all where the last record read was of a group not
        training (validating, at an epoch's end, or saved on a notice): there the step read is the step reached."""
        (g0, t0), (g1, t1) = self.points[0], self.points[-1]
        if self.idle:
            return int(g1)
        rate = (g1 - g0) / (t1 - t0) if t1 > t0 else 0.0
        end = -(-int(g1) // self.per_epoch) * self.per_epoch if self.per_epoch else math.inf
        return int(min(g1 + rate * min(max(0.0, when - t1), EXTRAPOLATE_MAX_S), self.total or math.inf, end))

    def seen(self, progress: Progress, now: float) -> bool:
        """Keep this record's (global step, time) as the group's latest, where it is one step count later
        (the tasks step together); its time is the task's, kept within what came before and now. `progress`
        is typed (launcher.run.progress): a time there is a finite number. A task's record at the step it told
        before, written later, is of a group not training (validating, saving); so is one at an epoch's end, and
        one of a task that saved on a notice or is done (STOPPED_STEPPING)."""
        g, t = step(progress), progress.get("time")
        self.per_epoch = step(progress, "steps_per_epoch") or self.per_epoch
        if self.per_epoch and step(progress, "epochs"):
            self.total = self.per_epoch * step(progress, "epochs")
        ends = [e["epoch"] for e in progress.get("epoch_ends", [])]
        if ends:
            self.told = max(self.told or 0, *ends)
        if t is None:
            return False
        before, self.last[progress.get("task")] = self.last.get(progress.get("task")), (g, t)
        t = min(max(t, self.points[-1][1] if self.points else t), now)
        first = progress.get("first_step_at")  # the attempt's first step: a rate from the first record on
        if not self.points and first is not None and first < t:
            self.points = [(step(progress, "first_global_step") + 1, first)]
        stopped = protocol.ProgressState.of(progress) in STOPPED_STEPPING
        if self.points and g <= self.points[-1][0]:
            if stopped or before is not None and before[0] == g and before[1] < self.last[progress.get("task")][1]:
                self.idle = True
            return False
        self.points = [*self.points, (g, t)][-2:]
        self.idle = stopped or bool(self.per_epoch) and step(progress, "step") == self.per_epoch
        return True

    def copied(self, copy: BackupCopy) -> None:
        """The run's backup was brought to every host that restores (engines.base.BackupCopy): its time and bytes."""
        self.attempt.measured({"copy_s": copy.seconds})
        self.attempt.measured({"copy_bytes": copy.bytes})

    def spawning(self) -> None:
        self.spawn_at = time.time()

    def all_started(self, now: float, warm: int) -> None:
        """Every task started, `warm` of them from their standbys."""
        if self.spawn_at is not None and self.started_at is None:
            self.started_at = now
            self.attempt.measured({"spawn_s": seconds(self.spawn_at, now)})
            self.attempt.measured({"warm_tasks": warm})

    def started_untold(self, now: float) -> None:
        """Every task of a program that tells no steps (a command) started: its restart took until then."""
        ph = self.attempt.phases
        if "failed_at" in ph and "took_s" not in ph:
            self.attempt.measured({"took_s": seconds(ph["failed_at"], now)})

    def progress(self, progress: Progress, now: float) -> Mark | None:
        """A progress record: the mark it is, if any. Its first trained step records first_step_s and, after
        a restart, took_s, steps_redone and the epochs saved before it whose lines never came; the step the
        attempt before had reached, back_s."""
        ph = self.attempt.phases
        before = self.points[-1] if self.points else None
        moved = self.seen(progress, now)
        if step(progress) <= step(progress, "first_global_step"):
            return None
        if "first_step_s" in ph:
            return self.back(before, self.points[-1]) if moved else None
        first = progress.get("first_step_at")  # the task's own time of its first step (the record is read later)
        start = self.started_at or self.spawn_at or now
        at = min(max(first, start), now) if isinstance(first, (int, float)) else now
        self.attempt.measured({"first_step_s": seconds(start, at)})
        if "failed_at" in ph:
            self.attempt.measured({"took_s": seconds(ph["failed_at"], at)})
        self.first_epoch(step(progress, "first_epoch"))
        if self.attempt.number > 0 and "first_global_step" in progress:  # a script of its own may not say
            resumed = step(progress, "first_global_step")
            self.attempt.measured({"resumed_step": resumed})
            if "reached_step" in ph and resumed >= self.reached:  # it got as far as it saved: measured
                self.reached = resumed
                self.attempt.measured({"reached_step": self.reached})
                self.mark(AttemptPhase.REACHED_STEP, False)
            self.attempt.measured({"steps_redone": max(0, self.reached - resumed)})
            self.mark(AttemptPhase.STEPS_REDONE, estimated(ph, AttemptPhase.REACHED_STEP))
            if self.points:  # (a record with a time: its first step is one of them)
                self.back((resumed + 1, at), self.points[-1])
        return Mark.FIRST_STEP

    def first_epoch(self, epoch: int) -> None:
        """The attempt trains from `epoch` on: after a restart, the epochs before it that no line told were
        saved by the attempt before, which ended before their lines (unknown where no attempt told its start)."""
        if not epoch:
            return
        if self.attempt.number > 0 and self.told_before is not None and self.told_before + 1 < epoch:
            self.attempt.measured({"epochs_unprinted": list(range(self.told_before + 1, epoch))})
        self.told = max(self.told or 0, epoch - 1)

    def back(self, before: tuple[float, float] | None, now: tuple[float, float]) -> Mark | None:
        """back_s, once the group is back at the step the attempt before had reached: from the failure to the
        time it got there (between the two reads around it, at the rate between them: an estimate, as is the
        time of an estimated step). None where the attempt before trained no step it told (it failed starting:
        its restart's cost is took_s)."""
        ph = self.attempt.phases
        if "back_s" in ph or not {"failed_at", "reached_step", "resumed_step"} <= set(ph) or now[0] < self.reached:
            return None
        (g0, t0), (g1, t1) = before or now, now
        at = t0 if g0 >= self.reached else t0 + (self.reached - g0) / (g1 - g0) * (t1 - t0)  # g0 < reached <= g1
        self.attempt.measured({"back_s": seconds(ph["failed_at"], at)})
        self.mark(AttemptPhase.BACK_S, g0 < self.reached < g1 or estimated(ph, AttemptPhase.REACHED_STEP))
        return Mark.BACK


def ended(failure_at: float | None, detected_at: float | None, decided_at: float, stopped_at: float) -> Figures:
    """What an attempt's end gives the next attempt: detected_s, teardown_s and failed_at (for took_s)."""
    carried: Figures = {"teardown_s": seconds(decided_at, stopped_at)}
    if failure_at is not None and detected_at is not None:
        carried.update({"failed_at": failure_at, "detected_s": seconds(failure_at, detected_at)})
    return carried


class Interval(NamedTuple):
    """One of a run's phases: its name and when it began and ended (unix times)."""

    name: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


# the run's phases, one after another from its record's creation to its end: the marks each lies between
RUN_PHASES: tuple[tuple[str, str, str], ...] = (
    ("preflight", "created", "preflight_end"), ("setup", "preflight_end", RunPhase.SPAWN_STARTED),
    ("spawn", RunPhase.SPAWN_STARTED, RunPhase.ALL_STARTED), ("to first step", RunPhase.ALL_STARTED, RunPhase.FIRST_STEP),
    ("training", RunPhase.FIRST_STEP, RunPhase.END), ("teardown", RunPhase.END, "ended"))


def run_intervals(created_at: float | None, marks: Mapping[str, float | None], ended_at: float | None,
                  until: float | None = None) -> list[Interval]:
    """The run's phases as intervals that follow each other, so that they sum to its wall time (created_at to
    ended_at) where every mark is known: the preflight's check, what followed it until the spawn (setup: the
    record, a backup copied for --resume), the spawn, the wait for the first step, the training (restarts
    within it), the teardown. `marks`: the record's phases (RunPhase: unix times; preflight_s: seconds); `until`:
    where training ends in a run that has not ended. A phase whose ends are not both known is left out."""
    preflight_s = marks.get(RunPhase.PREFLIGHT_S)
    at: dict[str, float | None] = {
        "created": created_at, "ended": ended_at,
        "preflight_end": created_at + preflight_s if created_at is not None and preflight_s is not None else None,
        **{str(k): marks.get(k) for k in (RunPhase.SPAWN_STARTED, RunPhase.ALL_STARTED, RunPhase.FIRST_STEP)},
        RunPhase.END: marks.get(RunPhase.END) or until}
    if at["preflight_end"] is None:
        at["preflight_end"] = at[RunPhase.SPAWN_STARTED]
    found = []
    for name, since, to in RUN_PHASES:
        a, b = at.get(since), at.get(to)
        if a is not None and b is not None and b >= a:
            found.append(Interval(name, a, b))
    return found


def run_line(run: RunRecord) -> str:
    """'phases: preflight 0.1 s, setup 0.0 s, spawn 1.2 s, to first step 3.4 s, training 50.2 s, teardown 0.3 s:
    55.2 s in all' (the run's wall time: the phases follow each other), then what restarts within it cost."""
    found = run_intervals(run.created_at, run.phases, run.ended_at,  # a run that failed trained until its end
                          until=run.attempts[-1].ended_at if run.attempts else None)
    parts = ", ".join(f"{p.name} {seconds_words(p.seconds)}" for p in found)
    whole = f": {seconds_words(run.ended_at - run.created_at)} in all" if found and run.ended_at else ""
    restarts = restarts_words(run)
    return "phases: " + (parts or "none recorded") + whole + (f"; within training, {restarts}" if restarts else "")


def seconds_words(value: float) -> str:
    """A duration as every view words it: one decimal (the JSON keeps milliseconds)."""
    return f"{value:.1f} s"


def told(attempt: Attempt) -> Figures:
    """The phases in seconds and steps, as `status --json` gives them (failed_at, a unix time, stays in the
    record), with `estimated`: the names of those that are estimates ([] where none is)."""
    shown = attempt.phases.copy()
    shown.pop("failed_at", None)
    shown["estimated"] = list(attempt.phases.get("estimated", []))
    return shown


def about(ph: Mapping[str, object], *names: str) -> str:
    """'about ' where any of the figures `names` is an estimate."""
    return "about " if any(estimated(ph, n) for n in names) else ""


def restart_line(number: int, ph: Mapping[str, object], epochs: bool = True) -> str:
    """Attempt `number`'s phases `ph` in one line: 'restart 1 took 3.1 s: detected 0.1 s, teardown 1.0 s, spawn
    0.3 s, to first step 1.5 s, about 12 step(s) redone; back at about step 40 after about 3.4 s' (the report
    tells them too), with the epochs saved but never told (unprinted_words) where `epochs`."""
    copied = ph.get(AttemptPhase.COPY_BYTES)
    parts = [f"{words} {seconds_words(value)}" + (f" ({copied / 1e6:.1f} MB)" if words == "backup copy" and
                                                  isinstance(copied, (int, float)) and copied else "")
             for words, value in restart_parts(ph)]
    if AttemptPhase.STEPS_REDONE in ph:
        parts.append(f"{about(ph, 'steps_redone')}{ph['steps_redone']:.0f} step(s) redone")
    took = f" took {ph['took_s']:.1f} s" if AttemptPhase.TOOK_S in ph else ""
    warm = f" ({ph['warm_tasks']:.0f} task(s) from standbys)" if ph.get(AttemptPhase.WARM_TASKS) else ""
    unprinted = unprinted_words(number, ph) if epochs else ""
    return (f"restart {number}{took}{warm}: " + ", ".join(parts) + (f"; {back_words(ph)}" if AttemptPhase.BACK_S in ph else "")
            + (f"; {unprinted}" if unprinted else ""))


def restart_parts(ph: Mapping[str, object]) -> list[tuple[str, float]]:
    """A restart's parts in order, (words, seconds), as far as measured; they follow each other from the failure
    to the first step, and what they leave of took_s (the agent deciding, a scheduler's queue) is named `other`."""
    found = [(words, float(v)) for key, words in PARTS if isinstance(v := ph.get(key), (int, float))]
    took_s = ph.get(AttemptPhase.TOOK_S)
    other = took_s - sum(v for _, v in found) if isinstance(took_s, (int, float)) and found else 0.0
    return found + ([("other", other)] if other >= 0.05 else [])


def unprinted_words(number: int, ph: Mapping[str, object]) -> str:
    """'epoch 6: saved, its line was not printed (attempt 0 ended before it)'; '' where there is none."""
    epochs = ph.get(UNPRINTED) or []
    if not epochs or not isinstance(epochs, list):
        return ""
    if len(epochs) == 1:
        return f"epoch {epochs[0]}: saved, its line was not printed (attempt {number - 1} ended before it)"
    return (f"epochs {', '.join(map(str, epochs))}: saved, their lines were not printed (attempt {number - 1} "
            "ended before them)")


def copy_line(copy: BackupCopy, to: list[str], source: str, attempt: int) -> str:
    """'copied the run's backup (global step 24) from task 0 (h1:20000) to task 1 (h2:20000): 1.2 MB in 0.4 s,
    checked by size and SHA-256'; from a spare copy, the chief's host is gone, and the step the group goes back to
    is said; before a first attempt, it is the backup of the run it goes on from."""
    whose = "the resumed run's backup" if attempt == 0 else "the run's backup"
    what = ("its finished training" if copy.finished else f"{whose} (global step {copy.steps_done})")
    where = f"the spare copy kept by {source}" if copy.spare else source
    line = (f"copied {what} from {where} to {', '.join(to)}: {copy.bytes / 1e6:.1f} MB in {copy.seconds:.1f} s, "
            "checked by size and SHA-256")
    if copy.spare:
        line += (f"; the group goes on from global step {copy.steps_done}, the newest whole copy of the backup that a "
                 "live host holds")
    return line


def back_words(ph: Mapping[str, object]) -> str:
    """'back at step 40 after 3.4 s': when the restarted group had trained again to where the failed one got."""
    at = f" at {about(ph, 'reached_step')}step {ph['reached_step']:.0f}" if AttemptPhase.REACHED_STEP in ph else ""
    return f"back{at} after {about(ph, 'back_s')}{ph['back_s']:.1f} s"


def back_line(number: int, ph: Mapping[str, object]) -> str:
    """Said when a restarted group is back where the failed attempt got to, after its first step's line."""
    return (f"restart {number}: {back_words(ph)} (from the failure until the group had trained again to the "
            "step it had reached: what the crash cost the run)")


def restarts_words(run: RunRecord) -> str:
    """What restarts cost in all, for the run's summary: '1 restart(s) cost the run 3.6 s in all (back at the steps
    reached after 3.6 s from their failures: 3.1 s until their first step (...), then 2 step(s) redone)'; where
    not every one got back, '1 restart(s) cost 3.1 s in all until their first step ...'; '' without."""
    later = [a for a in run.attempts if a.number > 0 and AttemptPhase.TOOK_S in a.phases]
    if not later:
        return ""
    total = sum(a.phases["took_s"] for a in later)
    summed: dict[str, float] = {}
    for a in later:
        for words, value in restart_parts(a.phases):
            summed[words] = summed.get(words, 0.0) + value
    order = [words for _, words in PARTS] + ["other"]
    parts = [f"{words} {seconds_words(summed[words])}" for words in order if words in summed]
    redone = sum(a.phases.get("steps_redone", 0) for a in later)
    redone_about = "about " if any(estimated(a.phases, AttemptPhase.STEPS_REDONE) for a in later) else ""
    back = [a.phases["back_s"] for a in later if "back_s" in a.phases]
    back_about = "about " if any(estimated(a.phases, AttemptPhase.BACK_S) for a in later) else ""
    until = f"until their first step ({', '.join(parts)})"
    redone_words = f"{redone_about}{redone:.0f} step(s) redone"
    if back and len(back) == len(later):  # what they cost the run: from each failure until it was back where it was
        cost = f"{back_about}{sum(back):.1f} s"
        return (f"{len(later)} restart(s) cost the run {cost} in all (back at the steps reached after {cost} from "
                f"their failures: {total:.1f} s {until}, then {redone_words})")
    words = f"; {len(back)} of them back at the step reached, after {back_about}{sum(back):.1f} s in all" if back else ""
    return f"{len(later)} restart(s) cost {total:.1f} s in all {until}, {redone_words}{words}"
