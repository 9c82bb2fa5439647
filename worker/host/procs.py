"""Processes we started, found again safely: by pid *and* create time, and by the run in their env.

The one liveness helper (`same`) and the one stop helper (`stop`) of both the launcher and the
hosts. A pid alone is never signalled: a recycled pid names somebody else's process.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Collection, Iterator, Sequence

import psutil

from worker.host import env as names


def identity(pid: int) -> tuple[int, float] | None:
    """(pid, create time) of a live process, to recognise it later."""
    try:
        return pid, psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def same(pid: int | None, create_time: float | None) -> psutil.Process | None:
    """The live process `pid` if it is still the one created at `create_time` (zombies are gone)."""
    if not pid:
        return None
    try:
        proc = psutil.Process(int(pid))
        if create_time is not None and not abs(proc.create_time() - float(create_time)) <= 0.01:  # NaN: not it
            return None
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc
    except (psutil.Error, ValueError, TypeError, OverflowError):  # task.json: where the training can write
        return None


def tree(root: int, without: Collection[int] = ()) -> list[psutil.Process]:
    """The live descendants of process `root`: its children, theirs, and the orphans it adopted as a subreaper
    (system.adopt_orphans), leaving out the processes `without` and all under them."""
    try:
        children = psutil.Process(root).children()
    except psutil.Error:
        return []
    found = []
    for child in children:
        try:
            if child.pid in without or child.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        found += [child, *tree(child.pid, without)]
    return found


COLLECT_EVERY_S = 5.0  # a subreaper collects its ended orphans this often (a scan of the host's processes)


def collect_adopted() -> int:
    """Collect the ended orphans this process adopted as a subreaper (system.adopt_orphans), so that none stays a
    zombie while its task runs; how many. Only a child that leads no process group is taken: every child we start
    ourselves leads its own (spawn.OWN_GROUP, a session of its own, a forked trainer), its status its waiter's."""
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return 0
    collected = 0
    for child in children:
        try:
            if child.status() == psutil.STATUS_ZOMBIE and os.getpgid(child.pid) != child.pid:
                collected += bool(os.waitpid(child.pid, os.WNOHANG)[0])
        except (psutil.Error, OSError):
            continue
    return collected


def left_behind(left: Sequence[psutil.Process]) -> str:
    """What the sweep of a task's leftovers says, in its log and among its output."""
    return f"stopping {len(left)} process(es) the task left behind: {[p.pid for p in left]}"


def of_task(run_id: str, index: int | str, exclude: int | None = None, attempt: int | None = None) -> list[psutil.Process]:
    """Every live process whose environment says it belongs to task `index` of run `run_id`:
    also those that left the task's session (setsid, daemons, TensorBoard). With `attempt`, only those
    started for that attempt (the next attempt's standby is not what this one left behind)."""
    return [proc for proc, env in _of_run(run_id) if proc.pid != exclude and env.get(names.TASK_INDEX) == str(index)
            and (attempt is None or env.get(names.ATTEMPT, str(attempt)) == str(attempt))]


def _of_run(run_id: str) -> Iterator[tuple[psutil.Process, dict[str, str]]]:
    """Each live process here, this one aside, whose environment says it belongs to run `run_id`, with that env."""
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            env = proc.environ()
            if env.get(names.RUN_ID) == run_id and proc.status() != psutil.STATUS_ZOMBIE:
                yield proc, env
        except psutil.Error:
            continue


def run_lives(run_id: str) -> bool:
    """Whether any process here (its tasks, supervisors, standbys) says in its environment that it belongs to run
    `run_id`: this process aside."""
    return next(_of_run(run_id), None) is not None


def _signal(proc: psutil.Process, sig: int, group: bool) -> None:
    try:
        if group and os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except (psutil.Error, OSError):
        pass


def stop(found: Sequence[psutil.Process | None], grace: float, group: bool = True,
         first: int = signal.SIGTERM) -> list[psutil.Process]:
    """`first` (TERM) to each process found (its whole group when it leads one; None: none found), KILL what
    is left after `grace` seconds; the processes still alive after that (normally none)."""
    procs = [p for p in found if p is not None]
    for proc in procs:
        _signal(proc, first, group)
        _signal(proc, signal.SIGCONT, group)  # a stopped (SIGSTOP) process only sees TERM once continued
    _gone, alive = psutil.wait_procs(procs, timeout=grace) if grace > 0 else ([], procs)
    for proc in alive:
        _signal(proc, signal.SIGKILL, group)
    _gone, alive = psutil.wait_procs(alive, timeout=5.0)
    return alive
