"""A task's own folder on its host: owner-only, worker.log kept whole, every write guarded (a full disk
or a deleted folder is said once per folder and never ends the task nor loses its exit code)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Callable

from worker.host import layout
from worker.host.files import write_private
from worker.host.system import write_problem



class TaskFolder:
    def __init__(self, path: Path, tell: Callable[[str], None]):
        self.path, self.tell = path, tell  # tell: how a failed write reaches the launcher
        self.log: io.FileIO | None = None
        self.failed: set[str] = set()

    def prepare(self, header: bytes) -> None:
        """The folder (owner only), stale files gone, worker.log open: each step on its own, so that one that
        fails (a parent folder of another user's, a full disk) skips none of the others."""
        log = layout.file(self.path, layout.WORKER_LOG)
        self._try(log, lambda: self.path.mkdir(parents=True, exist_ok=True, mode=0o700))
        for folder in (self.path.parent, self.path):  # mkdir's mode does not reach the parents it makes
            try:
                os.chmod(folder, 0o700)
            except OSError:
                pass  # not ours (a shared run folder) or not there: said by the steps that need it
        for stale in layout.STALE:
            self._try(self.path / stale, lambda: (self.path / stale).unlink(missing_ok=True))
        self._try(log, self._open_log)
        self.log_write(header)

    def _open_log(self) -> None:
        fd = os.open(layout.file(self.path, layout.WORKER_LOG), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.log = os.fdopen(fd, "ab", buffering=0)

    def _try(self, path: Path, step: Callable[[], object]) -> None:
        try:
            step()
        except OSError as exc:
            self.write_failed(path, exc)

    def log_write(self, data: bytes) -> None:
        if self.log is None:
            return
        try:
            self.log.write(data)
        except (OSError, ValueError) as exc:
            self.log = None  # a full disk: worker.log stops; the output still reaches the launcher
            self.write_failed(layout.file(self.path, layout.WORKER_LOG), exc)

    def write(self, name: str, text: str) -> None:
        try:
            write_private(self.path / name, text)
        except OSError as exc:
            self.write_failed(self.path / name, exc)

    def write_failed(self, path: Path, exc: OSError | ValueError) -> None:
        if str(path.parent) in self.failed:  # said once per folder: one paragraph, not one a file
            return
        self.failed.add(str(path.parent))
        self.tell(write_problem(path, exc) + "; the task goes on without its files there (its log and progress "
                  "may be missing) and its exit still reaches the launcher; free space there for the next run")
