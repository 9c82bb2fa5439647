"""`fetch`: the model a run's chief saved (model.keras in the run's folder on the chief's host) copied to this
machine, whole or not at all: the host gives its size and SHA-256 (worker.task.backup), the bytes come over the
run's own connection into a temporary file beside the destination, which is checked and then renamed."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Callable

from launcher.engines.base import Inspecting
from launcher.errors import RunFailed
from launcher.plan import run_root
from launcher.run import record
from launcher.commands.recorded import inspector
from worker.host import layout
from worker.host.spawn import module_argv

CALL_TIMEOUT_S = 300.0  # hashing a large model takes a while
CHUNK = 1 << 20


def fetch(run_id: str, out: Path | None, say: Callable[[str], None]) -> Path:
    """Copy the run's saved model here (to `out`, else ./model-RUN.keras); the path written."""
    run = record.load(run_id)
    engine = inspector(run)
    try:
        chief = run.attempts[-1].tasks[0] if run.attempts and run.attempts[-1].tasks else 0
        plan = engine.plan[chief]
        where = f"task {chief} ({plan.host.label})"
        path = f"{run_root(plan.host, run.run_id)}/{layout.MODEL}"
        code, text, err = engine.call(chief, module_argv(plan.python, "worker.task.backup") + ["file", path],
                                      CALL_TIMEOUT_S)
        try:
            said = json.loads(text.strip().splitlines()[-1])
        except (ValueError, IndexError):
            said = {"error": (err or text).strip()[-300:] or f"exit {code}"}
        if not isinstance(said, dict) or "error" in said or not isinstance(said.get("size"), int):
            why = said.get("error") if isinstance(said, dict) else said
            raise RunFailed(f"run {run.run_id}: no saved model to fetch from {where}: {path} (relative to its "
                            f"folder): {why}. The chief saves it when the training ends (the run is "
                            f"{run.state}); 'mgpu-cluster logs {run.run_id} --task {chief}' shows how its run went")
        dest = out or Path(f"model-{run.run_id}.keras")
        copy(engine, chief, str(said["path"]), int(said["size"]), str(said["sha256"]), dest, where)
        say(f"fetched {where}:{said['path']} to {dest} ({int(said['size']) / 1e6:.1f} MB, SHA-256 checked)")
        return dest
    finally:
        engine.close()


def copy(engine: Inspecting, index: int, path: str, size: int, sha256: str, dest: Path, where: str) -> None:
    """The file into a temporary file beside `dest`, checked by size and SHA-256, then renamed over it."""
    partial = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.partial")
    digest, got = hashlib.sha256(), 0
    try:
        with engine.open_file(index, path) as src, open(partial, "wb") as dst:
            while chunk := src.read(CHUNK):
                digest.update(chunk)
                dst.write(chunk)
                got += len(chunk)
        if (got, digest.hexdigest()) != (size, sha256):
            raise OSError(f"the copy ({got} bytes) differs from the file on the host ({size} bytes); it may have "
                          "changed meanwhile: fetch again")
        os.replace(partial, dest)
    except Exception as exc:  # noqa: BLE001 (a lost connection too: the copy is not made, and said so)
        partial.unlink(missing_ok=True)
        raise RunFailed(f"fetching {where}:{path} to {dest} failed: {str(exc) or type(exc).__name__}; nothing was "
                        "written there") from None
