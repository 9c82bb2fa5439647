"""The rules that turn a task's events, and their absence, into task states and failures as data: what
a Started, a Progress, an Exit or a Lost means, a task that did not start, the hung task, the silent one.

They move the run record and the attempt's facts forward and return a Failure, or None; no I/O.
"""

from __future__ import annotations

import collections
import signal
import time

from launcher.run.attempt import TAIL_LINES, LiveAttempt
from launcher.run.cause import unhealthy
from launcher.run.failure import Failure, FailureKind, describe_exit, of_exit, of_task, signal_name
from launcher.run.progress import step, typed
from launcher.run.record import RunRecord
from launcher.run.states import RunPhase, TaskState, end_state
from launcher.spec.cluster import Launch
from worker.host import protocol
from worker.host.devices import GPUS_MAX, GpuFigures
from worker.host import layout
from worker.host.protocol import ProgressState

STOPPED = ("stopped", "tracing-stop")  # psutil's status of a process stopped by SIGSTOP or a debugger
NOTICE_STATES = (ProgressState.PREEMPTING, ProgressState.PREEMPTED)
STALE_S = 2 * protocol.BEAT_S  # a task whose last progress is older, while a peer's collective waits on it, is stale


def label(run: RunRecord, index: int) -> str:
    """'task 1 (node7:20000)': where the task landed, as the record knows it (a scheduler's node too)."""
    host, port = run.host_of(index)
    return f"task {index} ({host}:{port})" if port else f"task {index} ({host})"


def task_failure(run: RunRecord, live: LiveAttempt, index: int, kind: FailureKind, what: str,
                 code: int | None = None, said: list[str] | None = None) -> Failure:
    """`said`: the task's own last lines, longer than its tail (its exit report's), to read the cause from."""
    host = run.host_of(index)[0]
    log = f"{host}:{layout.file(run.task(index).run_dir, layout.WORKER_LOG)}"
    return of_task(kind, what, index, label(run, index), host, log, list(live.tails[index]), run.run_id, code, said)


def apply(run: RunRecord, live: LiveAttempt, index: int, ev: protocol.Event) -> Failure | None:
    """One event of task `index`: its record and the attempt's facts move forward (never back: a late
    Started does not undo an end); the failure it is, if any. Notes and output are not states."""
    task, now = run.task(index), time.time()
    live.heard[index] = time.monotonic()
    if isinstance(ev, protocol.Started):
        live.saw_start(index)
        task.started(ev.pid, ev.create_time, ev.supervisor_pid, ev.warm, ev.host, ev.port, now)
    elif isinstance(ev, protocol.Stats):
        task.measured(ev.status, ev.cpu_percent, ev.rss,
                      [f for f in map(GpuFigures.parse, (ev.gpus or [])[:GPUS_MAX]) if f] or None)
    elif isinstance(ev, protocol.Progress):
        p = typed(ev.progress)  # written by the training: untrusted
        # the heartbeat counts once the task has trained a step (imports, set-up, tracing are no hang)
        trained = index in live.progressed or step(p) > step(p, "first_global_step")
        task.reported(p, now if trained else None)
        if trained:
            live.progressed[index] = time.monotonic()
        if step(p) > 0:
            run.mark(RunPhase.FIRST_STEP, now)
    elif isinstance(ev, protocol.Exit):
        return exited(run, live, index, ev)
    elif isinstance(ev, protocol.Lost):
        live.saw_end(index)
        task.ended(end_state(task.state, None, False, lost=True), now)
        return task_failure(run, live, index, FailureKind.LOST, f"was lost: {ev.reason}")
    return None


def exited(run: RunRecord, live: LiveAttempt, index: int, ev: protocol.Exit) -> Failure | None:
    """A task's exit: succeeded, preempted (a notice; its peers save the same checkpoint), or failed."""
    task = run.task(index)
    live.saw_end(index)
    if ev.tail:
        live.tails[index] = collections.deque(ev.tail[-TAIL_LINES:], maxlen=TAIL_LINES)
    # a notice is a preemption whether or not the task managed to save (killed at the end of its grace), and so
    # is any end once a peer was preempted (it saves with the group, or is stopped)
    notice = bool(ev.notice) or ProgressState.of(task.progress) in NOTICE_STATES or live.preempted_at is not None
    task.ended(end_state(task.state, ev.code, notice), time.time(), ev.code)
    if task.state == TaskState.PREEMPTED:
        live.preempted_at = live.preempted_at or time.monotonic()
        return None
    if task.state == TaskState.SUCCEEDED:
        return None
    kind, what = of_exit(ev)
    return abandoned(run, live, index, ev) or task_failure(run, live, index, kind, what, ev.code, ev.tail)


