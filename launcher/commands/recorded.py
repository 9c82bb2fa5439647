"""`status`, `logs` and `down`: recorded runs, read from their record and, when needed, their hosts.

While a run's launcher lives (its pid, started at its recorded time) its record is fresh and is
trusted. When the launcher is gone before recording an end, the hosts are asked, and what they say
is recorded (under the run's lock, which says who writes the record, not whether a launcher lives).
Reading never needs writing: on a read-only or full MGPU_HOME they show what is known and say what
could not be recorded.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from typing import Any
from dataclasses import dataclass
from pathlib import Path

from launcher.run import files, interrupts, record
from launcher.run.home import run_folder
from launcher.run.failure import Failure, FailureKind, stop_words
from launcher.run.logs import never_started, show
from launcher.engines import engine_for
from launcher.errors import HomeError, Interrupted, RunCorrupt, RunFailed, RunNotFound, SpecError
from launcher.run.output import Output
from launcher.spec.file import load_spec
from launcher.engines.base import EngineKind, Inspecting, ProbeRow, Result
from launcher.run.tables import plain, render
from launcher.run.view import EXITED, snapshot, task_now
from worker.host import layout, procs
from worker.host.clock import wait_until
from worker.host.system import free_space
from launcher.run.states import RunState, TaskState

DOWN_WAIT_S = 60.0
SETTLE_WAIT_S = 5.0
WATCH_S = 2.0  # status --watch: seconds between frames
LIVE = (TaskState.PENDING, TaskState.RUNNING)


def inspector(run: record.RunRecord) -> Inspecting:
    path = run_folder(run.run_id) / "spec.toml"
    try:
        files.read_file(path)  # the copy is untrusted bytes too: a regular file, of a bounded size
        spec = load_spec(path, base=Path(run.spec_path).parent)
    except (SpecError, RunCorrupt, FileNotFoundError) as exc:
        why = f"{path} is missing" if isinstance(exc, FileNotFoundError) else str(exc)[:300]
        raise RunCorrupt(f"run {run.run_id}: the copy of its spec that the run keeps cannot be used, so its tasks' "
                         f"hosts are unknown ({why}). If its tasks may still run, stop them on their "
                         f"hosts (their folders are under {layout.run_root('', run.run_id)}/); remove {path.parent} when done."
                         ) from None
    engine = engine_for(spec, run.run_id, landed=run)
    if not isinstance(engine, Inspecting):
        engine.close()
        raise RunCorrupt(f"run {run.run_id}: its {engine.kind} engine keeps no tasks that mgpu-cluster can read "
                         f"or stop ({engine.not_started_here()})")
    return engine


def _probe(run: record.RunRecord, engine: Inspecting | None = None) -> list[Result[ProbeRow]]:
    """What every task's host says now, hosts asked at once (`engine`: one kept open, by `status --watch`)."""
    if engine is not None:
        return engine.probe([t.index for t in run.tasks])
    engine = inspector(run)
    try:
        return engine.probe([t.index for t in run.tasks])
    finally:
        engine.close()


@dataclass
class Seen:
    """A run as `status` shows it: its record, what its hosts said (None: not asked), and why what they said
    could not be recorded (a read-only or full MGPU_HOME), if it could not."""

    run: record.RunRecord
    probes: list[Result[ProbeRow]] | None = None
    unrecorded: str | None = None


def settle(run: record.RunRecord) -> Seen:
    """A run whose launcher is gone without recording the end: ask the hosts, and record what they
    say (as the run's writer, under its lock)."""
    owner = record.Owner.take(run.run_id, timeout=SETTLE_WAIT_S)  # another `status` may be settling it now
    if owner is None:  # someone (a `down`) is acting on it now: their record is the truth
        return Seen(record.load(run.run_id))
    try:
        run = owner.record
        if run.ended:
            return Seen(run)
        probes = _probe(run)
        for task, res in zip(run.tasks, probes):
            if res.value is not None:
                task.seen(task_now(task.state, res.value), res.value.exit_code)
            elif task.state not in EXITED:
                task.seen(TaskState.LOST)
        if not any(t.state in LIVE for t in run.tasks):
            _end(run, record.unsaved(run.run_id))
        if owner.save():
            return Seen(run, probes)
        return Seen(run, probes, f"run {run.run_id}: what its hosts say could not be recorded: {_cannot_write(owner)}; "
                                 "shown here as the record and the hosts say it now. Make MGPU_HOME writable (or free "
                                 f"space there), then 'mgpu-cluster status {run.run_id}' records it.")
    finally:
        owner.release()


