"""`status`, `logs` and `down`: recorded runs, read from their record and, when needed, their hosts.

While a run's launcher lives (its pid, started at its recorded time) its record is fresh and is
trusted. When the launcher is gone before recording an end, the hosts are asked, and what they say
is recorded (under the run's lock, which says who writes the record, not whether a launcher lives).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from launcher.run import interrupts, record
from launcher.run.failure import Failure, FailureKind, stop_words
from launcher.run.progress import typed
from launcher.engines import engine_for
from launcher.errors import Interrupted, RunCorrupt, RunFailed, RunNotFound, SpecError
from launcher.run.output import Output
from launcher.specfile import load_spec
from launcher.engines.base import EngineKind, Inspecting, parallel
from launcher.run.tables import plain, render
from worker.host import procs
from launcher.run.states import RunState, TaskState
from worker.protocol import EXIT_PREEMPTED

DOWN_WAIT_S = 60.0
SETTLE_WAIT_S = 5.0


def _engine(run: record.RunRecord) -> Inspecting:
    path = record.run_path(run.run_id) / "spec.toml"
    try:
        spec = load_spec(path, base=Path(run.spec_path).parent)
    except SpecError as exc:
        why = str(exc)[:300] if path.exists() else f"{path} is missing"
        raise RunCorrupt(f"run {run.run_id}: the copy of its spec that the run keeps cannot be used, so its tasks' "
                         f"hosts are unknown ({why}). If its tasks may still run, stop them on their "
                         f"hosts (their folders are under .mgpu/runs/{run.run_id}/); remove {path.parent} when done."
                         ) from None
    engine = engine_for(spec, run.run_id, landed=run)
    if not isinstance(engine, Inspecting):
        engine.close()
        raise RunCorrupt(f"run {run.run_id}: its {engine.kind} engine keeps no tasks that mgpu-cluster can read "
                         f"or stop ({engine.not_started_here()})")
    return engine


def _task_state(row: dict) -> TaskState:
    if row.get("alive"):
        return TaskState.RUNNING
    if row.get("state"):  # an engine that knows better (a task whose Slurm job is still queued)
        return TaskState(row["state"])
    code = row.get("exit_code")
    if code is None:
        return TaskState.LOST
    return {0: TaskState.SUCCEEDED, EXIT_PREEMPTED: TaskState.PREEMPTED}.get(code, TaskState.FAILED)


def settle(run: record.RunRecord, probes: list | None = None) -> tuple[record.RunRecord, list | None]:
    """A run whose launcher is gone without recording the end: ask the hosts, and record what they
    say (as the run's writer, under its lock). Returns the record and the per-task probe results."""
    owner = record.Owner.take(run.run_id, timeout=SETTLE_WAIT_S)  # another `status` may be settling it now
    if owner is None:  # someone (a `down`) is acting on it now: their record is the truth
        return record.load(run.run_id), None
    try:
        run = owner.record
        if run.ended:
            return run, probes
        engine = _engine(run)
        try:
            probes = engine.probe(list(range(len(run.tasks))))
        finally:
            engine.close()
        alive, in_preflight = False, run.state == RunState.PREFLIGHT
        for task, res in zip(run.tasks, probes):
            if not res.ok:
                task.state = TaskState.LOST
                continue
            task.state = _task_state(res.value)
            task.exit_code = res.value.get("exit_code")
            alive |= task.state in (TaskState.RUNNING, TaskState.PENDING)
        if not alive:
            if all(t.state == TaskState.SUCCEEDED for t in run.tasks):
                run.set_state(RunState.SUCCEEDED)
            elif in_preflight:
                run.set_state(RunState.LOST, Failure(kind=FailureKind.NOT_STARTED, message=(
                    f"the launcher of this run (pid {run.agent_pid}) ended during the preflight without recording it "
                    "(killed, or its machine went down); no task was started.")))
            else:
                run.set_state(RunState.LOST, Failure(kind=FailureKind.LOST, message=(
                    f"the launcher of this run (pid {run.agent_pid}) ended without recording how the run ended "
                    "(killed, or its machine went down); its tasks were stopped by their supervisors. The task "
                    "states above are what their hosts say now.")))
            owner.save()
        return run, probes
    finally:
        owner.release()


def snapshot(run: record.RunRecord, probes: list | None = None) -> dict:
    """The run as `status --json` shows it: its record, merged with what each host says when probed."""
    now = time.time()
    tasks = []
    for i, t in enumerate(run.tasks):
        res = probes[i] if probes else None
        row = res.value if res is not None and res.ok else {}
        progress = typed(row.get("progress") or t.progress)  # written by the training: untrusted
        state = _task_state(row) if row and not run.ended else t.state
        code = row.get("exit_code")
        tasks.append({
            "index": t.index, "host": t.host, "port": t.port, "pid": row.get("pid") or t.pid,
            "state": str(state), "exit_code": t.exit_code if code is None else code,
            "restarts": t.restarts, "epoch": progress.get("epoch"), "epochs": progress.get("epochs"),
            "step": progress.get("step"), "global_step": progress.get("global_step"), "loss": progress.get("loss"),
            "metrics": progress.get("metrics") or {}, "samples_per_sec": progress.get("samples_per_sec"),
            "compute_ms": progress.get("compute_ms"), "wait_ms": progress.get("wait_ms"),
            "replicas": progress.get("replicas"),  # in sync over all workers (workers x local replicas)
            "heartbeat_age": round(now - progress["time"], 1) if progress.get("time") else None,
            "cpu_percent": row.get("cpu_percent", t.cpu_percent), "rss": row.get("rss", t.rss),
            "gpu_util": row.get("gpu_util"), "run_dir": t.run_dir,
            "error": str(res.error) if res is not None and not res.ok else None,
        })
    alive = record.launcher_alive(run)
    state = run.state if run.ended or alive else RunState.LOST
    return {"run_id": run.run_id, "state": str(state), "attempt": run.attempt, "restarts": run.restarts,
            "preemptions": run.preemptions, "hosts_lost": run.hosts_lost,
            "failure": run.failure.to_json() if run.failure else None,
            "agent_pid": run.agent_pid, "launcher_alive": alive, "detached": run.detached, "engine": run.engine,
            "attempts": [{"number": a.number, "tasks": a.tasks, "outcome": a.outcome and str(a.outcome),
                          "reason": a.reason, "failure": a.failure.to_json() if a.failure else None,
                          "started_at": a.started_at, "ended_at": a.ended_at} for a in run.attempts],
            "tasks": tasks, "straggler": straggler_json(tasks),
            # a scheduler's job (Slurm: id, state such as pending/running/completed/failed/cancelled, reason)
            "job": next((r.value["job"] for r in probes or [] if r.ok and r.value.get("job")), None)}


def straggler_json(tasks: list[dict]) -> dict | None:
    from launcher.diagnose.straggler import find

    found = find({t["index"]: t["compute_ms"] for t in tasks})
    return found.to_json() if found else None


def status(run_id: str | None, as_json: bool = False, watch: bool = False, probe: bool = False) -> None:
    out = Output(threaded=False)
    run = record.load(run_id)
    live = None
    if watch and not as_json and out.console.is_terminal:
        from rich.live import Live

        live = Live(console=out.console, auto_refresh=False)  # redrawn in place
        live.start()
    try:
        while True:
            probes = None
            if not run.ended and not record.launcher_alive(run):
                run, probes = settle(run)
            elif probe or run.engine == EngineKind.SLURM:  # asking Slurm and a shared folder is cheap
                engine = _engine(run)
                try:
                    probes = engine.probe(list(range(len(run.tasks))))
                finally:
                    engine.close()
            snap = snapshot(run, probes)
            if as_json:
                print(json.dumps(snap), flush=True)
            elif live is not None:
                live.update(render(snap, out.console.width), refresh=True)
            elif out.console.is_terminal:
                out.show(render(snap, out.console.width))
            else:
                print(plain(snap), flush=True)
            if not watch or RunState(snap["state"]).ended:
                return
            time.sleep(2.0)
            run = record.load(run.run_id)
    finally:
        if live is not None:
            live.stop()


def logs(run_id: str | None, task: int | None = None, follow: bool = False, tail: int | None = None) -> None:
    run = record.load(run_id)
    chosen = [t.index for t in run.tasks if task is None or t.index == task]
    if not chosen:
        raise RunNotFound(f"run {run.run_id} has no task {task}; it has tasks 0..{len(run.tasks) - 1}")
    engine = _engine(run)
    out = Output(threaded=False)
    offsets = {i: 0 for i in chosen}
    first, last_round = True, False
    try:
        while True:
            results = parallel(lambda i, n=tail if first else None: engine.read_log(i, offsets[i], n), chosen)
            failed = []
            for i, res in zip(chosen, results):
                if not res.ok:
                    failed.append(res.error)
                    continue
                text, offsets[i] = res.value
                lines = text.splitlines()
                if len(chosen) > 1:
                    out.task_lines(i, run.tasks[i].host, lines)
                else:
                    for line in lines:
                        print(line)
            if failed:
                raise failed[0] if len(failed) == 1 else RunFailed(
                    "cannot read the logs of some tasks:\n  " + "\n  ".join(map(str, failed)))
            first = False
            if not follow or last_round:
                return
            run = record.load(run.run_id)
            # the run ended, or its launcher is gone: one more read for the last lines, then stop
            last_round = run.ended or not record.launcher_alive(run)
            time.sleep(0.2 if last_round else 0.5)
    finally:
        engine.close()


def _ask_launcher(run: record.RunRecord, out: Output) -> None:
    """Ask the run's live launcher to stop every task, and wait until it has (it records the end)."""
    proc = procs.same(run.agent_pid, run.agent_create_time)
    if proc is None:
        return
    try:  # how the launcher tells `down` from a Ctrl-C; on a full MGPU_HOME it stops all the same
        (record.run_path(run.run_id) / "down.request").write_text(f"{os.getpid()}\n")
    except OSError:
        pass
    out.say(f"asking the launcher of run {run.run_id} (pid {proc.pid}) to stop every task")
    proc.send_signal(signal.SIGTERM)
    deadline = time.time() + DOWN_WAIT_S
    while record.launcher_alive(run) and time.time() < deadline:
        time.sleep(0.1)


def down(run_id: str | None) -> None:
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
        engine = _engine(run)
        try:  # make sure from the tasks' folders, also after the launcher's own teardown
            results = engine.stop_from_folders(list(range(len(run.tasks))))
        finally:
            engine.close()
        unreached = [i for i, r in enumerate(results) if not r.ok]
        problems = [f"{engine.plan[i].label}: {results[i].error}" for i in unreached]
        for t in run.tasks:
            if t.state in (TaskState.PENDING, TaskState.RUNNING):  # one we could not reach may still run
                t.state = TaskState.LOST if t.index in unreached else TaskState.STOPPED
        if not run.ended:
            words = stop_words([str(t.index) for t in run.tasks if t.index not in unreached],
                               [engine.plan[i].label for i in unreached], engine.spec.launch.lifeline)
            run.set_state(RunState.STOPPED, Failure(kind=FailureKind.STOPPED,
                                                    message=f"stopped by 'mgpu-cluster down'; {words}"))
        owner.save()
    finally:
        owner.release()
    if problems:
        raise RunFailed("some tasks could not be reached to stop them:\n  " + "\n  ".join(problems)
                        + "\nCheck that their hosts are up, then run 'mgpu-cluster down' again.")
    out.say(f"run {run.run_id}: every task is stopped")
