"""A straggler: the task whose own work per step (compute_ms: input, forward, backward) is at least
RATIO times the median of the others'; in synchronous training every other task waits for it."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TypedDict

from launcher.run.progress import Progress
from launcher.run.record import TaskRecord

RATIO = 1.25


class StragglerJson(TypedDict):
    task: int
    ratio: float


@dataclass(frozen=True)
class Straggler:
    task: int
    ratio: float  # its compute_ms over the median of the others'

    def to_json(self) -> StragglerJson:
        return {"task": self.task, "ratio": round(self.ratio, 2)}

    def words(self) -> str:
        return (f"task {self.task} is a straggler: its own work per step takes {self.ratio:.2f}x the median of the "
                "others', and every other task waits for it at each all-reduce. Check that host for other processes "
                "on its cores or GPU (top, nvidia-smi), a throttled GPU (clocks, temperature), a slower input "
                "pipeline or disk, and its cpus/gpus in the spec.")


def _ms(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def find(compute_ms: dict[int, float | None], ratio: float = RATIO) -> Straggler | None:
    """The straggler among tasks' latest compute_ms ({task: ms}; None or missing values are left out),
    or None: fewer than two tasks with figures, or none at `ratio` x the median of the others."""
    known = {i: ms for i, v in compute_ms.items() if (ms := _ms(v)) is not None}
    if len(known) < 2:
        return None
    slowest = max(known, key=lambda i: known[i])
    others = statistics.median(v for i, v in known.items() if i != slowest)
    found = known[slowest] / others
    return Straggler(slowest, found) if found >= ratio else None


def of_progress(progress: dict[int, Progress | None]) -> Straggler | None:
    """find() over the tasks' progress records (progress.json: compute_ms)."""
    return find({i: (p or {}).get("compute_ms") for i, p in progress.items()})


def summary_line(tasks: list[TaskRecord]) -> str | None:
    """One line for the end of `up` from the run record's tasks (their last progress), or None."""
    found = of_progress({t.index: t.progress for t in tasks})
    return found.words() if found else None
