"""Each attempt's phases (Attempt.phases, in seconds): for a restart, how long its failure took to reach the
agent, the teardown, the spawn, the wait for the first step, and the steps trained again since the last
checkpoint; for the first attempt, its spawn and first step (the cold start). Told in one line each."""

from __future__ import annotations

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


def reached(run: RunRecord) -> int:
    """The furthest global step any task reported in the attempt that just ended (before a new one begins)."""
    return max((step(t.progress) for t in run.tasks), default=0)


class Phases:
    """The marks of one attempt, on the wall clock (the record keeps what they add up to)."""

    def __init__(self, attempt: Attempt, carried: dict[str, float], reached_step: int):
        """`reached_step`: where the attempt before got to (reached(), before the tasks' progress is reset)."""
        self.attempt, self.reached = attempt, reached_step
        attempt.phases.update(carried)  # detected_s, teardown_s and failed_at of the attempt before
        self.spawn_at: float | None = None
        self.started_at: float | None = None
        self.detected: tuple[float, float] | None = None  # (when the failing task ended, when the agent knew)
        self.decided_at: float | None = None  # when the agent decided to stop the attempt

    def failed(self, run: RunRecord, index: int | None, ev: protocol.Event | None) -> None:
        """A task's end failed the attempt (or gave notice; `ev` None: a hang or a silence): the first one counts."""
        if self.detected is None:
            now = time.time()
            self.detected = (failed_at(run, index, ev, now), now)

    def ended(self, stopped_at: float) -> dict[str, float]:
        """What the attempt's end gives the next attempt's phases (nothing where no stop was decided: it succeeded)."""
        if self.decided_at is None:
            return {}
        return ended(*(self.detected or (None, None)), self.decided_at, stopped_at)

    def spawning(self) -> None:
        self.spawn_at = time.time()

    def all_started(self, now: float, warm: int) -> None:
        """Every task started, `warm` of them from their standbys."""
        if self.spawn_at is not None and self.started_at is None:
            self.started_at = now
            self.attempt.phases["spawn_s"] = seconds(self.spawn_at, now)
            self.attempt.phases["warm_tasks"] = warm

    def progress(self, progress: dict, now: float) -> bool:
        """A progress record: True when it is the attempt's first trained step (first_step_s and, after a
        restart, took_s and steps_redone are recorded then)."""
        ph = self.attempt.phases
        if "first_step_s" in ph or step(progress) <= step(progress, "first_global_step"):
            return False
        at = progress.get("first_step_at")  # the task's own time of its first step (the record is read later)
        start = self.started_at or self.spawn_at or now
        at = min(max(at, start), now) if isinstance(at, (int, float)) else now
        ph["first_step_s"] = seconds(start, at)
        if "failed_at" in ph:
            ph["took_s"] = seconds(ph["failed_at"], at)
        if self.attempt.number > 0 and "first_global_step" in progress:  # a script of its own may not say
            ph["resumed_step"] = step(progress, "first_global_step")
            ph["steps_redone"] = max(0, self.reached - ph["resumed_step"])
        return True


def ended(failure_at: float | None, detected_at: float | None, decided_at: float, stopped_at: float) -> dict:
    """What an attempt's end gives the next attempt: detected_s, teardown_s and failed_at (for took_s)."""
    carried = {"teardown_s": seconds(decided_at, stopped_at)}
    if failure_at is not None and detected_at is not None:
        carried.update(failed_at=failure_at, detected_s=seconds(failure_at, detected_at))
    return carried


def told(attempt: Attempt) -> dict[str, float]:
    """The phases in seconds and steps, as `status --json` gives them (failed_at, a unix time, stays in the record)."""
    return {k: v for k, v in attempt.phases.items() if k != "failed_at"}


def restart_line(number: int, ph: dict) -> str:
    """Attempt `number`'s phases `ph` in one line: 'restart 1 took 3.1 s: detected 0.1 s, teardown 1.0 s, spawn
    0.3 s, to first step 1.5 s, 12 step(s) redone' (the report tells them too)."""
    parts = [f"{words} {ph[key]:.1f} s" for key, words in PARTS if key in ph]
    if "steps_redone" in ph:
        parts.append(f"{ph['steps_redone']:.0f} step(s) redone")
    took = f" took {ph['took_s']:.1f} s" if "took_s" in ph else ""
    warm = f" ({ph['warm_tasks']:.0f} task(s) from standbys)" if ph.get("warm_tasks") else ""
    return f"restart {number}{took}{warm}: " + ", ".join(parts)


def restarts_words(run: RunRecord) -> str:
    """What restarts cost in all, for the run's summary: '1 restart(s) cost 3.1 s in all until ...'; '' without."""
    later = [a for a in run.attempts if a.number > 0 and "took_s" in a.phases]
    if not later:
        return ""
    total = sum(a.phases["took_s"] for a in later)
    parts = [f"{words} {sum(a.phases.get(key, 0.0) for a in later):.1f} s" for key, words in PARTS]
    redone = sum(a.phases.get("steps_redone", 0) for a in later)
    return (f"{len(later)} restart(s) cost {total:.1f} s in all until their first step ({', '.join(parts)}), "
            f"{redone:.0f} step(s) redone")
