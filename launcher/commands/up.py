"""`check` and `up`: spec -> plan -> record -> port claims -> preflight -> agent."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from launcher.run import interrupts, record
from launcher.run.home import new_run_id, run_folder
from launcher.run.agent import Agent
from launcher.engines import engine_for
from launcher.plan import cold_words
from launcher.engines.base import Claim, Engine, Launching, TaskCheck
from launcher.errors import HomeError, Interrupted, PreflightError, RunFailed, SpecError
from launcher.run.failure import Failure, FailureKind
from launcher.run.output import Output
from launcher.run.phases import run_line, seconds_words
from launcher.commands.resume import resume_hint, resumed, resumed_args, start_point
from launcher.spec.cluster import ClusterSpec, HostsSpec
from launcher.spec.file import load_spec
from launcher.run.tables import checks_table, refused, summary
from launcher.run.states import RunPhase, RunState

if TYPE_CHECKING:
    from launcher.preflight.links import LinkReport


def refuse(checks: list[TaskCheck]) -> None:
    bad = [c for c in checks if not c.ok]
    if bad:
        raise PreflightError(f"preflight refused the cluster, nothing was started:\n{refused(checks)}\n"
                             "Fix these (free the port, correct the spec or the host) and run again.")


def launching(spec_path: Path, engine: Engine) -> Launching:
    """The engine as one that starts runs; a spec whose runs start elsewhere (Kubernetes) is told how."""
    if not isinstance(engine, Launching):
        engine.close()
        raise SpecError(f"{spec_path}: {engine.not_started_here(str(spec_path))}")
    return engine


def keep_findings(run: record.RunRecord, checks: list[TaskCheck]) -> None:
    """What the preflight found for each task's environment, kept in the run record (a later attempt, and
    an elastic run's new plans, get it from there: no preflight runs again)."""
    for c in checks:
        if c.env and not c.title:
            run.task(c.plan.index).found(c.env)


def check(spec_path: Path, as_json: bool = False) -> None:
    """Every check of `up`'s preflight, then the links between the hosts; `as_json`: one JSON object on stdout
    (the tasks' problems and the links' matrix), the rest on stderr."""
    from launcher.preflight import links

    spec = load_spec(spec_path)
    engine = launching(spec_path, engine_for(spec, "check"))
    out = Output(threaded=False)
    say = (lambda m: out.err.print("mgpu-cluster | " + m, markup=False)) if as_json else out.say
    remote = [h.label for h in spec.hosts if not h.is_local] if isinstance(spec, HostsSpec) else []
    if spec.sync and remote:
        say(f"copying the sync files ({', '.join(spec.sync)}) to the workdir of {', '.join(dict.fromkeys(remote))}, "
            "creating it where missing, as up does; check starts no training")
    try:
        checks = engine.preflight(Path(spec_path).parent, say)
        (out.err.print if as_json else out.show)(checks_table(checks))
        report = links_of(engine) if all(c.ok for c in checks) else None
        for line in links.lines(report) if report else []:
            say(line)
        if as_json:
            print(json.dumps({"ok": all(c.ok for c in checks),
                              "tasks": [{"task": c.plan.index, "host": c.plan.host.label, "problems": c.problems}
                                        for c in checks],
                              "links": report.to_json() if report else None}), flush=True)
        refuse(checks)
    finally:
        engine.close()


def links_of(engine: Engine) -> LinkReport | None:
    """`check`'s measurement of the links, for an engine whose hosts we reach ourselves (not a scheduler's)."""
    from launcher.engines.supervised import SupervisedEngine
    from launcher.preflight.links import measure

    if not isinstance(engine, SupervisedEngine):
        return None
    return measure(engine.plans, [engine.transports[p.index] for p in engine.plans])


def with_args(spec: ClusterSpec, args: list[str]) -> ClusterSpec:
    """The spec with `args` (those after `up SPEC --`) added to the training's command line."""
    training = spec.training.model_copy(update={"args": [*spec.training.args, *args]})
    return spec.model_copy(update={"training": training})


