"""`check` and `up`: spec -> plan -> preflight -> agent, with the run recorded on disk."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from launcher import state as runstate
from launcher.agent import Agent
from launcher.errors import Interrupted, PreflightError, RunFailed, RunNotFound
from launcher.output import Output
from launcher.plan import mask_env, plan_tasks
from launcher.preflight import TaskCheck, preflight
from launcher.spec import ClusterSpec, load_spec
from launcher.transport import transports_for

DETACH_WAIT_S = 300.0


def checks_table(checks: list[TaskCheck]) -> Table:
    table = Table(title="preflight")
    for col in ("task", "host", "port", "python", "result"):
        table.add_column(col)
    for c in checks:
        result = "[green]ok[/]" if c.ok else "[red]" + escape("\n".join(c.problems)) + "[/]"
        table.add_row(str(c.plan.index), c.plan.host.label, str(c.plan.host.port), c.plan.python, result)
    return table


def run_preflight(spec: ClusterSpec, plans, transports, out: Output, base: Path | None = None) -> None:
    checks = preflight(spec, plans, transports, base=base, say=out.say)
    out.console.print(checks_table(checks))
    bad = [c for c in checks if not c.ok]
    if bad:
        lines = "\n".join(f"  {c.plan.label}: {'; '.join(c.problems)}" for c in bad)
        raise PreflightError(f"preflight refused the cluster, nothing was started:\n{lines}\n"
                             "Fix these (free the port, correct the spec or the host) and run again.")


def check(spec_path: Path) -> None:
    spec = load_spec(spec_path)
    plans = plan_tasks(spec, "check")
    transports = transports_for(spec, plans)
    try:
        run_preflight(spec, plans, transports, Output(), base=Path(spec_path).parent)
    finally:
        for t in set(transports):
            t.close()


def print_dry_run(plans, out: Output) -> None:
    for p in plans:
        where = "local process" if p.host.is_local else f"ssh {p.host.user + '@' if p.host.user else ''}{p.host.address}"
        out.console.print(f"[bold]{p.label}[/] via {where}")
        out.console.print(f"  folder:  {p.cwd or ('(login folder)' if not p.host.is_local else os.getcwd())}")
        out.console.print(f"  run dir: {p.run_dir}")
        out.console.print(f"  command: {shlex.join(p.supervisor_argv(0))}", markup=False)
        for k, v in mask_env(p.env).items():
            out.console.print(f"  env {k}={v}", markup=False)


def up(spec_path: Path, detach: bool = False, dry_run: bool = False, quiet: bool = False,
       run_id: str | None = None) -> None:
    spec = load_spec(spec_path)
    background = run_id is not None  # started by `up --detach`
    run_id = run_id or runstate.new_run_id()
    plans = plan_tasks(spec, run_id)
    if dry_run:
        return print_dry_run(plans, Output())
    if detach:
        return start_detached(spec_path, run_id, plans)
    run_folder = runstate.run_path(run_id)
    run_folder.mkdir(parents=True, exist_ok=True)
    out = Output(quiet=quiet, log_path=run_folder / "launcher.log")
    transports = transports_for(spec, plans)
    run = runstate.RunState(
        run_id=run_id, spec_path=str(Path(spec_path).resolve()), agent_pid=os.getpid(), detached=background,
        tasks=[runstate.TaskState(index=p.index, host=p.host.label, address=p.host.address, port=p.host.port,
                                  run_dir=p.run_dir) for p in plans],
    )
    shutil.copyfile(spec_path, run_folder / "spec.toml")
    signal.signal(signal.SIGTERM, _raise_interrupt)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, _raise_interrupt)
    t0 = time.time()
    try:
        out.say(f"run {run_id}: {len(plans)} task(s); checking hosts and ports")
        try:
            run_preflight(spec, plans, transports, out, base=Path(spec_path).parent)
        except PreflightError:
            run.state, run.failure = "failed", "preflight refused"
            runstate.save(run)
            raise
        run.phases["preflight_s"] = round(time.time() - t0, 3)
        out.say(f"starting {len(plans)} task(s); logs in {run_folder}")
        Agent(spec, plans, transports, run, out).execute()
    except (RunFailed, Interrupted):
        summary(run, out)
        raise
    finally:
        for t in set(transports):
            t.close()
    summary(run, out)
    out.say(f"run {run_id} succeeded in {time.time() - t0:.1f} s")


def _raise_interrupt(signum, _frame):
    raise Interrupted(f"interrupted by {signal.Signals(signum).name}")


def start_detached(spec_path: Path, run_id: str, plans) -> None:
    """Run the same `up` in the background (own session); return once every task runs."""
    folder = runstate.run_path(run_id)
    folder.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "launcher", "up", str(spec_path), "--quiet", "--run-id", run_id]
    with open(folder / "launcher.out", "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    out = Output()
    deadline = time.time() + DETACH_WAIT_S
    try:
        while time.time() < deadline:
            code = proc.poll()
            try:
                run = runstate.load(run_id)
            except RunNotFound:  # not written yet
                run = None
            if run and run.state == "running":
                out.say(f"run {run_id} is running detached ({len(plans)} task(s)); "
                        f"'mgpu-cluster status {run_id}' to watch, 'mgpu-cluster down {run_id}' to stop")
                return
            if code is not None:
                tail = (folder / "launcher.out").read_text(errors="replace")[-3000:]
                err = RunFailed(f"run {run_id} ended before every task was running (exit {code}):\n{tail}")
                err.exit_code = code if code in (1, 2) else 1
                raise err
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop_background(proc)
        raise Interrupted(f"interrupted: run {run_id} was stopped before it was running") from None
    _stop_background(proc)
    raise RunFailed(f"run {run_id} did not reach running within {DETACH_WAIT_S:.0f} s and was stopped; "
                    f"'mgpu-cluster logs {run_id}' shows why")


def _stop_background(proc: subprocess.Popen) -> None:
    """Ask a background agent that never got its run going to stop its tasks, as `down` would."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def summary(run: runstate.RunState, out: Output) -> None:
    table = Table(title=f"run {run.run_id}: {run.state}")
    for col in ("task", "host", "state", "exit", "epochs", "metrics", "wall s"):
        table.add_column(col)
    for t in run.tasks:
        p = t.progress or {}
        metrics = " ".join(f"{k}={v:.4g}" for k, v in (p.get("metrics") or {}).items() if isinstance(v, (int, float)))
        wall = f"{t.ended_at - t.started_at:.1f}" if t.started_at and t.ended_at else ""
        epochs = f"{p['epoch']}/{p['epochs']}" if p.get("epoch") and p.get("epochs") else ""
        table.add_row(str(t.index), f"{t.host}:{t.port}", t.state, "" if t.exit_code is None else str(t.exit_code),
                      epochs, metrics, wall)
    out.console.print(table)
    ph = run.phases
    parts = []
    if "preflight_s" in ph:
        parts.append(f"preflight {ph['preflight_s']:.2f} s")
    if "all_started" in ph and "spawn_started" in ph:
        parts.append(f"spawn {ph['all_started'] - ph['spawn_started']:.2f} s")
    if "first_step" in ph and "spawn_started" in ph:
        parts.append(f"to first step {ph['first_step'] - ph['spawn_started']:.2f} s")
    if "first_step" in ph and "end" in ph:
        parts.append(f"training {ph['end'] - ph['first_step']:.2f} s")
    if parts:
        out.say("phases: " + ", ".join(parts))