def _cannot_write(owner: record.Owner) -> str:
    path, exc = run_folder(owner.record.run_id) / record.STATE, owner.error
    if exc is None:
        return f"cannot write {path}"
    room = f" ({free_space(path)} there)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return f"cannot write {path}: {exc.strerror or exc}{room}"


def _end(run: record.RunRecord, note: dict[str, Any] | None) -> None:  # Any: the room's JSON, read with care
    """The end of a run none of whose tasks runs any more, as its hosts say; when its launcher could not write
    its record, what it noted in the room kept for that (record.UNSAVED) is said with it."""
    if all(t.state == TaskState.SUCCEEDED for t in run.tasks):
        return run.set_state(RunState.SUCCEEDED)
    who = f"the launcher of this run (pid {run.agent_pid})"
    if note:
        try:
            at = time.strftime("%H:%M:%S", time.localtime(note.get("at", "?")))  # a file: any value may be there
        except (TypeError, ValueError, OverflowError, OSError):
            at = "?"
        said = str(note.get("failure") or "")[:2000]
        return run.set_state(RunState.LOST, Failure(kind=FailureKind.LOST, message=(
            f"{who} could not record how the run ended: it could not write {record.STATE} "
            f"({str(note.get('error'))[:200]}). Its last note ({record.UNSAVED}, at {at}) says the run was "
            f"{str(note.get('state'))[:20]}{': ' + said if said else ''}\nThe task states above are what their hosts "
            "say now.")))
    if run.state == RunState.PREFLIGHT:
        return run.set_state(RunState.LOST, Failure(kind=FailureKind.NOT_STARTED, message=(
            f"{who} ended during the preflight without recording it (killed, or its machine went down); no task "
            "was started.")))
    run.set_state(RunState.LOST, Failure(kind=FailureKind.LOST, message=(
        f"{who} ended without recording how the run ended (killed, or its machine went down); its tasks were "
        "stopped by their supervisors. The task states above are what their hosts say now.")))


def look(run: record.RunRecord, probe: bool = False, engine: Inspecting | None = None) -> Seen:
    """A run as `status` sees it now: settled with its hosts when its launcher is gone without recording the
    end; else probed when asked (`engine`: probed with it), and always on Slurm (asking Slurm and a shared
    folder is cheap)."""
    if not run.ended and not record.launcher_alive(run):
        return settle(run)
    if probe or engine is not None or run.engine == EngineKind.SLURM:
        return Seen(run, _probe(run, engine))
    return Seen(run)


def status(run_id: str, as_json: bool = False, watch: bool = False, probe: bool = False) -> None:
    """`status`; with `watch`, a frame every WATCH_S until the run ends, each read at one moment: every task's
    host asked at once (its progress.json, its process), not the record's rows, which arrive seconds apart."""
    out = Output(threaded=False)
    run = record.load(run_id)
    live = engine = None
    if watch and not as_json and out.console.is_terminal:
        from rich.live import Live

        live = Live(console=out.console, auto_refresh=False)  # redrawn in place
        live.start()
    try:
        while True:
            frame_at = time.monotonic()  # a frame every WATCH_S, however long reading the run took
            if watch and engine is None and not run.ended and record.launcher_alive(run):
                engine = inspector(run)  # kept for every frame (one SSH connection per host, not one a frame)
            seen = look(run, probe, engine)
            run = seen.run
            snap = snapshot(run, seen.probes)
            snap["unrecorded"] = seen.unrecorded
            if as_json:
                print(json.dumps(snap, allow_nan=False), flush=True)
            elif live is not None:
                live.update(render(snap, out.console.width), refresh=True)
            elif out.console.is_terminal:
                out.show(render(snap, out.console.width))
            else:
                print(plain(snap), flush=True)
            if seen.unrecorded:
                print(f"note: {seen.unrecorded}", file=sys.stderr, flush=True)
            if not watch or run.ended:
                return
            time.sleep(max(0.0, frame_at + WATCH_S - time.monotonic()))
            run = record.load(run.run_id)
    finally:
        if engine is not None:
            engine.close()
        if live is not None:
            live.stop()


