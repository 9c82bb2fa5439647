"""`sync`: which of the spec's files go to each host's workdir, copied once per (host, workdir)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Mapping

from launcher.plan import TaskPlan
from launcher.spec.cluster import HostsSpec
from launcher.engines.base import parallel
from launcher.engines.supervised.transport import SyncCounts, Transport

SKIP_DIRS = {"__pycache__"}


def sync_files(items: list[str], base: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """The spec's `sync` entries as (local file, path relative to the workdir), and problems.

    A relative entry keeps its path below the spec's folder (`data/x.csv` -> `<workdir>/data/x.csv`);
    an absolute one, or one outside that folder, lands under its own name. Folders are copied
    whole, without __pycache__."""
    files: list[tuple[str, str]] = []
    problems = []
    base = Path(os.path.abspath(base))
    for item in items:
        src = Path(os.path.normpath(base / os.path.expanduser(item)))  # an absolute item stays itself
        try:
            rel = src.relative_to(base)
        except ValueError:
            rel = Path(src.name)
        if not src.exists():
            problems.append(f"sync: {item!r} does not exist ({src})")
            continue
        if src.is_file():
            files.append((str(src), rel.as_posix()))
            continue
        for folder, dirs, names in os.walk(src):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
            for name in sorted(names):
                path = Path(folder) / name
                if path.is_file():
                    files.append((str(path), (rel / path.relative_to(src)).as_posix()))
    return files, problems


def run_sync(spec: HostsSpec, plans: list[TaskPlan], transports: Mapping[int, Transport], base: Path,
             say: Callable[[str], None], width: int) -> dict[int, str]:
    """Copy the sync files to each remote (host, workdir) once, `width` hosts at a time; problems by task index."""
    files, problems = sync_files(spec.sync, base)
    if problems:
        return {p.index: "; ".join(problems) for p in plans}
    targets: dict[tuple[int, str | None], list[TaskPlan]] = {}
    for p in plans:
        targets.setdefault((id(transports[p.index]), p.cwd), []).append(p)
    found_groups = list(targets.values())

    def one(group: list[TaskPlan]) -> tuple[SyncCounts | None, float]:
        t0 = time.monotonic()
        return transports[group[0].index].sync(files, group[0].cwd), time.monotonic() - t0

    found: dict[int, str] = {}
    for group, res in zip(found_groups, parallel(one, found_groups, width)):
        if res.value is None:  # it raised
            found.update({p.index: str(res.error) for p in group})
            continue
        result, took = res.value
        if result is not None:
            where = group[0].cwd or "the login folder"
            say(f"sync {group[0].host.label}:{where}: {result['copied']} file(s) copied "
                f"({result['bytes'] / 1e6:.1f} MB), {result['unchanged']} unchanged, in {took:.2f} s")
    return found
