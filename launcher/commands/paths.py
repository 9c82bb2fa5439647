"""Path arguments of the command line, checked before a command does anything: one paragraph (exit 2) saying
what is wrong with the path and what to give instead."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from launcher.errors import BadArgument


def output_file(value: str | None, option: str, example: str) -> Path | None:
    """The file that `option` (e.g. "-o") names for a command to write, or None when it was not given. Refused:
    an empty name, a folder, something that is not a regular file, a folder that is missing or not writable."""
    if value is None:
        return None
    shown = f"{option} {value!r}"
    if not value.strip() or "\x00" in value:
        raise BadArgument(f"{shown}: not a file name; give the file to write, e.g. {option} {example}")
    path = Path(value)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        info = None
    except OSError as exc:
        raise BadArgument(f"{shown}: cannot be looked at ({exc.strerror or exc}); give another path, e.g. "
                          f"{option} {example}") from None
    if value.endswith("/") or info is not None and stat.S_ISDIR(info.st_mode):
        raise BadArgument(f"{shown} names a folder; give a file in it, e.g. {option} {path / example}")
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise BadArgument(f"{shown} is not a regular file (a device, FIFO or socket), which would be replaced; "
                          f"give a file name, e.g. {option} {example}")
    folder = path.parent
    if not folder.is_dir():
        raise BadArgument(f"{shown}: its folder {folder} does not exist; create it first or give a path in a "
                          f"folder that does, e.g. {option} {example}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise BadArgument(f"{shown}: cannot write in its folder {folder} (permission denied); give a path in a "
                          f"folder you can write, e.g. {option} {example}")
    return path
