"""The launcher's reads of its own files (a run's record, progress history, spec copy, port claims): untrusted
bytes, bounded, from regular files only; a failure is one paragraph naming the path (RunCorrupt, exit 2).
And the note a launcher keeps in room reserved beforehand, for when a full disk refuses every other write."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Mapping

from launcher.errors import RunCorrupt

READ_MAX_BYTES = 64 << 20  # a file of a run larger than this was not written by mgpu-cluster
NOTE_BYTES = 16384


def read_file(path: Path, limit: int = READ_MAX_BYTES, newest: bool = False) -> bytes:
    """A file as untrusted bytes: a regular file, at most `limit` bytes of it (`newest`: its last `limit` bytes;
    else a larger file is refused). FileNotFoundError when it is not there; RunCorrupt, one paragraph naming
    the path, for anything else (a folder, a FIFO or device, too large, unreadable)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # opening a FIFO must not block
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise RunCorrupt(f"cannot read {path}: {exc.strerror or exc}.") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            what = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file (a FIFO, socket or device)"
            raise RunCorrupt(f"{path} is {what}; mgpu-cluster writes a file there, so something else put this "
                             "there. Move it away; other runs are not affected.")
        if info.st_size > limit and not newest:
            raise RunCorrupt(f"{path} holds {info.st_size} bytes, more than the {limit} mgpu-cluster writes there; "
                             "move it away. Other runs are not affected.")
        return os.pread(fd, limit, max(0, info.st_size - limit))
    except OSError as exc:
        raise RunCorrupt(f"cannot read {path}: {exc.strerror or exc}.") from None
    finally:
        os.close(fd)


def reserve(path: Path) -> None:
    """Take NOTE_BYTES on disk for `path` now (mode 0600), while there is room; OSError when there is none."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, b" " * NOTE_BYTES)
    finally:
        os.close(fd)


def write_note(path: Path, note: Mapping[str, object] | None) -> bool:
    """`note` as JSON (None: blank) over the reserved bytes, in place: no new block, so a full disk takes it.
    A note too long for them loses the end of its longest text first. False when even that failed."""
    text = json.dumps(note) if note is not None else ""  # ASCII: one byte a character
    while len(text) > NOTE_BYTES and note:
        texts = {k: v for k, v in note.items() if isinstance(v, str)}
        key = max(texts, key=lambda k: len(texts[k]), default=None)
        if key is None or not texts[key]:
            return False
        note = {**note, key: texts[key][:len(texts[key]) // 2]}
        text = json.dumps(note)
    try:
        fd = os.open(path, os.O_WRONLY)  # no O_CREAT, no O_TRUNC: the blocks taken by reserve()
        try:
            os.pwrite(fd, text.encode().ljust(NOTE_BYTES), 0)
        finally:
            os.close(fd)
    except OSError:
        return False
    return True


def read_note(path: Path) -> dict[str, object] | None:
    """What write_note left at `path`: a JSON object, or None (blank, missing, or not one)."""
    try:
        data = json.loads(read_file(path, limit=NOTE_BYTES))
    except (OSError, RunCorrupt, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None
