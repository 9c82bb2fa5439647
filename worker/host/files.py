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
TAIL_LINE_BYTES = 4096  # a tail of N lines reads at most N times this from the log's end


def tail_bytes(lines: int) -> int:
    """How much of a log's end a tail of `lines` lines reads (a line longer than its share shows its end)."""
    return max(64 << 10, lines * TAIL_LINE_BYTES)


def last_lines(data: bytes, tail: int) -> bytes:
    """The last `tail` lines of `data`, the end of a log (split at newlines only: a `\r` is part of its line)."""
    if tail <= 0:
        return b""
    start = len(data) - 1 if data.endswith(b"\n") else len(data)
    for _ in range(tail):
        start = data.rfind(b"\n", 0, start)
        if start < 0:
            return data
    return data[start + 1:]


def read_log(path: Path, offset: int, tail: int | None = None) -> tuple[bytes, int]:
    """A log from byte `offset` (at most READ_MAX_BYTES of it), or its last `tail` lines within its last
    tail_bytes(tail) bytes: (bytes, next offset). Bytes as written: the reader decodes them (a character split
    between two reads stays whole). FileNotFoundError when there is no log (yet); another OSError when it cannot
    be read (a FIFO or a folder in its place too: never waited on)."""
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
        start = max(0, size - tail_bytes(tail))
        log.seek(start)
        return last_lines(log.read(size - start), tail), size
