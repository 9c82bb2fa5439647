"""A run on the control machine: $MGPU_HOME/runs/<run-id>/ with spec, state.json and the launcher's log."""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from launcher.errors import RunNotFound
from launcher.plan import mgpu_home

TASK_STATES = ("pending", "running", "succeeded", "failed", "stopped", "lost")


@dataclass
class TaskState:
    index: int
    host: str
    address: str
    port: int
    run_dir: str
    state: str = "pending"
    pid: int | None = None
    supervisor_pid: int | None = None
    exit_code: int | None = None
    restarts: int = 0
    started_at: float | None = None
    ended_at: float | None = None
    heartbeat: float | None = None  # when its progress last changed (launcher's clock)
    progress: dict | None = None
    cpu_percent: float | None = None  # relayed by the task's supervisor
    rss: int | None = None


@dataclass
class RunState:
    run_id: str
    spec_path: str
    state: str = "pending"  # pending, running, succeeded, failed, stopped
    attempt: int = 0
    agent_pid: int | None = None
    detached: bool = False
    created_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    failure: str | None = None
    phases: dict = field(default_factory=dict)
    tasks: list[TaskState] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict) -> "RunState":
        tasks = [TaskState(**t) for t in data.pop("tasks", [])]
        return cls(**data, tasks=tasks)


def runs_dir() -> Path:
    return mgpu_home() / "runs"


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def run_path(run_id: str) -> Path:
    return runs_dir() / run_id


def save(state: RunState) -> None:
    """Atomic: write a temp file, then rename it over state.json."""
    path = run_path(state.run_id) / "state.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".state.{os.getpid()}.{time.monotonic_ns()}.tmp")
    tmp.write_text(json.dumps(asdict(state), indent=1))
    os.replace(tmp, path)


def load(run_id: str | None = None) -> RunState:
    """The run `run_id`, or the latest run when None."""
    if run_id is None:
        candidates = sorted(runs_dir().glob("*/state.json"))  # run ids start with their start time
        if not candidates:
            raise RunNotFound(f"No runs yet under {runs_dir()}; start one with 'mgpu-cluster up SPEC'.")
        path = candidates[-1]
    else:
        path = run_path(run_id) / "state.json"
    try:
        return RunState.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise RunNotFound(f"Run {run_id!r} not found under {runs_dir()}; 'mgpu-cluster status' shows the latest.") from None
