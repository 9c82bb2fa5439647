"""Shared timing helpers: repeated measurements as median [min-max], alternated pairs against a
baseline taken in the same run, paired ratios, CPU counters."""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")


@dataclass
class Stat:
    """Repeated measurements of one quantity; shown as median [min-max]."""

    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def fmt(self, unit: str = "", digits: int = 3) -> str:
        def f(v: float) -> str:
            return f"{v:.{digits}g}" if abs(v) < 10 ** digits else f"{v:.0f}"
        if not self.values:
            return "-"
        text = f(self.median) + (f" {unit}" if unit else "")
        if len(self.values) > 1:
            text += f" [{f(min(self.values))}-{f(max(self.values))}]"
        return text

    def as_dict(self) -> dict:
        return {"median": self.median, "min": min(self.values), "max": max(self.values), "values": self.values}


def paired_ratio(ours: list[float], base: list[float]) -> Stat:
    """ours / baseline per repetition (the pair measured side by side), as one Stat."""
    return Stat([a / b for a, b in zip(ours, base) if b])


def alternated(pairs: int, ours: Callable[[], T], base: Callable[[], T]) -> tuple[list[T], list[T]]:
    """Run `ours` and `base` `pairs` times each, as pairs whose order flips every time
    (ours first, then base first, ...), so drift in the machine's load hits both alike."""
    a: list[T] = []
    b: list[T] = []
    for i in range(pairs):
        if i % 2 == 0:
            a.append(ours())
            b.append(base())
        else:
            b.append(base())
            a.append(ours())
    return a, b


def back_and_forth(reps: int, items: Iterable[T]) -> Iterable[tuple[int, T]]:
    """(rep, item) over `items` forwards, then backwards, and so on: sizes measured interleaved."""
    items = list(items)
    for i in range(reps):
        for item in (items if i % 2 == 0 else items[::-1]):
            yield i, item


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def children_cpu() -> float:
    """CPU seconds of this process's waited-for children so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def machine_cpu() -> float:
    """CPU seconds used by everything on this machine so far (/proc/stat: busy time of all cores)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait
        return busy / os.sysconf("SC_CLK_TCK")
    return 0.0
