"""`check` and `up`: spec -> plan -> record -> port claims -> preflight -> agent."""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

from launcher import interrupts, record
from launcher.agent import Agent
from launcher.engines import engine_for
from launcher.errors import Interrupted, PreflightError, RunFailed
from launcher.output import Output
from launcher.plan import mask_env, plan_tasks
from launcher.spec import load_spec
from launcher.tables import checks_table, summary
from worker.protocol import RunState


def refuse(checks) -> None:
    bad = [c for c in checks if not c.ok]
    if bad:
        lines = "\n".join(f"  {c.plan.label}: {'; '.join(c.problems)}" for c in bad)
        raise PreflightError(f"preflight refused the cluster, nothing was started:\n{lines}\n"
                             "Fix these (free the port, correct the spec or the host) and run again.")


def check(spec_path: Path) -> None:
    spec = load_spec(spec_path)
    plans = plan_tasks(spec, "check")
    engine = engine_for(spec, plans)
    out = Output(threaded=False)
    try:
        checks = engine.preflight(Path(spec_path).parent, out.say)
        out.show(checks_table(checks))
        refuse(checks)
    finally:
        engine.close()


def print_dry_run(plans, out: Output) -> None:
    for p in plans:
        where = "local process" if p.host.is_local else f"ssh {p.host.user + '@' if p.host.user else ''}{p.host.address}"
        out.console.print(f"[bold]{p.label}[/] via {where}")
        out.console.print(f"  folder:  {p.cwd or ('(login folder)' if not p.host.is_local else os.getcwd())}")
        out.console.print(f"  run dir: {p.run_dir}")
        out.console.print(f"  command: {shlex.join(p.supervisor_argv(0))}", markup=False)
        for k, v in mask_env(p.env).items():
            out.console.print(f"  env {k}={v}", markup=False)


def up(spec_path: Path, detach: bool = False, dry_run: bool = False, quiet: bool = False, verbose: bool = False,
       run_id: str | None = None) -> None:
    spec = load_spec(spec_path)
    background = run_id is not None  # started by `up --detach`
    run_id = run_id or record.new_run_id()
    plans = plan_tasks(spec, run_id)
    if dry_run:
        if spec.slurm is not None:  # the batch script, as it would be submitted
            from launcher.engines.slurm import print_dry_run as slurm_dry_run

            return slurm_dry_run(spec, plans, Output(threaded=False))
        return print_dry_run(plans, Output(threaded=False))
    if detach:
        from launcher.detach import start_detached

        return start_detached(spec_path, run_id, len(plans), verbose)
    owner = record.Owner.create(run_id, spec_path, plans, detached=background)
    run = owner.record
    out = Output(quiet=quiet, verbose=verbose, log_path=record.run_path(run_id) / "launcher.log")
    engine = engine_for(spec, plans)
    run.engine = engine.kind
    claims: list[record.Lock] = []
    t0 = time.time()
    try:
        out.say(f"run {run_id}: {len(plans)} task(s); checking hosts and ports")
        if spec.slurm is None:  # with Slurm, the nodes (and so the host:port pairs) are Slurm's choice
            claims = record.claim_ports(run_id, plans)
        checks = engine.preflight(Path(spec_path).parent, out.say, for_start=True)
        out.show(checks_table(checks))
        refuse(checks)
        run.phases["preflight_s"] = round(time.time() - t0, 3)
        out.say(f"starting {len(plans)} task(s); logs in {record.run_path(run_id)}")
        agent = Agent(spec, plans, engine, owner, out)
        try:
            agent.execute()
        finally:
            engine = agent.engine  # an elastic run may have moved to fewer hosts
        if interrupts.pending():
            raise Interrupted(f"interrupted by {interrupts.pending()} while the run ended")
        out.show(summary(run, out.console.width))
        out.say(phases(run))
        out.say(f"run {run_id} succeeded in {time.time() - t0:.1f} s")
    except (PreflightError, KeyboardInterrupt) as exc:  # before any task started
        with interrupts.shield():
            if run.state == RunState.PREFLIGHT:
                stopped = isinstance(exc, KeyboardInterrupt)
                run.state = RunState.STOPPED if stopped else RunState.FAILED
                run.failure = (f"{interrupts.reason()} during the preflight; nothing was started" if stopped
                               else "preflight refused: " + str(exc))
                run.ended_at = time.time()
                owner.save()
        if isinstance(exc, KeyboardInterrupt):
            raise Interrupted(run.failure) from None
        raise
    except (RunFailed, Interrupted):
        out.show(summary(run, out.console.width))
        out.say(phases(run))
        raise
    finally:
        with interrupts.shield():
            engine.close()
            for claim in claims:
                claim.release()
            owner.release()
            if not out.close(timeout=5.0):
                out.logline("the terminal did not take the last lines within 5 s; they are in this log")


def phases(run) -> str:
    ph, parts = run.phases, []
    if "preflight_s" in ph:
        parts.append(f"preflight {ph['preflight_s']:.2f} s")
    if "all_started" in ph and "spawn_started" in ph:
        parts.append(f"spawn {ph['all_started'] - ph['spawn_started']:.2f} s")
    if "first_step" in ph and "spawn_started" in ph:
        parts.append(f"to first step {ph['first_step'] - ph['spawn_started']:.2f} s")
    if "first_step" in ph and "end" in ph:
        parts.append(f"training {ph['end'] - ph['first_step']:.2f} s")
    return "phases: " + (", ".join(parts) or "none recorded")
