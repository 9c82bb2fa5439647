"""The seam between the run (the agent, status, logs, down) and an engine that brings tasks to life.

An engine plans its tasks, checks their hosts, starts an attempt, reports on it through a Sink
(worker.host.protocol events and output lines), stops it, and reads what a task's host says; the rest
of the launcher sees nothing else. Adding an engine is one folder under launcher/engines/.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Generic, Iterable, Protocol, Sequence, TypeVar

from launcher.plan import TaskPlan
from launcher.spec.cluster import ClusterSpec
from worker.host import protocol
from worker.host.probed import ProbeRow as ProbeRow  # what a task's host says of it (read where it arrives)
from worker.host.startpoint import Found

T = TypeVar("T")
I = TypeVar("I")
MAX_THREADS = 32
JobRecord = dict[str, str | list[str] | None]  # a scheduler's job as the run record keeps it (id, mode, ids, name)


class EngineKind(str, enum.Enum):
    SUPERVISED = "supervised"  # our supervisor per task: local processes and SSH hosts
    SLURM = "slurm"  # srun starts the task core on each node; Slurm signals and stops
    KUBERNETES = "kubernetes"  # a rendered JobSet; Kubernetes starts the task core in each pod

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Result(Generic[T]):
    """One host's (or task's) outcome: a value, or the error that stopped it."""

    value: T | None = None
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def parallel(fn: Callable[[I], T], items: list[I], width: int = MAX_THREADS) -> list[Result[T]]:
    """fn over items in threads (at most `width` at once); every item's Result, in order:
    one host's failure never hides another's."""
    def one(item: I) -> Result[T]:
        try:
            return Result(value=fn(item))
        except Exception as exc:
            return Result(error=exc)

    if len(items) <= 1:
        return [one(i) for i in items]
    pool = ThreadPoolExecutor(max(1, min(width, len(items))))
    try:
        return list(pool.map(one, items))
    finally:  # on Ctrl-C, return at once: the caller's close() ends what the threads wait on
        pool.shutdown(wait=False, cancel_futures=True)


class Claim(Protocol):
    """A lock held for the run (a host:port claim), released when it ends."""

    def release(self) -> None: ...


class Sink(Protocol):
    def event(self, index: int, event: protocol.Event) -> None: ...

    def output(self, index: int, lines: list[str], dropped: int) -> None: ...

    def garbage(self, index: int, text: str) -> None: ...


class Pump:
    """A task's records, one line at a time, to a Sink: decoded with protocol.decode (a line that is not
    a record is passed on as garbage, never fatal). `end()` reports the task Lost, for the reason
    lost() gives, when no exit report came: every task ends in Exit or Lost, whatever ended its lines."""

    def __init__(self, index: int, sink: Sink, lost: Callable[[], str]):
        self.index, self.sink, self.lost = index, sink, lost
        self.exited = False

    def feed(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            event = protocol.decode(line)
        except protocol.BadRecord:
            self.sink.garbage(self.index, line[:2000].decode("utf-8", "replace").rstrip())
            return
        if isinstance(event, protocol.Output):
            self.sink.output(self.index, event.lines, event.dropped)
        else:
            self.exited |= isinstance(event, protocol.Exit)
            self.sink.event(self.index, event)

    def end(self) -> None:
        if not self.exited:
            self.exited = True
            self.sink.event(self.index, protocol.Lost(self.lost()))


def pump(index: int, lines: Iterable[bytes], sink: Sink, lost: Callable[[], str]) -> None:
    """Feed a task's record stream to `sink` until its lines end (or reading them fails); then Lost if
    no exit report came."""
    p = Pump(index, sink, lost)
    try:
        for line in lines:
            p.feed(line)
    finally:
        p.end()


class SchedulerCause(str, enum.Enum):
    """Why a scheduler ended (or took back) an attempt, whatever its tasks said."""

    REQUEUED = "requeued"  # back in the queue (scontrol requeue, a node failure, preemption): it runs again
    TIME_LIMIT = "time_limit"
    CANCELLED = "cancelled"  # from outside (scancel by someone else)
    NODE_FAIL = "node_fail"  # a node failed and the job is not requeued
    ENDED = "ended"  # any other end the scheduler reports

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SchedulerEnd:
    cause: SchedulerCause
    reason: str  # one sentence, with the scheduler's own words (state, reason)


@dataclass
class TaskCheck:
    """The preflight's verdict on one task (or, for a scheduler, on the whole job), and what it found that
    the task's environment needs (NCCL_SOCKET_IFNAME: the interface that carries its address): kept in
    the run record, given to the task at each start."""

    plan: TaskPlan
    problems: list[str] = field(default_factory=list)
    versions: dict[str, str | None] = field(default_factory=dict)  # None: not installed
    title: str = ""  # the row's name when it is not one task's
    env: dict[str, str] = field(default_factory=dict)
    checkpoint: Found | None = None  # what its checkpoint folder holds, where the run may start from it

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def label(self) -> str:
        return self.title or self.plan.label


class Landed(Protocol):
    """What the run record knows of a run that the spec and its plans do not: where each task landed
    (host, port: a scheduler's node), what the preflight found for its environment, and the scheduler's
    job. Engines read these facts from the record (launcher.run.record.RunRecord); they keep no copy."""

    job: JobRecord | None

    def host_of(self, index: int) -> tuple[str, int]: ...

    def found_env(self, index: int) -> dict[str, str]: ...


class Engine(ABC):
    """Every engine plans its tasks and shows how it would run them; what else it does, it says by the
    roles it takes: Launching (`check` and `up` start its runs) and Inspecting (`status`, `logs`,
    `stacks` and `down` read and stop its recorded runs)."""

    kind: EngineKind

    def __init__(self, spec: ClusterSpec, run_id: str, only: list[int] | None = None, landed: Landed | None = None):
        self.spec, self.run_id, self.landed = spec, run_id, landed
        self.plans = self.plan_tasks(only)
        self.plan = {p.index: p for p in self.plans}  # by task index (not always 0..n-1: elastic runs)

    def recorded_in(self, landed: Landed) -> None:
        """The run's record, once `up` has made it (the engine planned the tasks it lists): where the engine reads
        what the run learns from then on."""
        self.landed = landed

    @abstractmethod
    def plan_tasks(self, only: list[int] | None) -> list[TaskPlan]:
        """Every task's plan (pure); `only`: the task indices that take part (elastic: fewer hosts)."""

    @abstractmethod
    def dry_run(self, say: Callable[[str], None]) -> None:
        """Print what `up` would start, and how (secrets masked); start nothing."""

    def not_started_here(self, spec_path: str = "SPEC") -> str | None:
        """None when `check` and `up` start this engine's runs; else how they are run instead (a paragraph:
        a rendered engine's runs are applied with the cluster's own tool)."""
        return None

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class BackupCopy:
    """What a restart's copy of the run's backup did (checkpoints with nothing shared): the task whose host's copy
    was the truth (None: no live host holds a backup of the run) and the global steps it holds (`spare`: the spare
    copy kept on that task's host, where the chief's was lost; `finished`: the run's training had ended there), the
    tasks whose hosts were given a copy (or already held the same bytes), the bytes copied and the seconds it took;
    `error` (with the task and host it concerns) where a copy could not be made, and then no task starts."""

    source: int | None
    steps_done: int | None
    copied: tuple[int, ...] = ()
    same: tuple[int, ...] = ()
    bytes: int = 0
    seconds: float = 0.0
    error: str = ""
    task: int | None = None
    host: str | None = None
    spare: bool = False
    finished: bool = False


@dataclass(frozen=True)
class StandbyState:
    """A task's standby as its engine last heard of it: the fork server it holds (pid), whether that has imported
    what it imports, the private memory holding it adds (bytes; None: not read yet), the attempt it is for."""

    pid: int
    ready: bool
    memory: int | None
    attempt: int


class Launching(Engine):
    """An engine that starts its runs: checks the hosts, starts an attempt, stops it, says why it ended."""

    on_job: Callable[[JobRecord], None] = staticmethod(lambda _job: None)  # told when a scheduler's job is known
    # told what each task's standby is now (None: it has none)
    on_standby: Callable[[int, StandbyState | None], None] = staticmethod(lambda _index, _standby: None)
    # told a line about a task from outside its attempt (its standby, given up on), to show as the task's
    on_note: Callable[[int, str], None] = staticmethod(lambda _index, _text: None)

    @abstractmethod
    def preflight(self, base: Path | None, say: Callable[[str], None], for_start: bool = False) -> list[TaskCheck]:
        """Check hosts and ports, start nothing. `for_start`: `up` starts the tasks next (an engine
        may keep what it opened for the checks)."""

    def claim_ports(self) -> Sequence[Claim]:
        """Locks on the host:port pairs this run will use (two runs of this machine never share one)."""
        return []

    @abstractmethod
    def start(self, attempt: int, sink: Sink) -> dict[int, str]:
        """Start every task of `attempt`, reporting to `sink`; {index: why it could not start}. Returns
        once the tasks are on their way (a scheduler: once its job left the queue)."""

    @abstractmethod
    def stop(self, indices: list[int], broken: bool = False) -> None:
        """Ask these live tasks to stop now; each one's Exit (or Lost) follows on the sink. `broken`: a peer
        failed and these tasks' TERM is a save with the whole group (the built-in runner's), which cannot land:
        where the engine can, KILL follows TERM shortly, not after stop_grace."""

    def regroup(self, indices: list[int]) -> list[int]:
        """Give these live tasks notice that the group regroups (a lost host is back): each saves with its group
        and ends, as on a preemption's notice, and its Exit follows on the sink. The tasks it could not tell (None
        of them where the engine cannot regroup: the caller grows no group then)."""
        return list(indices)

    def verdict(self, attempt: int) -> SchedulerEnd | None:
        """After `attempt` ended (its tasks exited or were lost): whether the scheduler ended or took
        it back, and why; None where no scheduler decides (our supervisors) or it did not."""
        return None

    def reachable(self, indices: list[int]) -> list[Result[float]]:
        """Whether each task's host answers now (elastic runs drop the ones that do not)."""
        return [Result(value=0.0) for _ in indices]

    def share_backup(self, first: bool) -> BackupCopy | None:
        """Before a restart's tasks start (or the `first` attempt's, of a run that goes on from another): every host
        that restores holds a whole copy of the run's newest backup (checked by size and SHA-256). None where
        nothing was there to bring, or the engine's tasks read one folder (a scheduler's shared storage)."""
        return None


class Inspecting(Engine):
    """An engine whose recorded runs are read and stopped with no launcher: from the tasks' folders
    on their hosts, where the run record says they landed."""

    @abstractmethod
    def probe(self, indices: list[int]) -> list[Result[ProbeRow]]:
        """What each task's host says now: pid, alive, exit_code, progress, cpu_percent, rss."""

    @abstractmethod
    def read_log(self, index: int, offset: int, tail: int | None = None) -> tuple[bytes, int]:
        """worker.log of a task from byte `offset` (or its last `tail` lines), as bytes: (data, next offset)."""

    @abstractmethod
    def call(self, index: int, argv: list[str], timeout: float) -> tuple[int, str, str]:
        """Run a short command on task `index`'s host, in its folder: (exit code, stdout, stderr)."""

    def open_file(self, index: int, path: str) -> BinaryIO:
        """A file on task `index`'s host (an absolute path, as `call` there gives it) to read; here by default
        (a local host, or a scheduler's shared folder)."""
        return open(path, "rb")

    @abstractmethod
    def stop_from_folders(self, indices: list[int]) -> list[Result[ProbeRow]]:
        """Stop tasks with no live handle (`down`, a teardown past its deadline); per task."""
