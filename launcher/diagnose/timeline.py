"""What the run record (state.json) says happened when: the phases, the attempts and their failures, the
restarts, preemptions and lost hosts between them; as seconds since the run began (values.Clock)."""

from __future__ import annotations

import signal
from typing import Any, TypedDict

from launcher.diagnose.values import Clock, integer, items, text
from launcher.run.failure import FailureKind
from launcher.run.phases import ESTIMATED, UNPRINTED, restart_line, run_intervals, unprinted_words
from launcher.run.progress import real, whole
from launcher.run.states import AttemptOutcome, AttemptPhase, RunPhase, RunState

OUTCOMES = {str(o) for o in AttemptOutcome}
KINDS = {str(k) for k in FailureKind}
ENDED = {str(s) for s in RunState if s.ended}
SWITCHES = {"preempted": ("preemption", "preemption"), "shrunk": ("lost", "host lost"),  # the outcome before
            "regrouped": ("back", "host taken back")}
WORDS = {"lost": "was lost (its host or supervisor went away or fell silent)",
         "hung": "hung (no progress for longer than heartbeat_timeout)", "not_started": "did not start",
         "port_taken": "found its port taken", "scheduler": "was ended by the scheduler",
         "refused": "was refused by the preflight", "stopped": "was stopped"}


class Phase(TypedDict):
    name: str
    start: float
    end: float


class FailureData(TypedDict):
    kind: str | None
    task: int | None
    host: str | None
    exit_code: int | None
    signal: str | None
    message: str | None
    log: str | None


class AttemptData(TypedDict):
    index: int
    start: float
    end: float | None
    outcome: str | None
    reason: str | None
    failure: FailureData | None
    unprinted: list[int]


class RestartPart(TypedDict):
    name: str
    start: float
    end: float
    estimated: bool


class Restart(TypedDict):
    attempt: int
    phases: dict[str, float | list[str] | list[int]]
    line: str
    parts: list[RestartPart]


class Event(TypedDict):
    t: float
    kind: str
    label: str


def refused(run: dict[str, Any]) -> bool:  # Any (here and below): state.json as parsed, checked field by field
    """It ended in its preflight: no task was ever started (launcher.commands.listing.ended_in_preflight)."""
    ended = run.get("state") in ENDED or real(run.get("ended_at")) is not None
    phases = run.get("phases")
    return ended and not (isinstance(phases, dict) and RunPhase.PREFLIGHT_S in phases)


def open_end(run: dict[str, Any], newest: float | None, now: float | None) -> float | None:
    """Where a run that has not ended (still going, or hung) is drawn up to: its newest progress time, else
    `now`, never before the newest time its record holds, never after `now`. None for a run that has ended."""
    if real(run.get("ended_at")) is not None:
        return None
    ph = _phases(run)
    times = [run.get("created_at"), *(ph.get(k) for k in (RunPhase.SPAWN_STARTED, RunPhase.ALL_STARTED, RunPhase.FIRST_STEP)),
             *(a.get("started_at") for a in items(run.get("attempts"))),
             *(t.get("heartbeat") for t in items(run.get("tasks"))), newest if newest is not None else now]
    known = [x for x in map(real, times) if x is not None and (now is None or x <= now)]
    return max(known) if known else None


def phases(run: dict[str, Any], clock: Clock, until: float | None = None) -> list[Phase]:
    """The run's phases as `up` tells them (launcher.run.phases.run_intervals: they follow each other), as far as
    recorded; `until`: where training ends in a run that has not ended (open_end(), absolute)."""
    ph = _phases(run)
    attempts = items(run.get("attempts"))
    marks = {str(k): real(ph.get(k)) for k in RunPhase}
    found = run_intervals(real(run.get("created_at")), marks, real(run.get("ended_at")),
                          until=(real(attempts[-1].get("ended_at")) if attempts else None) or until)
    shown = [(p.name, clock(p.start), clock(p.end)) for p in found]
    return [{"name": name, "start": start, "end": end} for name, start, end in shown
            if start is not None and end is not None and end >= start]


def failure(data: Any) -> FailureData | None:
    """A failure as recorded (launcher.run.failure.Failure.to_json), its fields checked; a record written
    before failures were data holds only words."""
    if isinstance(data, str):
        data = {"message": data}
    if not isinstance(data, dict):
        return None
    kind = data.get("kind") if data.get("kind") in KINDS else None
    host, sig = text(data.get("host")), text(data.get("signal"))
    return {"kind": kind, "task": whole(data.get("task")), "host": host[:200] if host else None,
            "exit_code": integer(data.get("exit_code")), "signal": sig[:40] if sig else None,
            "message": text(data.get("message")), "log": text(data.get("log"))}


def describe(f: FailureData) -> str:
    """`task 1 on node2 was killed by SIGKILL (exit code -9)`: who, and how it ended, in one line."""
    who = f"task {f['task']}" if f["task"] is not None else "the run"
    who += f" on {f['host']}" if f["host"] else ""
    code = f["exit_code"]
    if f["signal"]:
        return f"{who} was killed by {f['signal']}" + (f" (exit code {code})" if code is not None else "")
    if code is not None:
        return f"{who} exited with code {code}" + _shell_signal(code)
    return f"{who} {WORDS.get(f['kind'] or '', 'failed')}"


def _shell_signal(code: int) -> str:
    """A shell reports a child killed by signal N as 128+N."""
    try:
        return f" ({signal.Signals(code - 128).name}: 128 + its number)" if code > 128 else ""
    except ValueError:
        return ""


