"""The seam between what the agent decides and how an engine starts and stops tasks.

An engine brings a run's tasks to life and reports on them through a Sink (worker.protocol
events, output lines); the agent, the record, `status`, `logs` and `down` see nothing else.
`supervised` (our supervisor per task: local processes and SSH hosts) is the first engine; a
batch scheduler (Slurm) is the second kind, where the scheduler starts, signals and stops tasks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable

from launcher.plan import TaskPlan
from launcher.spec import ClusterSpec
from launcher.transport import Result, Sink


class Engine(ABC):
    kind: str = ""
    restarts_itself = False  # the scheduler restarts the group (the agent only follows)
    beats = False  # every live task sends a record at least every protocol.BEAT_S s, so silence means lost

    def __init__(self, spec: ClusterSpec, plans: list[TaskPlan]):
        self.spec, self.plans = spec, plans
        self.plan = {p.index: p for p in plans}  # by task index (not always 0..n-1: elastic runs)

    @abstractmethod
    def preflight(self, base: Path | None, say: Callable[[str], None], for_start: bool = False) -> list:
        """Check hosts and ports, start nothing; a list of preflight.TaskCheck. `for_start`: `up`
        will start the tasks next (an engine may keep what it opened for the checks)."""

    @abstractmethod
    def start(self, attempt: int, sink: Sink) -> dict[int, str]:
        """Start every task of `attempt`, reporting to `sink`; {index: why it could not start}."""

    @abstractmethod
    def stop(self, indices: list[int]) -> None:
        """Ask these live tasks to stop now; each one's Exit (or Lost) follows on the sink."""

    @abstractmethod
    def stop_from_folders(self, indices: list[int]) -> list[Result[dict]]:
        """Stop tasks with no live handle (`down`, a teardown past its deadline); per task."""

    @abstractmethod
    def probe(self, indices: list[int]) -> list[Result[dict]]:
        """What each task's host says now: pid, alive, exit_code, progress, cpu_percent, rss."""

    @abstractmethod
    def read_log(self, index: int, offset: int, tail: int | None = None) -> tuple[str, int]:
        """worker.log of a task from byte `offset` (or its last `tail` lines): (text, next offset)."""

    def reachable(self, indices: list[int]) -> list[Result[float]]:
        """Whether each task's host answers now (elastic runs drop the ones that do not)."""
        return [Result(value=0.0) for _ in indices]

    def close(self) -> None:
        pass


def engine_for(spec: ClusterSpec, plans: list[TaskPlan]) -> Engine:
    if spec.slurm is not None:
        from launcher.engines.slurm import SlurmEngine

        return SlurmEngine(spec, plans)
    from launcher.engines.supervised import SupervisedEngine

    return SupervisedEngine(spec, plans)
