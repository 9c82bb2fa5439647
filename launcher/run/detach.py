"""`up --detach`: the same `up` in the background (own session); return once every task has started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from launcher.run import files, record
from launcher.errors import Interrupted, RunCorrupt, RunFailed, RunNotFound
from launcher.run.output import Output
from launcher.run.states import RunState
from worker.host.clock import wait_until

DETACH_WAIT_S = 300.0


def start_detached(spec_path: Path, run_id: str, n_tasks: int, verbose: bool = False, resume: str | None = None,
                   args: list[str] | tuple[str, ...] = ()) -> None:
    """Start `up` in the background (`resume`, `args`: as up's); return once every task of the run has started
    (the agent's fact: the run is running) or the run ended. A wait that runs out stops nothing: the run goes on."""
    folder = record.runs_dir(create=True)
    out_path = folder / f".{run_id}.out"  # the background launcher's own stdout, moved into its run folder
    argv = [sys.executable, "-m", "launcher", "up", str(spec_path), "--quiet", "--run-id", run_id,
            *(["--resume", resume] if resume else []), "--", *args]
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    out = Output(threaded=False)
    try:
        found = wait_until(lambda: _settled(proc, run_id), DETACH_WAIT_S, 0.1)
    except KeyboardInterrupt:
        _stop_background(proc)
        raise Interrupted(f"interrupted: run {run_id} was stopped before it was running") from None
    if found is None:
        return _still_starting(out, out_path, run_id)
    run, code = found
    tail = run.failure.message if run is not None and run.failure else _tail(out_path)
    _move(out_path, run_id)
    if run is not None and run.state in (RunState.RUNNING, RunState.SUCCEEDED):
        out.say(f"run {run_id} is running detached ({n_tasks} task(s)); 'mgpu-cluster status {run_id}' to "
                f"watch, 'mgpu-cluster down {run_id}' to stop" if run.state == RunState.RUNNING else
                f"run {run_id} already succeeded; 'mgpu-cluster logs {run_id}' shows its output")
        return
    raise RunFailed(f"run {run_id} ended before every task was running (exit {code}):\n{tail}",
                    exit_code=code if code in (1, 2, 130) else 1)


def _settled(proc: subprocess.Popen[bytes], run_id: str) -> tuple[record.RunRecord | None, int | None] | None:
    """(the record, the launcher's exit code) once every task has started (the run is running), the run
    succeeded, or its launcher exited; None before."""
    code, run = proc.poll(), _load(run_id)
    if code is not None or run is not None and run.state in (RunState.RUNNING, RunState.SUCCEEDED):
        return run, code
    return None


def _still_starting(out: Output, out_path: Path, run_id: str) -> None:
    """The wait ran out: the run is left going (its start_timeout is the agent's to enforce); said so."""
    _move(out_path, run_id)
    run = _load(run_id)
    if run is not None and run.ended:  # its launcher is still finishing
        raise RunFailed(f"run {run_id} ended ({run.state}) before every task was running"
                        + (f":\n{run.failure.message}" if run.failure else ""))
    state = run.state if run is not None else RunState.PREFLIGHT
    out.say(f"run {run_id} is not running yet after {DETACH_WAIT_S:.0f} s (state {state}); it was not stopped and "
            f"goes on in the background: 'mgpu-cluster status {run_id}' to watch, 'mgpu-cluster down {run_id}' to "
            "stop it")


def _load(run_id: str) -> record.RunRecord | None:
    try:
        return record.load(run_id)
    except RunNotFound:  # not written yet
        return None


def _tail(path: Path) -> str:
    try:
        return files.read_file(path, limit=3000, newest=True).decode("utf-8", "replace")
    except (OSError, RunCorrupt) as exc:
        return f"(its output {path} cannot be read: {getattr(exc, 'strerror', None) or exc})"


def _move(out_path: Path, run_id: str) -> None:
    try:
        os.replace(out_path, record.run_path(run_id) / "launcher.out")
    except OSError:
        pass


def _stop_background(proc: subprocess.Popen[bytes]) -> None:
    """Ask a background launcher that never got its run going to stop its tasks, as `down` would."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