def attempts(run: dict[str, Any], clock: Clock) -> list[AttemptData]:
    """Each attempt on the time axis, with its outcome, reason, failure, and the epochs saved before it whose
    lines never came (`unprinted`, launcher.run.phases)."""
    found: list[AttemptData] = []
    for a in items(run.get("attempts")):
        start, end = clock(a.get("started_at")), clock(a.get("ended_at"))
        if start is None:
            continue
        index = whole(a.get("number"))
        found.append({"index": index if index is not None else len(found), "start": start,
                      "end": end if end is not None and end >= start else None,
                      "outcome": a.get("outcome") if a.get("outcome") in OUTCOMES else None,
                      "reason": text(a.get("reason")), "failure": failure(a.get("failure")),
                      "unprinted": _numbers(_phases(a).get(UNPRINTED))})
    return found


def _phases(record: dict[str, Any]) -> dict[str, Any]:
    """The phases of a run or of an attempt."""
    found = record.get("phases")
    return found if isinstance(found, dict) else {}


def _numbers(value: Any) -> list[int]:
    return [n for n in value if whole(n) is not None][:100] if isinstance(value, list) else []


def restarts(run: dict[str, Any], clock: Clock) -> list[Restart]:
    """Each restarted attempt's phases (launcher.run.phases), as recorded: its parts placed on the time axis
    (detected from the failing task's end, teardown up to the attempt before's end, the backup copy, spawn and
    first step from its own start, the steps redone from its first step until it was back at the step reached: `estimated`
    where back_s is), and its line of words (the epochs saved but never told are the restart's event)."""
    found: list[Restart] = []
    before: dict[str, Any] | None = None
    for a in items(run.get("attempts")):
        raw = _phases(a)
        ph = {k: x for k, v in raw.items() if isinstance(k, str) and (x := real(v)) is not None and x >= 0}
        guessed = [n for n in raw.get(ESTIMATED) or [] if isinstance(n, str) and n in ph] \
            if isinstance(raw.get(ESTIMATED), list) else []
        number, start = whole(a.get("number")), real(a.get("started_at"))
        prev_end = real(before.get("ended_at")) if before else None
        before = a
        if not number or start is None or not ph:
            continue
        copied = start + ph.get(AttemptPhase.COPY_S, 0.0)  # the backup brought to every host before the spawn (SSH hosts)
        spawned = copied + ph.get(AttemptPhase.SPAWN_S, 0.0)
        marks = [("detected", ph.get(AttemptPhase.FAILED_AT), ph.get(AttemptPhase.DETECTED_S)),
                 ("teardown", prev_end - ph[AttemptPhase.TEARDOWN_S] if prev_end and AttemptPhase.TEARDOWN_S in ph else None,
                  ph.get(AttemptPhase.TEARDOWN_S)),
                 ("backup copy", start, ph.get(AttemptPhase.COPY_S)), ("spawn", copied, ph.get(AttemptPhase.SPAWN_S)),
                 ("first step", spawned, ph.get(AttemptPhase.FIRST_STEP_S))]
        if AttemptPhase.BACK_S in ph and AttemptPhase.FAILED_AT in ph and AttemptPhase.FIRST_STEP_S in ph:  # its first step until back where it was
            stepped = spawned + ph[AttemptPhase.FIRST_STEP_S]
            marks.append(("steps redone", stepped, ph[AttemptPhase.FAILED_AT] + ph[AttemptPhase.BACK_S] - stepped))
        placed = [(name, clock(at), clock(at + took))
                  for name, at, took in marks if at is not None and took is not None]
        parts: list[RestartPart] = [{"name": name, "start": start, "end": end,
                                     "estimated": name == "steps redone" and AttemptPhase.BACK_S in guessed}
                                    for name, start, end in placed if start is not None and end is not None]
        unprinted = _numbers(raw.get(UNPRINTED))
        told: dict[str, float | list[str] | list[int]] = {
            **{k: v for k, v in ph.items() if k != AttemptPhase.FAILED_AT},
            **({UNPRINTED: unprinted} if unprinted else {}), ESTIMATED: guessed}
        found.append({"attempt": number, "phases": told, "line": restart_line(number, told, epochs=False),
                      "parts": parts})
    return found


def events(run: dict[str, Any], clock: Clock, tried: list[AttemptData]) -> list[Event]:
    """Restarts, preemptions and lost hosts where the next attempt began; each failure where its attempt
    ended (the run's own failure where the run ended, when no attempt holds it)."""
    found: list[Event] = []
    for prev, nxt in zip(tried, tried[1:]):
        kind, words = SWITCHES.get(prev["outcome"] or "", ("restart", "restart"))
        unprinted = unprinted_words(nxt["index"], {UNPRINTED: nxt["unprinted"]})
        found.append({"t": nxt["start"], "kind": kind,
                      "label": f"{words}: attempt {nxt['index']}" + (f"; {unprinted}" if unprinted else "")})
    for a in tried:
        if a["end"] is not None and a["failure"]:
            found.append({"t": a["end"], "kind": "failure", "label": describe(a["failure"])})
    own, end = failure(run.get("failure")), clock(run.get("ended_at"))
    told = {a["failure"]["message"] if a["failure"] else None for a in tried}
    if own and end is not None and own["message"] not in told:
        found.append({"t": end, "kind": "failure", "label": describe(own)})
    return sorted(found, key=lambda e: e["t"])
