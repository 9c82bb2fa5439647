"""Restarts with nothing shared: before a restart's tasks start (and before the first of a run that goes on from
another, `up --resume`), every host that restores holds a whole copy of the run's newest backup. Each host lists
its checkpoint folder and the spare copies in it (worker.task.backup: the owner file's word, each file's size and
SHA-256); the newest backup of the run is the truth (the chief's when it is as new as any: it wrote them all; a
spare copy, kept by the first task of each other host, where the chief's host is gone); each host whose folder
holds other bytes gets a copy through this launcher's connections, written into a temporary folder beside the
backup, checked file by file by the host and then put in place, whole or not at all. Hosts that hold the same
bytes (one folder on shared storage) get nothing."""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass

from launcher.engines.base import BackupCopy, Result, parallel
from launcher.engines.supervised.transport import Transport
from launcher.plan import TaskPlan, checkpoint_folder
from launcher.spec.cluster import HostsSpec
from worker.host.spawn import module_argv
from worker.host.startpoint import options
from worker.task.backup import STAGE_PREFIX, Held

MODULE = "worker.task.backup"
LIST_TIMEOUT_S = 120.0  # hashing a large backup takes a while
CHUNK = 1 << 20


@dataclass(frozen=True)
class Place:
    """A checkpoint folder on a host, as the first of its tasks (in index order) sees it, and what it holds; `spare`:
    a spare copy kept in it (a source, never a target)."""

    plan: TaskPlan
    transport: Transport
    held: Held
    spare: bool = False


@dataclass(frozen=True)
class Wanted:
    """Whose backup a copy brings, and from which folder: a restart's, of the run itself (or of the run it went
    on from, adopted into its folder); the first attempt of a run that goes on from another (`up --resume`), of
    that run, in the folder each task adopts it from."""

    runs: tuple[str, ...]
    finished: str | None  # a run whose training finished there has nothing left to train: the newest of all
    resume_from: str | None = None

    def folder(self, spec: HostsSpec, plan: TaskPlan, run_id: str) -> str:
        return self.resume_from or checkpoint_folder(spec, plan.host, run_id)


def wanted(spec: HostsSpec, plans: list[TaskPlan], run_id: str, first: bool) -> Wanted | None:
    """What to bring before attempt `first` or a restart (None: nothing, the tasks start fresh)."""
    said = options(plans[0].argv)
    if not first:
        return Wanted(tuple(r for r in (run_id, said.resume_run) if r), run_id)
    if said.resume_run:
        return Wanted((said.resume_run,), None, said.resume_from)
    return None


def _list(folder: str, plan: TaskPlan, transport: Transport) -> list[Held]:
    code, out, err = transport.call(plan, module_argv(plan.python, MODULE) + ["list", folder], LIST_TIMEOUT_S)
    if code != 0:
        raise OSError(f"listing its checkpoint folder failed (exit {code}): {(err or out).strip()[-300:]}")
    try:
        found = [Held.parse(h) for h in json.loads(out.strip().splitlines()[-1])]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise OSError(f"its checkpoint folder's listing is not one: {out.strip()[-200:]!r}") from None
    if not found:
        raise OSError("its checkpoint folder's listing is empty")
    return found


def _one_folder_here(spec: HostsSpec, plans: list[TaskPlan], run_id: str, want: Wanted) -> bool:
    """Every task runs on this machine and reads one folder: nothing to list or copy."""
    return all(p.host.is_local for p in plans) and len(
        {os.path.normpath(os.path.join(p.cwd or os.getcwd(), os.path.expanduser(want.folder(spec, p, run_id))))
         for p in plans}) == 1


def newest(places: list[Place], want: Wanted) -> Place | None:
    """The place that holds the run's furthest-trained backup (its finished training first; among equals the
    chief's own folder, then the first in task order); None where no host holds one."""
    def ended(p: Place) -> bool:
        return want.finished is not None and p.held.finished == want.finished

    own = [p for p in places if p.held.files and (ended(p) or p.held.run in want.runs and p.held.steps_done is not None)]
    return max(own, key=lambda p: (ended(p), p.held.steps_done or 0, not p.spare, -p.plan.index), default=None)