def up(spec_path: Path, detach: bool = False, dry_run: bool = False, quiet: bool = False, verbose: bool = False,
       run_id: str | None = None, resume: str | None = None, args: list[str] | None = None) -> None:
    """`resume`: the run to go on from ('': the newest of this spec); `args`: more arguments for the training."""
    spec, resuming, told = load_spec(spec_path), None, ""
    given = list(args or [])
    if resume is not None:
        spec, resuming, resume = resumed(spec, spec_path, resume)
        args, told = resumed_args(resume, given)
    spec = with_args(spec, args or [])
    background = run_id is not None  # started by `up --detach`
    run_id = run_id or new_run_id()
    planned = engine_for(spec, run_id)  # the one engine of this `up`
    said = [line for line in (resuming, told) if line]
    if dry_run:
        out = Output(threaded=False)
        for line in said:
            out.say(line)
        try:
            return planned.dry_run(lambda text: out.console.print(text, markup=False, highlight=False))
        finally:
            planned.close()
    engine = launching(spec_path, planned)
    if detach:
        from launcher.run.detach import start_detached

        engine.close()
        return start_detached(spec_path, run_id, len(engine.plans), verbose, resume=resume, args=given)
    try:
        owner = record.Owner.create(run_id, spec_path, engine.plans, detached=background, args=args)
    except BaseException:
        engine.close()
        raise
    out = Output(quiet=quiet, verbose=verbose, log_path=run_folder(run_id) / "launcher.log")
    for line in said:
        out.say(line)
    run_recorded(spec, spec_path, owner, out, engine)


def run_recorded(spec: ClusterSpec, spec_path: Path, owner: record.Owner, out: Output, engine: Launching) -> None:
    """The run, once recorded: port claims, preflight, the agent; its end told and recorded whatever happens."""
    run = owner.record
    engine.recorded_in(run)  # reads what the run learns from its record
    run.engine_is(engine.kind)
    claims: Sequence[Claim] = []
    t0 = time.time()
    try:
        out.say(f"run {run.run_id}: {len(run.tasks)} task(s); checking hosts and ports")
        claims = engine.claim_ports()
        checks = engine.preflight(Path(spec_path).parent, out.say, for_start=True)
        out.show(checks_table(checks))
        refuse(checks)
        keep_findings(run, checks)
        if spec.training.entrypoint:  # the built-in runner's checkpoint (a command keeps its own)
            start = start_point(checks, engine.kind, run.run_id, spec_path)
            run.set_start(start)
            out.say(f"run {run.run_id} {start.words()}")
        run.took(RunPhase.PREFLIGHT_S, time.time() - t0)
        out.say(f"starting {len(run.tasks)} task(s); logs in {run_folder(run.run_id)}")
        cold = cold_words(spec, engine.plans) if isinstance(spec, HostsSpec) else None  # (a scheduler's: no standbys)
        if cold:
            out.say(cold)
        agent = Agent(spec, engine, owner, out)
        try:
            agent.execute()
        finally:
            engine = agent.engine  # an elastic run may have moved to fewer hosts
        if interrupts.pending():
            raise Interrupted(f"interrupted by {interrupts.pending()} while the run ended")
        tell_end(out, run)
        out.say(f"run {run.run_id} succeeded in {seconds_words((run.ended_at or time.time()) - run.created_at)}")
    except (PreflightError, HomeError, KeyboardInterrupt) as exc:  # before any task started
        with interrupts.shield():
            if run.state == RunState.PREFLIGHT:
                record_preflight_end(owner, exc)
        if isinstance(exc, KeyboardInterrupt):  # (a run that succeeded just before keeps its record)
            raise Interrupted(run.failure.message if run.failure else interrupts.reason()) from None
        raise
    except (RunFailed, Interrupted) as exc:
        tell_end(out, run)
        hint = resume_hint(spec, spec_path, run) if isinstance(exc, Interrupted) else ""
        if hint:
            raise Interrupted(f"{str(exc).rstrip('.')}; {hint}") from None
        raise
    finally:
        with interrupts.shield():
            engine.close()
            for claim in claims:
                claim.release()
            owner.release()
            if not out.close(timeout=5.0):
                out.logline("the terminal did not take the last lines within 5 s; they are in this log")


def record_preflight_end(owner: record.Owner, exc: BaseException) -> None:
    """A run that ended in its preflight: stopped (Ctrl-C), or refused; nothing was started."""
    stopped = isinstance(exc, KeyboardInterrupt)
    owner.record.set_state(RunState.STOPPED if stopped else RunState.FAILED, Failure(
        kind=FailureKind.STOPPED if stopped else FailureKind.REFUSED,
        message=(f"{interrupts.reason()} during the preflight; nothing was started" if stopped
                 else str(exc) if isinstance(exc, HomeError) or str(exc).startswith("preflight refused")
                 else "preflight refused: " + str(exc))))
    owner.save()


def tell_end(out: Output, run: record.RunRecord) -> None:
    out.show(summary(run, out.console.width))
    out.say(run_line(run))
    say_straggler(out, run)


def say_straggler(out: Output, run: record.RunRecord) -> None:
    from launcher.diagnose.straggler import summary_line

    line = summary_line(run.tasks)
    if line:
        out.say(line)


