"""Each attempt's phases (Attempt.phases, in seconds): for a restart, how long its failure took to reach the
agent, the teardown, the spawn, the wait for the first step, the steps trained again since the last
checkpoint, and when the group was back at the step it had reached (what the crash cost the run); for the
first attempt, its spawn and first step (the cold start). Told in one line each."""

from __future__ import annotations

import enum
import math
import time

from launcher.run.record import Attempt, RunRecord
from worker import protocol

# the parts of a restart, in order, and their words
PARTS = (("detected_s", "detected"), ("teardown_s", "teardown"), ("spawn_s", "spawn"),
         ("first_step_s", "to first step"))


def seconds(since: float, until: float) -> float:
    return round(max(0.0, until - since), 3)


def step(progress: dict | None, key: str = "global_step") -> int:
    return (progress or {}).get(key) or 0


def failed_at(run: RunRecord, index: int | None, ev: protocol.Event | None, now: float) -> float:
    """When the failing task ended as it reported it: its Exit's time (its host's clock, kept within the
    last minute: a skewed clock must not make up a phase); a hung task, when it last progressed; else now."""
    if isinstance(ev, protocol.Exit) and 0 <= now - ev.time <= 60:
        return ev.time
    if ev is None and index is not None and run.task(index).heartbeat:
        return min(now, run.task(index).heartbeat)
    return now


class Mark(enum.Enum):
    """What a progress record marked in a restarted attempt (each once)."""
    FIRST_STEP = "first step"
    BACK = "back at the step reached"


# a step count read from a progress record may be up to a write interval (1 s) behind the failure: it is carried
# forward at the group's rate, over at most this long (a task that stopped stepping long before it failed: a hang)
EXTRAPOLATE_MAX_S = 3.0


def reached(run: RunRecord) -> int:
    """The furthest global step any task reported in the attempt that just ended (before a new one begins)."""
    return max((step(t.progress) for t in run.tasks), default=0)


class Phases:
    """The marks of one attempt, on the wall clock (the record keeps what they add up to)."""

    def __init__(self, attempt: Attempt, carried: dict[str, float], reached_step: int):
        """`reached_step`: where the attempt before got to (reached(), before the tasks' progress is reset; its
        own marks carry it forward to its failure)."""
        self.attempt, self.reached = attempt, max(reached_step, int(carried.get("reached_step", 0)))
        attempt.phases.update(carried)  # detected_s, teardown_s, failed_at and reached_step of the attempt before
        if "reached_step" in carried:
            attempt.phases["reached_step"] = self.reached
        self.spawn_at: float | None = None
        self.started_at: float | None = None
        self.detected: tuple[float, float] | None = None  # (when the failing task ended, when the agent knew)
        self.decided_at: float | None = None  # when the agent decided to stop the attempt
        self.points: list[tuple[float, float]] = []  # the group's last two (global step, the task's time) of this attempt
        self.total = 0  # the training's steps in all, where its progress says

    def failed(self, run: RunRecord, index: int | None, ev: protocol.Event | None) -> None:
        """A task's end failed the attempt (or gave notice; `ev` None: a hang or a silence): the first one counts."""
        if self.detected is None:
            now = time.time()
            self.detected = (failed_at(run, index, ev, now), now)

    def ended(self, stopped_at: float) -> dict[str, float]:
        """What the attempt's end gives the next attempt's phases (nothing where no stop was decided: it succeeded)."""
        if self.decided_at is None:
            return {}
        failure_at, detected_at = self.detected or (None, None)
        carried = ended(failure_at, detected_at, self.decided_at, stopped_at)
        if failure_at is not None and self.points:
            carried["reached_step"] = self.step_at(failure_at)
        return carried

    def step_at(self, when: float) -> int:
        """The group's global step at `when` (its failure), where a step was read: the last one read, carried
        forward at the rate between the last two reads (a step counts once done)."""
        (g0, t0), (g1, t1) = self.points[0], self.points[-1]
        rate = (g1 - g0) / (t1 - t0) if t1 > t0 else 0.0
        return int(min(g1 + rate * min(max(0.0, when - t1), EXTRAPOLATE_MAX_S), self.total or math.inf))

    def seen(self, progress: dict, now: float) -> bool:
        """Keep this record's (global step, time) as the group's latest, where it is one step count later
        (the tasks step together); its time is the task's, kept within what came before and now. `progress`
        is typed (launcher.run.progress): a time there is a finite number."""
        g, t = step(progress), progress.get("time")
        if step(progress, "steps_per_epoch") and step(progress, "epochs"):
            self.total = step(progress, "steps_per_epoch") * step(progress, "epochs")
        if t is None:
            return False
        t = min(max(t, self.points[-1][1] if self.points else t), now)
        first = progress.get("first_step_at")  # the attempt's first step: a rate from the first record on
        if not self.points and first is not None and first < t:
            self.points = [(step(progress, "first_global_step") + 1, first)]
        if self.points and g <= self.points[-1][0]:
            return False
        self.points = [*self.points, (g, t)][-2:]
        return True

    def spawning(self) -> None:
        self.spawn_at = time.time()

    def all_started(self, now: float, warm: int) -> None:
        """Every task started, `warm` of them from their standbys."""
        if self.spawn_at is not None and self.started_at is None:
            self.started_at = now
            self.attempt.phases["spawn_s"] = seconds(self.spawn_at, now)
            self.attempt.phases["warm_tasks"] = warm

    def progress(self, progress: dict, now: float) -> Mark | None:
        """A progress record: the mark it is, if any. Its first trained step records first_step_s and, after
        a restart, took_s and steps_redone; the step the attempt before had reached, back_s."""
        ph = self.attempt.phases
        before = self.points[-1] if self.points else None
        moved = self.seen(progress, now)
        if step(progress) <= step(progress, "first_global_step"):
            return None
        if "first_step_s" in ph:
            return self.back(before, self.points[-1]) if moved else None
        at = progress.get("first_step_at")  # the task's own time of its first step (the record is read later)
        start = self.started_at or self.spawn_at or now
        at = min(max(at, start), now) if isinstance(at, (int, float)) else now
        ph["first_step_s"] = seconds(start, at)
        if "failed_at" in ph:
            ph["took_s"] = seconds(ph["failed_at"], at)
        if self.attempt.number > 0 and "first_global_step" in progress:  # a script of its own may not say
            ph["resumed_step"] = step(progress, "first_global_step")
            if "reached_step" in ph and ph["resumed_step"] > self.reached:  # it got at least as far as it saved
                self.reached = ph["reached_step"] = ph["resumed_step"]
            ph["steps_redone"] = max(0, self.reached - ph["resumed_step"])
            if self.points:  # (a record with a time: its first step is one of them)
                self.back((ph["resumed_step"] + 1, at), self.points[-1])
        return Mark.FIRST_STEP

    def back(self, before: tuple[float, float] | None, now: tuple[float, float]) -> Mark | None:
        """back_s, once the group is back at the step the attempt before had reached: from the failure to the
        time it got there (between the two reads around it, at the rate between them). None where the attempt
        before trained no step it told (it failed starting: its restart's cost is took_s)."""
        ph = self.attempt.phases
        if "back_s" in ph or not {"failed_at", "reached_step", "resumed_step"} <= set(ph) or now[0] < self.reached:
            return None
        (g0, t0), (g1, t1) = before or now, now
        at = t0 if g0 >= self.reached else t0 + (self.reached - g0) / (g1 - g0) * (t1 - t0)  # g0 < reached <= g1
        ph["back_s"] = seconds(ph["failed_at"], at)
        return Mark.BACK


