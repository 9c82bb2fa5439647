"""A run's files, on the control machine and on the hosts: written whole, readable by their owner only."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def write_private(path: Path, text: str) -> None:
    """Atomic (a temporary file renamed over `path`: readers never see half), mode 0600; a write that fails
    (a full disk) leaves no temporary file behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
