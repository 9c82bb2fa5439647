"""A task's own folder on its host: owner-only, worker.log kept whole, every write guarded (a full disk
or a deleted folder is said once per folder and never ends the task nor loses its exit code)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from worker.task.files import write_private
from worker.task.host import write_problem

STALE = ("exit_code", "progress.json", "pid", "task.json")  # an earlier attempt's, gone before the start


class TaskFolder:
    def __init__(self, path: Path, tell: Callable[[str], None]):
        self.path, self.tell = path, tell  # tell: how a failed write reaches the launcher
        self.log = None
        self.failed: set[str] = set()

    def prepare(self, header: bytes) -> None:
        """The folder (owner only), stale files gone, worker.log open: each step may fail."""
        try:
            for folder in (self.path.parent, self.path):
                folder.mkdir(parents=True, exist_ok=True, mode=0o700)
                os.chmod(folder, 0o700)
            for stale in STALE:
                (self.path / stale).unlink(missing_ok=True)
            fd = os.open(self.path / "worker.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self.log = os.fdopen(fd, "ab", buffering=0)
        except OSError as exc:
            self.write_failed(Path(exc.filename or self.path), exc)
        self.log_write(header)

    def log_write(self, data: bytes) -> None:
        if self.log is None:
            return
        try:
            self.log.write(data)
        except (OSError, ValueError) as exc:
            self.log = None  # a full disk: worker.log stops; the output still reaches the launcher
            self.write_failed(self.path / "worker.log", exc)

    def write(self, name: str, text: str) -> None:
        try:
            write_private(self.path / name, text)
        except OSError as exc:
            self.write_failed(self.path / name, exc)

    def write_failed(self, path: Path, exc: OSError) -> None:
        if str(path.parent) in self.failed:  # said once per folder: one paragraph, not one a file
            return
        self.failed.add(str(path.parent))
        self.tell(write_problem(path, exc) + "; the task goes on without its files there (its log and progress "
                  "may be missing) and its exit still reaches the launcher; free space there for the next run")
