"""`mgpu-cluster stacks` and `mgpu-cluster report`: what the CLI hands to this package."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.errors import RunFailed, RunNotFound
from launcher.run import record
from launcher.run.states import TaskState

if TYPE_CHECKING:
    from launcher.diagnose.stacks import TaskStacks


def live_tasks(run_id: str, task: int | None = None) -> tuple[record.RunRecord, list[record.TaskRecord],
                                                            list[record.TaskRecord]]:
    """The run (settled with its hosts when its launcher is gone: its record's `running` is stale), the tasks
    asked for (`task`, or all) and those of them that run; RunFailed (exit 1) when none of them runs."""
    from launcher.commands.recorded import settle

    run = record.load(run_id)
    if not run.ended and not record.launcher_alive(run):
        run = settle(run).run
    if task is not None and task not in {t.index for t in run.tasks}:
        raise RunNotFound(f"run {run.run_id} has no task {task}; it has tasks 0..{len(run.tasks) - 1}")
    chosen = [t for t in run.tasks if task is None or t.index == task]
    live = [t for t in chosen if t.state == TaskState.RUNNING and not run.ended]
    if not live:
        what = f"run {run.run_id} has no running task (run state: {run.state})"
        if task is not None:
            what = f"task {task} of run {run.run_id} is not running (task state: {chosen[0].state}, run state: {run.state})"
        raise RunFailed(f"{what}: stacks are read from live processes; 'mgpu-cluster status {run.run_id}' "
                        "shows the tasks.")
    return run, chosen, live


def take_stacks(run: record.RunRecord, live: list[record.TaskRecord]) -> list[TaskStacks]:
    """The stacks of the `live` tasks of `run`, each taken on its host (TaskStacks: the stacks or why none)."""
    from launcher.diagnose.stacks import take
    from launcher.commands.recorded import inspector

    engine = inspector(run)
    try:
        return take(engine, [(t.index, t.host, t.pid, t.create_time) for t in live])
    finally:
        engine.close()


def stacks(run_id: str, task: int | None = None) -> None:
    """Print the stacks of every live task (or of `task`) and a line for each task that is not running;
    RunFailed (exit 1) when none is running, when `task` is not, or naming live tasks with no stacks."""
    run, chosen, live = live_tasks(run_id, task)
    found = take_stacks(run, live)
    lines = {ts.index: ts.text() for ts in found}
    lines.update({t.index: f"task {t.index} ({t.host}): not running (state {t.state})"
                  for t in chosen if t.index not in lines})  # not a failure: a finished task has no stack
    for index in sorted(lines):
        print(lines[index], flush=True)
    failed = [ts for ts in found if not ts.ok]
    if failed:
        raise RunFailed("no stacks from " + "; ".join(f"{ts.header}: {ts.why}" for ts in failed))


def report(run_id: str, out: Path | None = None) -> Path:
    """Draw the run's report PNG (default: report.png in the run's folder); prints and returns its path."""
    from launcher.diagnose import report as draw
    from launcher.diagnose import series

    run = record.load(run_id)
    folder = record.run_path(run.run_id)
    path = Path(out) if out else folder / "report.png"
    draw.write(series.load(folder, now=time.time()), path)
    print(path, flush=True)
    return path
