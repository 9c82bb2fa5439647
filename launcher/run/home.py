"""Where the control machine keeps its runs: $MGPU_HOME (default: the user's state folder)/runs/<run-id>/."""

from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path

from launcher.errors import HomeError
from worker.host import env

RUNS = "runs"
PORTS = "ports"
RUN_ID = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{4}\Z")


def mgpu_home() -> Path:
    """Where runs are recorded on the control machine: $MGPU_HOME, else the user's state folder."""
    if os.environ.get(env.HOME):
        return Path(os.environ[env.HOME]).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "mgpu-cluster"


def run_folder(run_id: str) -> Path:
    """A run's record on the control machine (spec.toml, state.json, launcher.log, ...)."""
    return mgpu_home() / RUNS / run_id


def runs_dir(create: bool = False) -> Path:
    path = mgpu_home() / RUNS
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
            probe = path / f".write-test-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as exc:
            raise HomeError(
                f"cannot write run records to {path}: {exc.strerror or exc}. mgpu-cluster keeps its runs under "
                "$MGPU_HOME (default ~/.local/state/mgpu-cluster); set MGPU_HOME to a folder you can write "
                f"(e.g. 'export MGPU_HOME=$HOME/.mgpu'), or fix the permissions of {path}.") from None
    return path


def new_run_id() -> str:
    """Start time, then 4 hex digits: the millisecond (high 10 bits) and 6 random bits, so that ids sort
    in start order even for runs started within one second (`down` without a run id takes the last)."""
    now = time.time()
    suffix = int(now % 1 * 1000) << 6 | secrets.randbelow(64)
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f"-{suffix:04x}"