def ended(failure_at: float | None, detected_at: float | None, decided_at: float, stopped_at: float) -> dict:
    """What an attempt's end gives the next attempt: detected_s, teardown_s and failed_at (for took_s)."""
    carried: dict[str, float] = {"teardown_s": seconds(decided_at, stopped_at)}
    if failure_at is not None and detected_at is not None:
        carried.update(failed_at=failure_at, detected_s=seconds(failure_at, detected_at))
    return carried


def told(attempt: Attempt) -> dict[str, float]:
    """The phases in seconds and steps, as `status --json` gives them (failed_at, a unix time, stays in the record)."""
    return {k: v for k, v in attempt.phases.items() if k != "failed_at"}


def restart_line(number: int, ph: dict) -> str:
    """Attempt `number`'s phases `ph` in one line: 'restart 1 took 3.1 s: detected 0.1 s, teardown 1.0 s, spawn
    0.3 s, to first step 1.5 s, 12 step(s) redone; back at step 40 after 3.4 s' (the report tells them too)."""
    parts = [f"{words} {ph[key]:.1f} s" for key, words in PARTS if key in ph]
    if "steps_redone" in ph:
        parts.append(f"{ph['steps_redone']:.0f} step(s) redone")
    took = f" took {ph['took_s']:.1f} s" if "took_s" in ph else ""
    warm = f" ({ph['warm_tasks']:.0f} task(s) from standbys)" if ph.get("warm_tasks") else ""
    return f"restart {number}{took}{warm}: " + ", ".join(parts) + (f"; {back_words(ph)}" if "back_s" in ph else "")


def back_words(ph: dict) -> str:
    """'back at step 40 after 3.4 s': when the restarted group had trained again to where the failed one got."""
    at = f" at step {ph['reached_step']:.0f}" if "reached_step" in ph else ""
    return f"back{at} after {ph['back_s']:.1f} s"


def back_line(number: int, ph: dict) -> str:
    """Said when a restarted group is back where the failed attempt got to, after its first step's line."""
    return (f"restart {number}: {back_words(ph)} (from the failure until the group had trained again to the "
            "step it had reached: what the crash cost the run)")


def restarts_words(run: RunRecord) -> str:
    """What restarts cost in all, for the run's summary: '1 restart(s) cost 3.1 s in all until ...'; '' without."""
    later = [a for a in run.attempts if a.number > 0 and "took_s" in a.phases]
    if not later:
        return ""
    total = sum(a.phases["took_s"] for a in later)
    parts = [f"{words} {sum(a.phases.get(key, 0.0) for a in later):.1f} s" for key, words in PARTS]
    redone = sum(a.phases.get("steps_redone", 0) for a in later)
    back = [a.phases["back_s"] for a in later if "back_s" in a.phases]
    words = (f"; back at the steps reached after {sum(back):.1f} s in all" if len(back) == len(later) else
             f"; {len(back)} of them back at the step reached, after {sum(back):.1f} s in all" if back else "")
    return (f"{len(later)} restart(s) cost {total:.1f} s in all until their first step ({', '.join(parts)}), "
            f"{redone:.0f} step(s) redone{words}")
