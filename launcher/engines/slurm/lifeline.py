"""The tasks' lifeline: while `up` runs, it touches its file in the run's folder (layout.ALIVE); each task stops
itself once the file is older than its --lifeline (the launcher was killed, or its machine went away)."""

from __future__ import annotations

import threading
from pathlib import Path

EVERY_S = 0.5


class Lifeline:
    def __init__(self, path: Path, every: float = EVERY_S):
        self.path, self.every = path, every
        self._stopped = threading.Event()
        self.touch()
        threading.Thread(target=self._run, daemon=True, name="slurm-lifeline").start()

    def touch(self) -> None:
        try:
            self.path.touch()
        except OSError:
            pass  # the tasks' own check says what is wrong with the folder

    def _run(self) -> None:
        while not self._stopped.wait(self.every):
            self.touch()

    def stop(self) -> None:
        self._stopped.set()
