"""`up --resume [RUN]`: which earlier run a new run goes on from, whether it can, and the spec that does it
(the built-in runner's `--resume-run RUN`, and `--resume-from` the earlier run's checkpoint folder on each host);
where a new run starts, from what its preflight found in the checkpoint folders."""

from __future__ import annotations

import os
import posixpath
import shlex
from pathlib import Path
from typing import Iterator

from launcher.engines.base import EngineKind, TaskCheck
from launcher.errors import PreflightError, RunCorrupt, RunNotFound, SpecError
from launcher.commands.listing import past_preflight, run_ids
from launcher.plan import checkpoint_folder, plan_tasks, run_root
from launcher.spec.base import SECRET
from launcher.run import files, record
from launcher.run.home import run_folder
from launcher.run.progress import typed
from launcher.run.states import RunState
from launcher.spec.cluster import ClusterSpec, HostsSpec, KubernetesSpec
from launcher.spec.file import load_spec
from worker.host import layout
from worker.host.startpoint import Refused, StartPoint, decide, look_first, options

SHOWN_MAX = 12  # differences listed


def earlier_run(spec_path: Path) -> str:
    """The newest run of this spec file that got past its preflight."""
    wanted = str(Path(spec_path).resolve())
    for run_id in run_ids():
        try:
            run = record.load(run_id)
        except (RunCorrupt, SpecError, OSError):
            continue
        if run.spec_path == wanted and past_preflight(run):
            return run_id
    raise SpecError(f"--resume: no earlier run of {spec_path} to go on from; 'mgpu-cluster ls' lists the runs "
                    "(give one: --resume RUN).")


