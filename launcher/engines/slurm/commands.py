"""Running Slurm's commands: one helper for every command the engine runs (sbatch, scancel and srun act;
the watcher and the preflight ask), and one for the step it leaves running in the background."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path


def slurm(argv: list[str], timeout: float = 30.0, input: str | None = None) -> subprocess.CompletedProcess[str]:
    """A Slurm command; a missing command or a time-out reads as a failed command (code 127 / 124)."""
    try:
        return subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout,
                              stdin=None if input is not None else subprocess.DEVNULL, start_new_session=True)
    except FileNotFoundError:
        return subprocess.CompletedProcess(argv, 127, "", f"{argv[0]}: not found on PATH")
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"`{shlex.join(argv)}` did not answer within {timeout:g} s")


def spawn(argv: list[str], out: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """A Slurm command left running (an srun step), its output appended to `out`."""
    with open(out, "ab") as log:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
