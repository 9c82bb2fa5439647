"""Restarts with nothing shared: before a restart's tasks start, every host that restores holds a whole copy of
the run's newest backup. Each host lists its checkpoint folder (worker.task.backup: the owner file's word, each
file's size and SHA-256); the newest backup of this run is the truth (the chief's when it is as new as any: it
wrote them all); each host that holds other bytes gets a copy through this launcher's connections, written into
a temporary folder beside the backup, checked file by file by the host and then put in place, whole or not at
all. Hosts that hold the same bytes (one folder on shared storage) get nothing."""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass

from launcher.engines.base import BackupCopy, Result, parallel
from launcher.engines.supervised.transport import Transport
from launcher.plan import TaskPlan, checkpoint_folder
from launcher.spec import ClusterSpec
from worker.host.spawn import module_argv
from worker.task.backup import STAGE_PREFIX, Held

MODULE = "worker.task.backup"
LIST_TIMEOUT_S = 120.0  # hashing a large backup takes a while
CHUNK = 1 << 20


@dataclass(frozen=True)
class Place:
    """A checkpoint folder on a host, as the first of its tasks (in index order) sees it, and what it holds."""

    plan: TaskPlan
    transport: Transport
    held: Held


def _list(spec: ClusterSpec, plan: TaskPlan, transport: Transport, run_id: str) -> Held:
    code, out, err = transport.call(plan, module_argv(plan.python, MODULE) + ["list", checkpoint_folder(spec, plan.host, run_id)],
                                    LIST_TIMEOUT_S)
    if code != 0:
        raise OSError(f"listing its checkpoint folder failed (exit {code}): {(err or out).strip()[-300:]}")
    try:
        return Held.from_json(out.strip().splitlines()[-1])
    except (ValueError, KeyError, TypeError, IndexError):
        raise OSError(f"its checkpoint folder's listing is not one: {out.strip()[-200:]!r}") from None


def _one_folder_here(spec: ClusterSpec, plans: list[TaskPlan], run_id: str) -> bool:
    """Every task runs on this machine and reads one folder: nothing to list or copy."""
    return all(p.host.is_local for p in plans) and len(
        {os.path.normpath(os.path.join(p.cwd or os.getcwd(), os.path.expanduser(checkpoint_folder(spec, p.host, run_id))))
         for p in plans}) == 1


def newest(places: list[Place], run_id: str) -> Place | None:
    """The place whose backup is this run's and the furthest trained (the first in task order among equals: the
    chief's); None where no host holds one."""
    own = [p for p in places if p.held.files and p.held.run == run_id and p.held.steps_done is not None]
    return max(own, key=lambda p: (p.held.steps_done, -p.plan.index), default=None)


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
    return (f"{target.plan.label}: the copy of the run's backup from {source.plan.label} (global step "
            f"{source.held.steps_done}) to {target.held.folder} on its host failed: {str(exc) or type(exc).__name__}. "
            "Every task must restore the same backup, so no task was started. Free space there (or set [training] "
            "checkpoint_dir to storage every host shares) and run the spec again")


def share(spec: ClusterSpec, run_id: str, plans: list[TaskPlan], transports: dict[int, Transport]) -> BackupCopy | None:
    """Every live host's folder holds the run's newest backup (BackupCopy: what was done, or the error; its source
    None where no live host holds one: the tasks start fresh, or refuse what they find); None where the tasks
    read one folder here or are a command of the user's (its checkpoints are its own)."""
    if spec.training.entrypoint is None or _one_folder_here(spec, plans, run_id):
        return None
    t0 = time.monotonic()
    listed: list[Result[Held]] = parallel(lambda p: _list(spec, p, transports[p.index], run_id), plans)
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
        places.setdefault((id(transport), res.value.folder), Place(plan, transport, res.value))
    source = newest(list(places.values()), run_id)
    if source is None:
        return BackupCopy(source=None, steps_done=None, seconds=round(time.monotonic() - t0, 3))
    copied, same, sent = [], [], 0
    for place in places.values():
        if place.held.files == source.held.files:
            same.append(place.plan.index)
            continue
        try:
            sent += _copy(source, place)
        except Exception as exc:  # noqa: BLE001 (any end of a copy, a lost connection too, is a copy not made)
            return BackupCopy(source=source.plan.index, steps_done=source.held.steps_done, copied=tuple(copied),
                              same=tuple(same), bytes=sent, seconds=round(time.monotonic() - t0, 3),
                              error=_not_copied(source, place, exc), task=place.plan.index, host=place.plan.host.label)
        copied.append(place.plan.index)
    return BackupCopy(source=source.plan.index, steps_done=source.held.steps_done, copied=tuple(copied),
                      same=tuple(same), bytes=sent, seconds=round(time.monotonic() - t0, 3))
