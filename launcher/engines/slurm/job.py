"""Slurm's records read (pure): a job's state, its time format, and what a job's record says about an
attempt (`verdict_of`: the scheduler's own end of it, or None)."""

from __future__ import annotations

from launcher.engines.base import SchedulerCause, SchedulerEnd

QUEUED = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SPECIAL_EXIT"}
RUNNING = {"CONFIGURING", "RUNNING", "SUSPENDED", "SIGNALING", "RESIZING", "STOPPED"}
TIME_NOTICE = "SIGUSR1"  # what our --signal sends the tasks before the time limit
Scontrol = dict[str, str]  # a record of `scontrol -o show ...`: {Key: Value}, as Slurm wrote it


def record_of(text: str) -> Scontrol:
    """The first record of `scontrol -o show ...` as {Key: Value}."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return dict(w.partition("=")[::2] for w in line.split() if "=" in w)


def parse_time(text: str | None) -> float | None:
    """Seconds of a Slurm time limit; None: no limit (or none given)."""
    if not text or text.upper() in ("UNLIMITED", "INFINITE", "NONE"):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:  # days-hours[:minutes[:seconds]]
        parts += [0] * (3 - len(parts))
        h, m, s = parts
    elif len(parts) == 3:
        h, m, s = parts
    elif len(parts) == 2:  # minutes:seconds
        h, m, s = 0, parts[0], parts[1]
    else:  # minutes
        h, m, s = 0, parts[0], 0
    return (int(days or 0) * 24 + h) * 3600 + m * 60 + s


def gpus(gres: str) -> int:
    """GPUs in a node's Gres (e.g. "gpu:a100:4(S:0-1),shard:8")."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def state_of(info: Scontrol | None) -> str:
    """A job's state word ("RUNNING", "COMPLETING" of "COMPLETING,..." flags dropped), "" when unknown."""
    return ((info or {}).get("JobState") or "").split(",")[0]


def ended(info: Scontrol | None) -> bool:
    state = state_of(info)
    return bool(state) and state not in QUEUED and state not in RUNNING


def gone(info: Scontrol | None) -> bool:
    """Ended for good: its processes gone (COMPLETING is still ending them)."""
    return ended(info) and state_of(info) != "COMPLETING"


def settled(info: Scontrol | None, restarts_before: int) -> bool:
    """Whether the record tells for good how an attempt's job ended: it is gone, back in the queue or
    requeued (Restarts went up, maybe running again already), or nothing (purged: no more to learn)."""
    return info is None or state_of(info) in QUEUED or gone(info) or restarts(info) > restarts_before


def restarts(info: Scontrol | None) -> int:
    """How often Slurm requeued the job (its record's Restarts)."""
    text = ((info or {}).get("Restarts") or "0").strip()
    return int(text) if text.isdigit() else 0


def ending(info: Scontrol | None, restarts_before: int, notices: set[str]) -> bool:
    """Whether anything says the scheduler is ending (or took back) the job, so a verdict is worth waiting
    for: it left RUNNING, was requeued, the tasks had notice, or it ran past its time limit. A job still
    running with none of these was ended by its tasks (a failure, a hang): the scheduler has nothing to say."""
    if info is None:
        return False
    if notices or state_of(info) not in RUNNING or restarts(info) > restarts_before:
        return True
    try:
        limit, ran = parse_time(info.get("TimeLimit")), parse_time(info.get("RunTime"))
    except ValueError:
        return False
    return limit is not None and ran is not None and ran >= limit


def verdict_of(info: Scontrol | None, restarts_before: int, notices: set[str], job_id: str | None,
               time_limit: str | None, we_stopped: bool = False) -> SchedulerEnd | None:
    """How Slurm ended (or took back) an attempt whose tasks ended, from its job record, the notices the
    tasks were given and whether we stopped it; None when Slurm did not end it (the tasks did, or we)."""
    if we_stopped:
        return None
    state, reason = state_of(info), (info or {}).get("Reason") or "None"
    said = f"(state {state}, reason {reason})" if reason != "None" else f"(state {state})"
    if info and restarts(info) > restarts_before or state in QUEUED:
        return SchedulerEnd(SchedulerCause.REQUEUED, f"Slurm requeued job {job_id} {said}: a node failed, or "
                                                     "someone ran 'scontrol requeue'; it runs again by itself")
    if state == "TIMEOUT" or TIME_NOTICE in notices:
        return SchedulerEnd(SchedulerCause.TIME_LIMIT, f"Slurm job {job_id} reached its time limit ([slurm] time = "
                                                       f"{time_limit!r}) {said}; the tasks had notice to save: "
                                                       "raise [slurm].time and run again to resume from the checkpoint")
    if state == "CANCELLED":
        return SchedulerEnd(SchedulerCause.CANCELLED, f"Slurm job {job_id} was cancelled from outside (scancel, by "
                                                      f"someone other than this launcher) {said}")
    if state == "NODE_FAIL":
        return SchedulerEnd(SchedulerCause.NODE_FAIL, f"a node of Slurm job {job_id} failed and the job was not "
                                                      f"requeued {said}")
    if state in ("PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"):
        return SchedulerEnd(SchedulerCause.ENDED, f"Slurm ended job {job_id} {said}")
    return None
