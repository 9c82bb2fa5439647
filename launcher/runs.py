"""`status`, `logs` and `down`: recorded runs, read from disk and from their hosts."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
from rich.table import Table

from launcher import state as runstate
from launcher.errors import RunFailed, RunNotFound
from launcher.output import Output
from launcher.plan import plan_tasks
from launcher.spec import load_spec
from launcher.transport import parallel, transports_for

ENDED = ("succeeded", "failed", "stopped")


def _context(run_id: str | None):
    run = runstate.load(run_id)
    spec = load_spec(runstate.run_path(run.run_id) / "spec.toml")
    return run, spec, plan_tasks(spec, run.run_id)


def _close(transports) -> None:
    for t in set(transports):
        t.close()


def agent_alive(run: runstate.RunState) -> bool:
    if not run.agent_pid:
        return False
    try:
        proc = psutil.Process(run.agent_pid)
        return proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= run.created_at + 1
    except psutil.Error:
        return False


def _probe_all(plans, transports) -> list[dict]:
    by_transport: dict = {}
    for plan, t in zip(plans, transports):
        by_transport.setdefault(t, []).append(plan)
    groups = list(by_transport.items())
    results = parallel(lambda g: g[0].probe(g[1]), groups)
    found: dict[int, dict] = {}
    for (t, group), res in zip(groups, results):
        for plan, row in zip(group, res if isinstance(res, list) else [None] * len(group)):
            found[plan.index] = row if row else {"error": str(res)}
    return [found[p.index] for p in plans]


def _recorded(run: runstate.RunState) -> list[dict]:
    """What the agent recorded in state.json, shaped like probe rows (its supervisors relay it all)."""
    return [{"pid": t.pid, "exit_code": t.exit_code, "progress": t.progress, "cpu_percent": t.cpu_percent,
             "rss": t.rss, "alive": t.state == "running"} for t in run.tasks]


def snapshot(run: runstate.RunState, probes: list[dict] | None = None) -> dict:
    """The run as `status --json` shows it: state.json, merged with what each host says when probed."""
    live = run.state not in ENDED
    agent = agent_alive(run)
    now = time.time()
    tasks = []
    for t, probe in zip(run.tasks, probes or _recorded(run)):
        state = t.state
        progress = probe.get("progress") or t.progress or {}
        if live and probes is not None:
            if probe.get("alive"):
                state = "running" if agent else "lost"
            elif probe.get("exit_code") is not None:
                state = "succeeded" if probe["exit_code"] == 0 else "failed"
            elif "error" in probe or (not agent and state in ("pending", "running")):
                state = "lost"
        elif live and not agent and state in ("pending", "running"):
            state = "lost"
        code = probe.get("exit_code")
        tasks.append({
            "index": t.index, "host": t.host, "port": t.port, "pid": probe.get("pid") or t.pid,
            "state": state, "exit_code": t.exit_code if code is None else code,
            "restarts": t.restarts, "epoch": progress.get("epoch"), "epochs": progress.get("epochs"),
            "step": progress.get("step"), "global_step": progress.get("global_step"), "loss": progress.get("loss"),
            "metrics": progress.get("metrics") or {}, "samples_per_sec": progress.get("samples_per_sec"),
            "heartbeat_age": round(now - progress["time"], 1) if progress.get("time") else None,
            "cpu_percent": probe.get("cpu_percent"), "rss": probe.get("rss"), "gpu_util": probe.get("gpu_util"),
            "run_dir": t.run_dir, "error": probe.get("error"),
        })
    state = "lost" if live and not agent else run.state
    return {"run_id": run.run_id, "state": state, "attempt": run.attempt, "failure": run.failure,
            "agent_pid": run.agent_pid, "detached": run.detached, "tasks": tasks}


def _table(snap: dict) -> Table:
    table = Table(title=f"run {snap['run_id']}: {snap['state']}")
    for col in ("task", "host", "pid", "state", "epoch", "step", "loss", "samples/s", "heartbeat", "cpu%", "rss MB"):
        table.add_column(col)
    fmt = lambda v, f="{}": "" if v is None else f.format(v)  # noqa: E731
    for t in snap["tasks"]:
        epoch = f"{t['epoch']}/{t['epochs']}" if t["epoch"] is not None else ""
        table.add_row(str(t["index"]), f"{t['host']}:{t['port']}", fmt(t["pid"]), t["state"], epoch, fmt(t["step"]),
                      fmt(t["loss"], "{:.4f}"), fmt(t["samples_per_sec"], "{:.0f}"), fmt(t["heartbeat_age"], "{} s ago"),
                      fmt(t["cpu_percent"]), fmt(t["rss"] and t["rss"] // 2**20))
    return table


def status(run_id: str | None, as_json: bool = False, watch: bool = False, probe: bool = False) -> None:
    """A live agent keeps state.json fresh (progress, CPU, RSS relayed by the supervisors), so the
    hosts are asked directly only with `probe`, or when the agent is gone and the run not ended."""
    run, spec, plans = _context(run_id)
    out = Output()
    transports = []
    try:
        while True:
            probes = None
            if probe or (run.state not in ENDED and not agent_alive(run)):
                transports = transports or transports_for(spec, plans)
                probes = _probe_all(plans, transports)
            snap = snapshot(run, probes)
            if as_json:
                print(json.dumps(snap), flush=True)
            else:
                out.console.print(_table(snap))
                if snap["failure"]:
                    out.console.print(snap["failure"], markup=False)
            if not watch or snap["state"] in ENDED + ("lost",):
                return
            time.sleep(2.0)
            run = runstate.load(run.run_id)
    finally:
        _close(transports)


def logs(run_id: str | None, task: int | None = None, follow: bool = False, tail: int | None = None) -> None:
    run, spec, plans = _context(run_id)
    transports = transports_for(spec, plans)
    chosen = [p for p in plans if task is None or p.index == task]
    if not chosen:
        raise RunNotFound(f"run {run.run_id} has no task {task}; it has tasks 0..{len(plans) - 1}")
    out = Output()
    offsets = {p.index: 0 for p in chosen}
    first = True
    try:
        while True:
            def fetch(p, first=first):  # every host at once; each one's outcome kept
                path = f"{p.run_dir}/worker.log"
                if first and tail is not None:
                    argv = ["tail", "-n", str(tail), path]
                else:
                    argv = ["tail", "-c", f"+{offsets[p.index] + 1}", path]
                code, text, _err = transports[p.index].call(p, argv, 30)
                size = None
                if code == 0 and text and first and tail is not None:
                    size = transports[p.index].call(p, ["stat", "-c", "%s", path], 30)[1]
                return code, text, size

            failed = []
            for p, res in zip(chosen, parallel(fetch, chosen)):
                if isinstance(res, Exception):
                    failed.append(res)
                    continue
                code, text, size = res
                if code == 0 and text:
                    if size is not None:
                        offsets[p.index] = int(size.strip() or 0)
                    else:
                        offsets[p.index] += len(text.encode())
                    for line in text.splitlines():
                        if len(chosen) > 1:
                            out.task_line(p, line)
                        else:
                            print(line)
            if failed:
                raise failed[0] if len(failed) == 1 else RunFailed(
                    "cannot read the logs of some tasks:\n  " + "\n  ".join(map(str, failed)))
            first = False
            if not follow or runstate.load(run.run_id).state in ENDED and not agent_alive(run):
                return
            time.sleep(0.5)
    finally:
        _close(transports)


def down(run_id: str | None) -> None:
    run, spec, plans = _context(run_id)
    transports = transports_for(spec, plans)
    out = Output()
    try:
        if agent_alive(run) and run.agent_pid != os.getpid():
            out.say(f"asking the launcher of run {run.run_id} (pid {run.agent_pid}) to stop every task")
            os.kill(run.agent_pid, signal.SIGTERM)
            deadline = time.time() + 30
            while agent_alive(run) and time.time() < deadline:  # a zombie counts as gone
                time.sleep(0.1)
            if agent_alive(run):
                out.say("the launcher did not stop within 30 s; stopping the tasks directly")
        results = parallel(lambda pt: pt[1].stop_tasks([pt[0]]), list(zip(plans, transports)))
        run = runstate.load(run.run_id)
        problems = [f"{p.label}: {r}" for p, r in zip(plans, results) if isinstance(r, Exception)]
        for t in run.tasks:
            if t.state in ("pending", "running"):
                t.state = "stopped"
        if run.state not in ENDED:
            run.state, run.failure = "stopped", "stopped by 'mgpu-cluster down'"
            run.ended_at = time.time()
        runstate.save(run)
        if problems:
            raise RunFailed("some tasks could not be reached to stop them:\n  " + "\n  ".join(problems)
                            + "\nCheck that their hosts are up, then run 'mgpu-cluster down' again.")
        out.say(f"run {run.run_id}: every task is stopped")
    finally:
        _close(transports)