def logs(run_id: str, task: int | None = None, follow: bool = False, tail: int | None = None) -> None:
    run = record.load(run_id)
    chosen = [t.index for t in run.tasks if task is None or t.index == task]
    if not chosen:
        raise RunNotFound(f"run {run.run_id} has no task {task}; it has tasks 0..{len(run.tasks) - 1}")
    run = never_started(run, follow)
    engine = inspector(run)
    try:
        show(run, engine, chosen, follow, tail)
    finally:
        engine.close()


def _ask_launcher(run: record.RunRecord, out: Output) -> None:
    """Ask the run's live launcher to stop every task, and wait until it has (it records the end)."""
    proc = procs.same(run.agent_pid, run.agent_create_time)
    if proc is None:
        return
    try:  # how the launcher tells `down` from a Ctrl-C; on a full MGPU_HOME it stops all the same
        (run_folder(run.run_id) / "down.request").write_text(f"{os.getpid()}\n")
    except OSError:
        pass
    out.say(f"asking the launcher of run {run.run_id} (pid {proc.pid}) to stop every task")
    proc.send_signal(signal.SIGTERM)
    wait_until(lambda: not record.launcher_alive(run), DOWN_WAIT_S, 0.1)


def down(run_id: str) -> None:
    run = record.load(run_id)
    try:
        _down(run)
    except KeyboardInterrupt:
        raise Interrupted(f"{interrupts.reason()} during 'mgpu-cluster down': tasks of run {run.run_id} may still "
                          f"run; run 'mgpu-cluster down {run.run_id}' again") from None


def _down(run: record.RunRecord) -> None:
    out = Output(threaded=False)
    if record.launcher_alive(run):
        _ask_launcher(run, out)
    owner = record.Owner.take(run.run_id, timeout=DOWN_WAIT_S)
    if owner is None:
        raise RunFailed(f"run {run.run_id}: its launcher (pid {run.agent_pid}) still holds the run after "
                        f"{DOWN_WAIT_S:.0f} s; try 'mgpu-cluster down {run.run_id}' again, or stop that process.")
    try:
        run = owner.record
        engine = inspector(run)
        try:  # make sure from the tasks' folders, also after the launcher's own teardown
            results = engine.stop_from_folders([t.index for t in run.tasks])
        finally:
            engine.close()
        unreached = [t.index for t, r in zip(run.tasks, results) if not r.ok]
        problems = [f"{engine.plan[t.index].label}: {r.error}" for t, r in zip(run.tasks, results) if not r.ok]
        for t in run.tasks:
            if t.state in LIVE:  # one we could not reach may still run
                t.ended(TaskState.LOST if t.index in unreached else TaskState.STOPPED, time.time())
        if not run.ended:
            words = stop_words([str(t.index) for t in run.tasks if t.index not in unreached],
                               [engine.plan[i].label for i in unreached], engine.spec.launch.lifeline)
            run.set_state(RunState.STOPPED, Failure(kind=FailureKind.STOPPED,
                                                    message=f"stopped by 'mgpu-cluster down'; {words}"))
        unrecorded = None if owner.save() else _cannot_write(owner)  # an ended run's has nothing new to write
    finally:
        owner.release()
    if problems:
        raise RunFailed("some tasks could not be reached to stop them:\n  " + "\n  ".join(problems)
                        + "\nCheck that their hosts are up, then run 'mgpu-cluster down' again."
                        + (f"\nNor could this be recorded: {unrecorded}." if unrecorded else ""))
    if unrecorded:
        raise HomeError(f"run {run.run_id}: every task is stopped, but that could not be recorded: {unrecorded}. "
                        f"Make MGPU_HOME writable (or free space there), then run 'mgpu-cluster down {run.run_id}' "
                        "again to record it.")
    out.say(f"run {run.run_id}: every task is stopped")
