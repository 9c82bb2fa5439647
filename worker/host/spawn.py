"""How our processes start theirs: each child leads a process group (killpg stops all it started; a
terminal's Ctrl-C reaches only the launcher) but stays in its parent's session, so a run's launcher,
supervisors and tasks share one scheduler autogroup, as workers started by hand from one shell do.
Tasks in sessions of their own stepped 1.2 ms slower of 37 on 2 busy cores (16 pairs, another process
waking 20 times a second). Standard library only: the supervisor imports it before its task starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any, Protocol

OWN_GROUP: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}

# `python -m M` puts the current folder first on sys.path, where a user's worker.py would take our package's
# name; our entries run through this instead, with that entry dropped (the built-in runner puts the workdir back
# once our package is imported, so the user's entrypoint still imports from there).
BOOT = ('import runpy,sys;sys.path[:]=filter(None,sys.path);'
        'runpy.run_module(sys.argv.pop(1),run_name="__main__",alter_sys=True)')


def module_argv(python: str, module: str) -> list[str]:
    """The command line that runs our module `module` (as `python -m` would) with `python`, on any host."""
    return [python, "-c", BOOT, module]


class Leader(Protocol):
    """A child that leads its process group: a subprocess.Popen, or an attempt a fork server forked."""

    @property
    def pid(self) -> int: ...

    def wait(self, timeout: float | None = None) -> int: ...


def stop_group(proc: Leader, grace: float) -> None:
    """Stop a child that leads its process group: TERM (and CONT, for a stopped one) to the group, KILL to
    what is left of it after `grace` seconds (also what the leader left in its group)."""
    for sig in (signal.SIGTERM, signal.SIGCONT):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
