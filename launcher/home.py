"""Where the control machine keeps its runs: $MGPU_HOME (default: the user's state folder)/runs/<run-id>/."""

from __future__ import annotations

import os
from pathlib import Path

RUNS = "runs"
PORTS = "ports"


def mgpu_home() -> Path:
    """Where runs are recorded on the control machine: $MGPU_HOME, else the user's state folder."""
    if os.environ.get("MGPU_HOME"):
        return Path(os.environ["MGPU_HOME"]).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "mgpu-cluster"


def run_folder(run_id: str) -> Path:
    """A run's record on the control machine (spec.toml, state.json, launcher.log, ...)."""
    return mgpu_home() / RUNS / run_id
