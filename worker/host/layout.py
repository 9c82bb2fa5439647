"""A run's files on a host: every path piece of the on-host layout, for the launcher and the hosts.

    <workdir>/.mgpu/runs/<run-id>/            the run's folder (shared storage for Slurm and pods)
        env.json, launcher.alive              a scheduler's run: the launcher's part of the env, its lifeline
        checkpoint/, model.keras              the built-in runner's (beside the task folders)
        task-<i>/                             one task: worker.log, progress.json, pid, task.json,
                                              exit_code, events-<attempt>.jsonl, stacks-<time>.txt

A local host without a workdir keeps its run folder under the control machine's record of the run
($MGPU_HOME/runs/<run-id>/hosts/localhost). Paths keep the type they are given: a str (a path on a remote
host, relative to its login folder) or a Path. Standard library only.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TypeVar

P = TypeVar("P", str, Path)

MGPU_DIR = ".mgpu"  # under a workdir; a Kubernetes volume is mounted here
RUNS = "runs"
LOCAL_HOSTS = ("hosts", "localhost")  # under the control machine's run folder
CHECKPOINT = "checkpoint"  # the built-in runner's, in the run's folder

# a task's folder
WORKER_LOG = "worker.log"  # the training's stdout and stderr, whole
PROGRESS = "progress.json"  # written by the training (untrusted)
TASK_INFO = "task.json"  # pids with their create times
PID = "pid"
EXIT_CODE = "exit_code"
MODULES = "modules.txt"  # the installed modules the training had imported at its first step: its fork server imports them
FORK_LOG = "forkserver.log"  # what the task's fork server printed (its imports' warnings)
STALE = (EXIT_CODE, PROGRESS, PID, TASK_INFO)  # an earlier attempt's, removed before a start

# the run's folder, for a scheduler's tasks
ENV = "env.json"  # the launcher's part of every task's environment
ALIVE = "launcher.alive"  # touched by the launcher; stale once it is gone (the tasks' lifeline)

_INDEX = re.compile(r"^(0|[1-9][0-9]{0,8})\Z")  # ASCII digits, no leading zero: one spelling per index
_TASK = re.compile(r"^task-(0|[1-9][0-9]{0,8})\Z")
_EVENTS = re.compile(r"^events-(0|[1-9][0-9]{0,8})\.jsonl\Z")


def _join(base: P, *parts: str) -> P:
    return base.joinpath(*parts) if isinstance(base, Path) else os.path.join(base, *parts)


def mgpu_dir(workdir: P) -> P:
    """<workdir>/.mgpu: where a workdir keeps every run's files ('' gives the relative path)."""
    return _join(workdir, MGPU_DIR)


def run_root(workdir: P, run_id: str) -> P:
    """The run's folder under a workdir ('' for a host's login folder: relative)."""
    return _join(workdir, MGPU_DIR, RUNS, run_id)


def local_run_root(record_dir: Path) -> Path:
    """A local host without a workdir: its run folder under the control machine's record of the run."""
    return record_dir.joinpath(*LOCAL_HOSTS)


MODEL = "model.keras"  # the built-in runners' saved model, in the run's folder (the chief's)


def checkpoint_dir(root: P) -> P:
    """The built-in runner's checkpoint folder, beside the task folders (its default)."""
    return _join(root, CHECKPOINT)


def task_dir(root: P, index: int) -> P:
    return _join(root, f"task-{index}")


def index_of(text: str) -> int | None:
    """A task index written as text ('3' -> 3); None for '03', '²', '-1', ' 3' or anything else."""
    return int(text) if _INDEX.match(text) and text.isascii() else None


def task_index(name: str) -> int | None:
    """The index in a task folder's name ('task-3' -> 3); None for any other name ('task-03' too)."""
    m = _TASK.match(name)
    return int(m.group(1)) if m else None


def events_file(task_folder: P, attempt: int) -> P:
    """The task core's records of one attempt, where a scheduler started it (append-only)."""
    return _join(task_folder, f"events-{attempt}.jsonl")


def attempts(task_folder: Path) -> list[int]:
    """The attempts that have an events file in a task's folder, in order."""
    try:
        names = [p.name for p in task_folder.iterdir()]
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(_EVENTS.match, names) if m)


def file(task_folder: P, name: str) -> P:
    """One of a task folder's files (WORKER_LOG, PROGRESS, ...)."""
    return _join(task_folder, name)


def stacks_file(task_folder: P, stamp: str) -> P:
    """Where the stacks taken at a hang are kept ('stacks-<stamp>.txt')."""
    return _join(task_folder, f"stacks-{stamp}.txt")
