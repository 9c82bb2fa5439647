"""A host's copy of a run's backup, for restarts with nothing shared (an on-host entry the launcher runs over
SSH): `list FOLDER` prints what the checkpoint folder and each spare copy in it hold (the owner file's word, each
backup file's size and SHA-256); `install FOLDER STAGE` takes a copy the launcher wrote into STAGE, checks every file against the
listing it sends on stdin, and puts it in place of the folder's backup, whole or not at all; `file PATH` gives
one file's size and SHA-256 (`fetch` of the saved model). Standard library only; the folder's files are
untrusted (an owner file is read as startpoint reads it)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from typing import Any

from worker.host.startpoint import BACKUPS, FINISHED, OWNER, SPARES, Found, look

CHUNK = 1 << 20
STAGE_PREFIX = ".mgpu-copy-"  # a copy being written: never read as a backup, removed by the next install


@dataclass(frozen=True)
class Held:
    """What one checkpoint folder (or a spare copy in one) holds: where it is (absolute, on its host), its owner
    file's run and steps done (None: no owner), each backup file (relative to the folder) with its size and
    SHA-256, and the run whose training finished there (finished.json; its only file once the backup is gone)."""

    folder: str
    run: str | None
    steps_done: int | None
    files: dict[str, tuple[int, str]]
    finished: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Held":
        return cls.parse(json.loads(text))

    @classmethod
    def parse(cls, data: Any) -> "Held":  # Any: a host's JSON, untrusted: each field is checked here
        files = {str(k): (int(v[0]), str(v[1])) for k, v in dict(data["files"]).items()}
        steps, run, finished = data.get("steps_done"), data.get("run"), data.get("finished")
        return cls(str(data["folder"]), run if isinstance(run, str) else None, steps if isinstance(steps, int) else None,
                   files, finished if isinstance(finished, str) else None)


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: str) -> dict[str, tuple[int, str]]:
    """Every file below the folder's backup folders, its owner and finished files: relative path -> (size,
    SHA-256)."""
    found: dict[str, tuple[int, str]] = {}
    for name in (*BACKUPS, OWNER, FINISHED):
        top = os.path.join(folder, name)
        paths = [top] if os.path.isfile(top) else [os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs]
        for path in paths:
            if not os.path.isfile(path) or os.path.islink(path):
                continue
            found[os.path.relpath(path, folder)] = (os.path.getsize(path), sha256(path))
    return found


def held(folder: str) -> Held:
    folder = os.path.abspath(os.path.expanduser(folder))
    found: Found = look(folder)
    owner = found.owner
    return Held(folder, owner.run if owner else None, owner.steps_done if owner else None,
                _files(folder) if found.backup or found.finished else {}, found.finished)


def listing(folder: str) -> list[Held]:
    """The folder's own backup, then each spare copy kept in it (spares/<task>, whole ones only: a copy being
    written is named <task>.new)."""
    own = held(folder)
    try:
        names = sorted((n for n in os.listdir(os.path.join(own.folder, SPARES)) if n.isdigit()), key=int)
    except OSError:
        names = []
    return [own, *(held(os.path.join(own.folder, SPARES, n)) for n in names)]


def _free(folder: str) -> int | None:
    """Bytes free on the disk that holds `folder` (or its nearest existing parent)."""
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        return shutil.disk_usage(folder or "/").free
    except OSError:
        return None


def install(folder: str, stage: str, want: Held) -> str:
    """Put the copy in STAGE in place of the folder's backup, once each file is the size and SHA-256 `want` lists
    (and no file is missing or extra): '' done, else why not (the stage is removed either way)."""
    try:
        got = _files(stage)
        if got != want.files:
            bad = sorted(set(got) ^ set(want.files) | {f for f in got if f in want.files and got[f] != want.files[f]})
            shutil.rmtree(stage, ignore_errors=True)
            need, free = sum(size for size, _ in want.files.values()), _free(folder)
            if free is not None and free < need:  # a write past the disk's end fails after the copy's sender moved on
                return (f"No space left on device: the backup is {need / 1e6:.1f} MB and the disk holding the folder "
                        f"has {free / 1e6:.1f} MB free")
            return f"the copy differs from the source in {', '.join(bad[:5])}"
        for name in (*BACKUPS, OWNER, FINISHED):
            new, old = os.path.join(stage, name), os.path.join(folder, name)
            if os.path.isdir(old) and not os.path.islink(old):
                shutil.rmtree(old)
            elif os.path.lexists(old):
                os.remove(old)
            if os.path.lexists(new):
                os.replace(new, old)
        return ""
    except OSError as exc:
        return f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}"
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def one_file(path: str) -> dict[str, object]:
    """A file as `fetch` copies it (the chief's saved model): where it is, its size and SHA-256, or why not."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        if not os.path.isfile(path):
            return {"path": path, "error": "no such file"}
        return {"path": path, "size": os.path.getsize(path), "sha256": sha256(path)}
    except OSError as exc:
        return {"path": path, "error": exc.strerror or str(exc)}


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "list":
        print(json.dumps([asdict(h) for h in listing(argv[1])]))
        return 0
    if len(argv) >= 2 and argv[0] == "file":
        said = one_file(argv[1])
        print(json.dumps(said))
        return 1 if "error" in said else 0
    if len(argv) >= 3 and argv[0] == "install" and os.path.basename(argv[2]).startswith(STAGE_PREFIX):
        why = install(argv[1], argv[2], Held.from_json(sys.stdin.read()))
        print(json.dumps({"error": why}))
        return 0 if not why else 1
    print("usage: python -m worker.task.backup list FOLDER | install FOLDER STAGE < LISTING | file PATH",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
