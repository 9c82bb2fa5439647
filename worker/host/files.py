"""A run's files, on the control machine and on the hosts: written whole, readable by their owner only."""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from pathlib import Path


def write_private(path: Path, text: str | bytes) -> None:
    """Atomic (a temporary file renamed over `path`: readers never see half), mode 0600; a write that fails
    (a full disk) leaves no temporary file behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


READ_MAX_BYTES = 16 << 20  # one read of a log: `logs -f` reads on from where it stopped


def read_log(path: Path, offset: int, tail: int | None = None) -> tuple[bytes, int]:
    """A log from byte `offset` (at most READ_MAX_BYTES of it), or its last `tail` lines: (bytes, next offset).
    Bytes as written: the reader decodes them (a character split between two reads stays whole).
    FileNotFoundError when there is no log (yet); another OSError when it cannot be read (a FIFO or a folder
    in its place too: never waited on)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as log:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        size = info.st_size
        if tail is None:
            log.seek(min(offset, size))
            data = log.read(READ_MAX_BYTES)
            return data, min(offset, size) + len(data)
        start, data = size, b""
        while start > 0 and data.count(b"\n") <= tail and size - start < READ_MAX_BYTES:
            start = max(0, start - 65536)
            log.seek(start)
            data = log.read(size - start)
        lines = data.splitlines(keepends=True)[-tail:] if tail else []
        return b"".join(lines), size