def abandoned(run: RunRecord, live: LiveAttempt, peer: int, ev: protocol.Exit) -> Failure | None:
    """A peer that exited because its collective was aborted for another task is not the cause: the task the
    abort names (TensorFlow's or XLA's coordination service: it stopped sending heartbeats, or it hosts the
    service and stopped answering) is, as hung, when its process is stopped or its progress is stale; None
    where the exit is the peer's own failure."""
    now = time.monotonic()
    for rank in unhealthy(ev.tail):
        index = live.tasks[rank] if rank < len(live.tasks) else None  # a rank counts the attempt's tasks in order
        if index is None or index == peer or index not in live.live:
            continue
        task = run.task(index)
        stopped = task.proc_status in STOPPED
        age = now - live.progressed[index] if index in live.progressed else None
        if not stopped and age is not None and age < STALE_S:
            continue
        task.failed()
        quiet = f"; no progress for {age:.0f} s" if age is not None else "; it had trained no step"
        return task_failure(run, live, index, FailureKind.HUNG, (
            f"stopped answering{' (its process is stopped, e.g. by SIGSTOP or a debugger)' if stopped else ''}"
            f"{quiet}: the coordination service aborted the collective of {label(run, peer)} because of it, "
            f"and that task then {describe_exit(ev.code)}"))
    return None


def preempted_words(run: RunRecord, index: int, ev: protocol.Exit, grace: float) -> str:
    """What the first preempted exit of an attempt is told as."""
    how = describe_exit(ev.code)
    if ev.notice:  # a kill at the end of its grace is no mystery (out of memory) to hint at
        end = " at the end of preempt_grace" if ev.code == -signal.SIGKILL else ""  # a TERM may end a program at once
        how = f"notice {ev.notice}, " + (f"stopped with {signal_name(ev.code)}{end}" if ev.code < 0 else how)
    what = "ended for the regroup" if ev.notice == protocol.REGROUP_NOTICE else "was preempted"
    return f"{label(run, index)} {what} ({how}); waiting up to preempt_grace = {grace:g} s for the others to save"


def overdue(run: RunRecord, live: LiveAttempt, launch: Launch) -> Failure | None:
    """A task that did not start in time, the hung one, or a silent one: the first found, as a failure."""
    now = time.monotonic()
    for index in live.live:
        if index not in live.started and now - live.spawned_at > launch.start_timeout:
            run.task(index).failed()
            return task_failure(run, live, index, FailureKind.NOT_STARTED,
                                f"did not start within start_timeout = {launch.start_timeout:g} s")
    return hung(run, live, launch, now) or silent(run, live, launch, now)


def hung(run: RunRecord, live: LiveAttempt, launch: Launch, now: float) -> Failure | None:
    """A task whose progress stopped for heartbeat_timeout. A hang stalls its peers too (they wait in the
    all-reduce): the task named is the one that stopped, not a waiting peer: a process that is stopped
    (SIGSTOP), else the one furthest behind, longest silent."""
    running = [run.task(i) for i in live.live if i in live.progressed and run.task(i).state == TaskState.RUNNING]
    if not any(now - live.progressed[t.index] > launch.heartbeat_timeout for t in running):
        return None
    culprit = min(running, key=lambda t: (t.proc_status not in STOPPED, step(t.progress), live.progressed[t.index]))
    culprit.failed()
    stopped = " (its process is stopped, e.g. by SIGSTOP or a debugger)" if culprit.proc_status in STOPPED else ""
    return task_failure(run, live, culprit.index, FailureKind.HUNG, (
        f"sent no progress for {now - live.progressed[culprit.index]:.0f} s{stopped} (heartbeat_timeout = "
        f"{launch.heartbeat_timeout:g} s): hung, or its host is cut off"))


def silent(run: RunRecord, live: LiveAttempt, launch: Launch, now: float) -> Failure | None:
    """Before its first step a task has no heartbeat, but its core still sends a record every
    protocol.BEAT_S: one silent for the lifeline is lost (its host cut off while TensorFlow started)."""
    for index in live.live:
        heard = live.heard.get(index)
        if run.task(index).state == TaskState.RUNNING and heard and now - heard > launch.lifeline:
            run.task(index).failed()
            return task_failure(run, live, index, FailureKind.LOST, (
                f"sent no progress and no sign of life for {now - heard:.0f} s (its supervisor reports every "
                f"{protocol.BEAT_S:g} s; the limit is {launch.lifeline:g} s, from heartbeat_timeout = "
                f"{launch.heartbeat_timeout:g} s): its host is cut off or down, or its supervisor is stopped"))
    return None