def _copy(source: Place, target: Place) -> int:
    """The source's backup into a temporary folder beside the target's, then checked and put in place by the
    target's host; the bytes copied (OSError where it could not be)."""
    stage = f"{target.held.folder}/{STAGE_PREFIX}{secrets.token_hex(4)}"
    sent = 0
    for rel in sorted(source.held.files):
        with source.transport.open_file(f"{source.held.folder}/{rel}") as src, \
                target.transport.open_file(f"{stage}/{rel}", write=True) as dst:
            while chunk := src.read(CHUNK):
                dst.write(chunk)
                sent += len(chunk)
    argv = module_argv(target.plan.python, MODULE) + ["install", target.held.folder, stage]
    code, out, err = target.transport.call(target.plan, argv, LIST_TIMEOUT_S, stdin=source.held.to_json().encode())
    if code != 0:
        try:
            why = json.loads(out.strip().splitlines()[-1])["error"]
        except (ValueError, KeyError, TypeError, IndexError):
            why = (err or out).strip()[-300:]
        raise OSError(f"the copy was not put in place: {why}")
    return sent


def _not_copied(source: Place, target: Place, exc: Exception) -> str:
    where = f"the spare copy kept by {source.plan.label}" if source.spare else source.plan.label
    return (f"{target.plan.label}: the copy of the run's backup from {where} (global step "
            f"{source.held.steps_done}) to {target.held.folder} on its host failed: {str(exc) or type(exc).__name__}. "
            "Every task must restore the same backup, so no task was started. Free space there (or set [training] "
            "checkpoint_dir to storage every host shares) and run the spec again")


def share(spec: HostsSpec, run_id: str, plans: list[TaskPlan], transports: dict[int, Transport],
          first: bool) -> BackupCopy | None:
    """Every live host's folder holds the run's newest backup before attempt `first` or a restart (BackupCopy: what
    was done, or the error; its source None where no live host holds one: the tasks start fresh, or refuse what
    they find); None where there is nothing to bring (a new run), the tasks read one folder here, or they are a
    command of the user's (its checkpoints are its own)."""
    want = wanted(spec, plans, run_id, first) if spec.training.entrypoint is not None else None
    if want is None or _one_folder_here(spec, plans, run_id, want):
        return None
    t0 = time.monotonic()
    listed: list[Result[list[Held]]] = parallel(
        lambda p: _list(want.folder(spec, p, run_id), p, transports[p.index]), plans)
    for plan, res in zip(plans, listed):
        if not res.ok:
            return BackupCopy(source=plan.index, steps_done=None, task=plan.index, host=plan.host.label,
                              error=(f"{plan.label}: {res.error}. Every task must restore the same backup, so no "
                                     "task was started; check the host and its checkpoint folder and run the spec "
                                     "again"))
    places: dict[tuple[int, str], Place] = {}  # one per host and folder: tasks of one host share theirs
    for plan, res in zip(plans, listed):
        assert res.value is not None
        transport = transports[plan.index]
        for i, held in enumerate(res.value):
            places.setdefault((id(transport), held.folder), Place(plan, transport, held, spare=i > 0))
    source = newest(list(places.values()), want)
    if source is None:
        return BackupCopy(source=None, steps_done=None, seconds=round(time.monotonic() - t0, 3))
    copied: list[int] = []
    same: list[int] = []
    sent = 0
    for place in places.values():
        if place.spare:
            continue
        if place.held.files == source.held.files:
            same.append(place.plan.index)
            continue
        try:
            sent += _copy(source, place)
        except Exception as exc:  # noqa: BLE001 (any end of a copy, a lost connection too, is a copy not made)
            return BackupCopy(source=source.plan.index, steps_done=source.held.steps_done, copied=tuple(copied),
                              same=tuple(same), bytes=sent, seconds=round(time.monotonic() - t0, 3),
                              error=_not_copied(source, place, exc), task=place.plan.index, host=place.plan.host.label,
                              spare=source.spare, finished=source.held.finished is not None)
        copied.append(place.plan.index)
    return BackupCopy(source=source.plan.index, steps_done=source.held.steps_done, copied=tuple(copied),
                      same=tuple(same), bytes=sent, seconds=round(time.monotonic() - t0, 3), spare=source.spare,
                      finished=source.held.finished is not None)
