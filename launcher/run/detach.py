"""`up --detach`: the same `up` in the background (own session); return once every task runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from launcher.run import record
from launcher.errors import Interrupted, RunFailed, RunNotFound
from launcher.run.output import Output
from worker.protocol import RunState

DETACH_WAIT_S = 300.0


def start_detached(spec_path: Path, run_id: str, n_tasks: int, verbose: bool = False) -> None:
    folder = record.runs_dir(create=True)
    out_path = folder / f".{run_id}.out"  # the background launcher's own stdout, moved into its run folder
    argv = [sys.executable, "-m", "launcher", "up", str(spec_path), "--quiet", "--run-id", run_id]
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    out = Output(threaded=False)
    deadline = time.time() + DETACH_WAIT_S
    try:
        while time.time() < deadline:
            code = proc.poll()
            try:
                run = record.load(run_id)
            except RunNotFound:  # not written yet
                run = None
            if run is not None and run.state in (RunState.RUNNING, RunState.SUCCEEDED):
                _move(out_path, run_id)
                out.say(f"run {run_id} is running detached ({n_tasks} task(s)); 'mgpu-cluster status {run_id}' to "
                        f"watch, 'mgpu-cluster down {run_id}' to stop" if run.state == RunState.RUNNING else
                        f"run {run_id} already succeeded; 'mgpu-cluster logs {run_id}' shows its output")
                return
            if code is not None:
                tail = run.failure.message if run is not None and run.failure else _tail(out_path)
                _move(out_path, run_id)
                err = RunFailed(f"run {run_id} ended before every task was running (exit {code}):\n{tail}")
                err.exit_code = code if code in (1, 2, 130) else 1
                raise err
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop_background(proc)
        raise Interrupted(f"interrupted: run {run_id} was stopped before it was running") from None
    _stop_background(proc)
    raise RunFailed(f"run {run_id} did not reach running within {DETACH_WAIT_S:.0f} s and was stopped; "
                    f"'mgpu-cluster logs {run_id}' shows why")


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-3000:]
    except OSError as exc:
        return f"(its output {path} cannot be read: {exc.strerror or exc})"


def _move(out_path: Path, run_id: str) -> None:
    try:
        os.replace(out_path, record.run_path(run_id) / "launcher.out")
    except OSError:
        pass


def _stop_background(proc: subprocess.Popen) -> None:
    """Ask a background launcher that never got its run going to stop its tasks, as `down` would."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