def _flat(value: object, path: str = "") -> Iterator[tuple[str, object]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flat(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for i, item in enumerate(value):
            yield from _flat(item, f"{path}[{i}]")
    else:
        yield path, value


def differences(then: ClusterSpec, now: ClusterSpec) -> list[str]:
    """Each key whose value differs, as 'key: <then> then, <now> now' (secret-looking env values hidden)."""
    old, new = dict(_flat(then.model_dump(mode="json"))), dict(_flat(now.model_dump(mode="json")))

    def shown(key: str, value: object) -> str:
        return "(not set)" if value is None else "****" if SECRET.search(key.rsplit(".", 1)[-1]) else repr(value)

    return [f"{key}: {shown(key, old.get(key))} then, {shown(key, new.get(key))} now"
            for key in dict.fromkeys([*old, *new]) if old.get(key) != new.get(key)]


def spec_of(run: record.RunRecord) -> ClusterSpec:
    path = run_folder(run.run_id) / "spec.toml"
    try:
        files.read_file(path)  # the copy is untrusted bytes too: a regular file, of a bounded size
        return load_spec(path, base=Path(run.spec_path).parent)
    except (SpecError, RunCorrupt, FileNotFoundError) as exc:
        raise RunCorrupt(f"--resume {run.run_id}: the copy of its spec that the run keeps cannot be read "
                         f"({str(exc)[:300]}), so it cannot be compared with this one; start a new run instead."
                         ) from None


def resumed(spec: ClusterSpec, spec_path: Path, run_id: str) -> tuple[ClusterSpec, str, str]:
    """The spec of a run that goes on from run `run_id` ('': the newest of this spec), a line saying so, and
    that run's id.
    Refused (SpecError, exit 2) where it cannot: another engine, your own command, a run not ended or one that
    finished, a spec that differs from the one that run was started with."""
    if isinstance(spec, KubernetesSpec):
        raise SpecError(f"{spec_path}: a JobSet run is started by kubectl, not by up: applied again with the same "
                        "name it resumes its own checkpoint; to go on from another run's backup in a shared "
                        "checkpoint_dir, add '--resume-run RUN' (that run's name) to [training] args.")
    if not isinstance(spec, HostsSpec) and not spec.training.checkpoint_dir:
        raise SpecError(f"{spec_path}: --resume of a Slurm run goes on from the backup in its checkpoint_dir: set "
                        "[training] checkpoint_dir to a folder every run sees (on the shared workdir), as the run "
                        "to go on from had it.")
    if spec.training.command is not None:
        raise SpecError(f"{spec_path}: --resume moves the built-in runner's checkpoint ('entrypoint'); your "
                        "command keeps its own: point it at the same folder again (MGPU_RUN_DIR names each run's "
                        "task folder).")
    run_id = run_id or earlier_run(spec_path)
    run = record.load(run_id)
    if not run.ended:
        raise SpecError(f"--resume {run_id}: that run has not ended ({run.state}); two runs must not train into "
                        f"one checkpoint. Stop it first ('mgpu-cluster down {run_id}'; 'mgpu-cluster status "
                        f"{run_id}' asks its hosts when its launcher is gone), then resume.")
    if run.state == RunState.SUCCEEDED:
        raise SpecError(f"--resume {run_id}: that run succeeded, so its training is over and its backup was removed "
                        "at its end: nothing is left to train, and nothing was started. Start a new run instead.")
    changed = differences(spec_of(run), spec)
    if changed:
        more = f"\n  ... and {len(changed) - SHOWN_MAX} more" if len(changed) > SHOWN_MAX else ""
        raise SpecError(f"--resume {run_id}: {spec_path} differs from the spec that run was started with, so its "
                        "checkpoint may not fit this training:\n  " + "\n  ".join(changed[:SHOWN_MAX]) + more +
                        f"\nPut those keys back as they were (the run keeps its spec in "
                        f"{run_folder(run_id) / 'spec.toml'}), or start a new run without --resume. Arguments "
                        "after -- are not part of the spec and may change.")
    if spec.training.checkpoint_dir or not isinstance(spec, HostsSpec):
        return (with_training_args(spec, ["--resume-run", run_id]),
                f"resuming run {run_id} from the backup in checkpoint_dir {spec.training.checkpoint_dir}", run_id)
    folders = {layout.checkpoint_dir(run_root(h, run_id)) for h in spec.hosts}
    if len(folders) > 1:
        raise SpecError(f"{spec_path}: --resume needs one place for the checkpoint on every host, and these "
                        f"local hosts keep it in {len(folders)} ({', '.join(sorted(folders))}); give every "
                        "local host a workdir, or none.")
    folder = folders.pop()
    where = folder if posixpath.isabs(folder) else f"<workdir>/{folder}"
    said = f"resuming run {run_id} from its checkpoint ({where})"
    return with_training_args(spec, ["--resume-from", folder, "--resume-run", run_id]), said, run_id


def with_training_args(spec: ClusterSpec, args: list[str]) -> ClusterSpec:
    training = spec.training.model_copy(update={"args": [*args, *spec.training.args]})
    return spec.model_copy(update={"training": training})


def start_point(checks: list[TaskCheck], kind: EngineKind, run_id: str, spec_path: Path) -> StartPoint:
    """Where a new run starts, from what the preflight found in each task's checkpoint folder (a Slurm run's, on
    the shared workdir, is read here): fresh, or the backup of the run that --resume names. Another run's backup
    or finished training, or nothing left to train: refused in one paragraph (PreflightError, exit 2)."""
    points = []
    for c in checks:
        said = options(c.plan.argv)
        found = c.checkpoint
        if found is None and kind is EngineKind.SLURM and said.folders:
            found = look_first([os.path.join(c.plan.cwd or "", os.path.expanduser(f)) for f in said.folders])
        if found is None:
            continue
        try:
            points.append(decide(found, run_id, said.resume_run, said.epochs, str(spec_path)))
        except Refused as exc:
            where = "" if kind is EngineKind.SLURM else f"{c.plan.host.label} (task {c.plan.index}): "
            raise PreflightError(f"{where}{exc}") from None
    return points[0] if points else StartPoint()


def kept_args(run_id: str) -> list[str]:
    """The training's arguments run `run_id` was given after `up SPEC --` (none where its record cannot be read)."""
    try:
        return record.load(run_id).args
    except (RunCorrupt, RunNotFound):
        return []


def resumed_args(run_id: str, given: list[str]) -> tuple[list[str], str]:
    """The training's arguments of a run that goes on from run `run_id`: those given after --, else that run's;
    and a line that says which."""
    then = kept_args(run_id)
    if given:
        was = f" in place of run {run_id}'s ({shlex.join(then)})" if then and then != given else ""
        return given, f"training arguments: {shlex.join(given)} (given after --{was})"
    if then:
        return then, (f"training arguments: {shlex.join(then)}, as run {run_id} had them (arguments after -- "
                      "replace them)")
    return [], ""


def resume_hint(spec: ClusterSpec, spec_path: Path, run: record.RunRecord) -> str:
    """For a run stopped or failed with a checkpoint to go on from, the command that resumes it ('' where none
    shows: a command of your own, no backup in a local host's folder, or no epoch ended on a remote one)."""
    if spec.training.entrypoint is None or not isinstance(spec, HostsSpec) or run.state == RunState.SUCCEEDED:
        return ""
    saved = False
    for plan in plan_tasks(spec, run.run_id):  # where each local task keeps its checkpoint, as the runner does
        if plan.host.is_local:
            folder = os.path.expanduser(checkpoint_folder(spec, plan.host, run.run_id))
            saved = saved or look_first([os.path.join(plan.cwd or os.getcwd(), folder)]).backup
    if not any(h.is_local for h in spec.hosts):  # a remote backup is written at each epoch's end at least
        saved = any((typed(t.progress).get("epoch") or 0) > 1 for t in run.tasks)
    return f"go on from its checkpoint with: mgpu-cluster up {spec_path} --resume {run.run_id}" if saved else ""
