"""A step per attempt in the user's own allocation (`up` under salloc, or in their batch script): srun
runs it directly; the allocation is theirs and is never cancelled, only the run's steps are."""

from __future__ import annotations

import os
import shlex
import subprocess
import threading
from typing import Callable

from launcher.engines.base import JobRecord
from launcher.engines.slurm.commands import slurm, spawn
from launcher.engines.slurm.kind import JobKind, Say
from launcher.engines.slurm.plan import Mode, step_output
from launcher.engines.slurm.preflight import allocation_problems
from launcher.engines.slurm.script import srun_argv
from launcher.engines.slurm.watch import Watcher
from launcher.spec.cluster import SlurmSpec


class AllocationStep(JobKind):
    mode = Mode.ALLOCATION

    def __init__(self, spec: SlurmSpec, run_id: str, job_id: str | None = None, ids: list[str] | None = None,
                 watcher: Watcher | None = None):
        super().__init__(spec, run_id, job_id or os.environ.get("SLURM_JOB_ID"), watcher)  # the user's job
        self.srun: subprocess.Popen[bytes] | None = None

    def title(self) -> str:
        return f"the step in allocation {self.job_id}"

    def problems(self) -> list[str]:
        return allocation_problems(self.spec, self.job_id)

    def show(self, say: Say) -> None:
        say(f"# inside allocation {self.job_id}: each attempt is a step run directly, in {self.root}")
        say(shlex.join(srun_argv(self.spec, self.run_id, 0)))

    def launch(self, attempt: int, say: Say, on_job: Callable[[JobRecord], None]) -> str | None:
        self.stopping = False
        on_job(self.record())
        say(f"inside allocation {self.job_id}: attempt {attempt} runs as a step of it (srun), no job of its own")
        self.srun = spawn(srun_argv(self.spec, self.run_id, attempt), step_output(self.root, attempt), self.root)
        return None

    def over(self) -> str | None:
        if self.srun is not None and self.srun.poll() is not None:
            return f"its srun step ended (exit code {self.srun.returncode}) with no exit report from this task"
        return None

    def cancel(self) -> None:
        self.stopping = True
        for step in self.watcher.steps(self.name):
            slurm(["scancel", "--signal=INT", step], 10.0)
            slurm(["scancel", step], 10.0)
        if self._running():
            threading.Thread(target=self._end_srun, daemon=True).start()

    def _running(self) -> bool:
        return self.srun is not None and self.srun.poll() is None

    def _end_srun(self) -> None:
        assert self.srun is not None  # started by launch
        try:
            self.srun.wait(self.spec.launch.stop_grace + 5.0)
        except subprocess.TimeoutExpired:
            self.srun.terminate()

    def still_there(self) -> bool:
        return bool(self.watcher.steps(self.name)) or self._running()

    def close(self) -> None:
        if self.srun is not None and self._running():  # our step goes with us
            self.cancel()
            try:
                self.srun.wait(self.spec.launch.stop_grace + 5.0)
            except subprocess.TimeoutExpired:
                self.srun.kill()
