"""What an attempt runs in, as the engine sees it: the run's own batch job (batch.BatchJob) or a step in
the user's allocation (step.AllocationStep). Each starts an attempt, says when it is over, stops it, and
tells what Slurm made of it; the job's state comes from the watcher."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable

from launcher.engines.base import JobRecord, SchedulerEnd
from launcher.engines.slurm.plan import Mode, job_name, run_folder
from launcher.engines.slurm.watch import Watcher
from launcher.spec.cluster import SlurmSpec

Say = Callable[[str], None]


class JobKind(ABC):
    mode: Mode

    def __init__(self, spec: SlurmSpec, run_id: str, job_id: str | None = None, watcher: Watcher | None = None):
        self.spec, self.run_id, self.watcher = spec, run_id, watcher or Watcher(job_id)
        self.cfg, self.root = spec.slurm, Path(run_folder(spec, run_id))
        self.name = job_name(run_id)
        self.stopping = False  # we stopped it (Ctrl-C, down, a failure): what Slurm then says is no verdict

    @property
    def job_id(self) -> str | None:
        return self.watcher.job_id

    def record(self) -> JobRecord:
        """The job as the run record keeps it (RunRecord.job)."""
        return {"id": self.job_id, "mode": str(self.mode), "ids": self.ids(), "name": self.name}

    def ids(self) -> list[str]:
        return []

    @abstractmethod
    def title(self) -> str:
        """The preflight's row."""

    @abstractmethod
    def problems(self) -> list[str]:
        """What stops an attempt from starting here (asked of Slurm; nothing submitted)."""

    @abstractmethod
    def show(self, say: Say) -> None:
        """How an attempt is started (the dry run)."""

    @abstractmethod
    def launch(self, attempt: int, say: Say, on_job: Callable[[JobRecord], None]) -> str | None:
        """Start the attempt; return once its tasks are on their way (None), or why they cannot be."""

    @abstractmethod
    def over(self) -> str | None:
        """Why the attempt can report no more (its job or step is over), or None."""

    def verdict(self, attempt: int, notices: set[str]) -> SchedulerEnd | None:
        return None

    @abstractmethod
    def cancel(self) -> None:
        """Stop the attempt: its tasks get INT (KILL after stop_grace), then Slurm ends the job or step."""

    @abstractmethod
    def still_there(self) -> bool:
        """Whether Slurm still runs (or queues) anything of the run."""

    def cannot_stop(self) -> str | None:
        """Why this machine cannot stop the run (Slurm's commands missing), or None."""
        return None

    @abstractmethod
    def close(self) -> None:
        """`up` ends: nothing of the run is left queued or running."""
