"""How the launcher reaches a host to start, watch and stop tasks: local processes here, SSH in ssh.py.

A started task's supervisor speaks `worker.host.protocol` on its stdout; `pump` turns that stream into
calls on a Sink (events, output lines, and lines that are not records, which are never fatal).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import IO, BinaryIO, Iterator, TypedDict

from launcher.engines.base import ProbeRow, Sink, parallel, pump
from launcher.plan import TaskPlan
from worker.host import layout
from worker.host.files import read_log
from worker.host.spawn import OWN_GROUP
from worker.host.protocol import BROKEN, GO, REGROUP

MAX_RECORD = 16 << 20  # a line longer than this is not one of our records


def env_line(plan: TaskPlan) -> bytes:
    """The task's environment for the supervisor's --env-stdin: never on a command line."""
    return (json.dumps(plan.env) + "\n").encode()


class SyncCounts(TypedDict):
    """What one host's `sync` did: files copied, files left as they were, bytes copied."""

    copied: int
    unchanged: int
    bytes: int


class LogUnreadable(OSError):
    """A task's worker.log could not be read on its host (the reason, in the host's words)."""


class Handle(ABC):
    """A started task; `stop()` asks its supervisor to stop it (idempotent). A standby's: `begin()` starts
    its attempt (False when that could not be said: its supervisor is gone)."""

    @abstractmethod
    def stop(self, broken: bool = False) -> None:
        """`broken`: see Launching.stop; said as worker.host.protocol.BROKEN before the EOF."""

    @abstractmethod
    def begin(self) -> bool:
        """Its attempt starts now (a standby's): False where that could not be said."""

    @abstractmethod
    def regroup(self) -> bool:
        """A notice: the task saves with its group and ends (the group regroups); False where it could not be
        said."""

    @abstractmethod
    def wait(self, timeout: float) -> bool:
        """Whether its supervisor has ended, waiting up to `timeout` seconds."""


class Transport(ABC):
    can_hold = False  # a preflight check can stay and become the task's supervisor (call_and_hold)

    @abstractmethod
    def start(self, plan: TaskPlan, attempt: int, sink: Sink, standby: bool = False) -> Handle:
        """Start the task's supervisor for `attempt`; `standby`: one that waits for Handle.begin()."""

    @abstractmethod
    def probe(self, plans: list[TaskPlan]) -> list[ProbeRow]:
        """Per task what its folder says (worker.task.probe.probe_many), in plan order."""

    @abstractmethod
    def stop_tasks(self, plans: list[TaskPlan]) -> list[ProbeRow]:
        """Stop tasks from their folders alone (no live handle needed)."""

    @abstractmethod
    def call(self, plan: TaskPlan, argv: list[str], timeout: float, stdin: bytes = b"") -> tuple[int, str, str]:
        """Run a short command in the task's folder on its host, `stdin` its input: (exit code, stdout, stderr)."""

    def call_and_hold(self, plan: TaskPlan, argv: list[str], timeout: float) -> tuple[int, str, str]:
        """As call(), for a command that prints one line and then waits, kept to become the task's supervisor
        (a transport that can_hold)."""
        raise NotImplementedError

    @abstractmethod
    def read_log(self, plan: TaskPlan, offset: int, tail: int | None) -> tuple[bytes, int]:
        """The task's worker.log from byte `offset` (or its last `tail` lines), as bytes; LogUnreadable."""

    def connect(self) -> float:
        """Reach and authenticate with the host now (preflight); seconds it took."""
        return 0.0

    def sync(self, files: list[tuple[str, str]], workdir: str | None) -> SyncCounts | None:
        """Copy (local path, relative path) files below the host's workdir; None: same file system."""
        return None

    def open_file(self, path: str, write: bool = False) -> BinaryIO:
        """A file on the host (an absolute path) to read, or to write (its folders made first, owner-only)."""
        if write:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        return open(path, "wb" if write else "rb")

    def close(self) -> None:
        pass


class LocalHandle(Handle):
    def __init__(self, proc: subprocess.Popen[bytes], stdin: IO[bytes]):
        self.proc, self.stdin = proc, stdin

    def stop(self, broken: bool = False) -> None:
        try:
            if broken:
                self.stdin.write(BROKEN)
            self.stdin.close()  # EOF: the supervisor stops its task and reports the exit
        except (OSError, ValueError):
            pass

    def begin(self) -> bool:
        return self._say(GO)

    def regroup(self) -> bool:
        return self._say(REGROUP)

    def _say(self, word: bytes) -> bool:
        try:
            self.stdin.write(word)
            self.stdin.flush()
            return True
        except (OSError, ValueError):
            return False

    def wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False


def _lines(stream: IO[bytes]) -> Iterator[bytes]:
    while True:
        line = stream.readline(MAX_RECORD)
        if not line:
            return
        yield line


class LocalTransport(Transport):
    """Tasks on localhost: the supervisor is our child; its stdin pipe is its lifeline."""

    def __init__(self) -> None:
        self.calls: set[subprocess.Popen[str]] = set()  # short commands running now: close() ends them
        self.lock = threading.Lock()
        self.closed = False

    def call(self, plan: TaskPlan, argv: list[str], timeout: float, stdin: bytes = b"") -> tuple[int, str, str]:
        with self.lock:  # a close() (Ctrl-C) never misses a command that is just starting
            if self.closed:
                raise RuntimeError("interrupted")
            try:
                proc = subprocess.Popen(argv, cwd=plan.cwd, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                                        start_new_session=True)  # Ctrl-C reaches us, and we stop it
            except FileNotFoundError as exc:
                if plan.cwd and exc.filename == plan.cwd:
                    return 1, "", f"cd: {plan.cwd}: No such file or directory"
                return 127, "", f"{argv[0]}: not found"
            except PermissionError:
                return 126, "", f"{argv[0]}: permission denied"
            self.calls.add(proc)
        try:
            out, err = proc.communicate(stdin.decode() if stdin else None, timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            err += f"\ndid not finish within {timeout:g} s"
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            self.calls.discard(proc)
        return proc.returncode, out, err

    def close(self) -> None:
        with self.lock:
            self.closed = True
            calls = list(self.calls)
        for proc in calls:
            _kill_group(proc)

    def start(self, plan: TaskPlan, attempt: int, sink: Sink, standby: bool = False) -> Handle:
        proc = subprocess.Popen(
            plan.supervisor_argv(attempt, standby=standby), cwd=plan.cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, **OWN_GROUP,
        )
        stdin, stdout = proc.stdin, proc.stdout
        assert stdin is not None and stdout is not None  # both pipes
        try:
            stdin.write(env_line(plan))
            stdin.flush()
        except OSError:
            pass  # it died at once: its output and exit code tell why

        def run() -> None:
            pump(plan.index, _lines(stdout), sink,
                 lambda: f"its supervisor ended with code {proc.wait()} and no exit report")
            proc.wait()  # reaped also when it reported its exit

        threading.Thread(target=run, daemon=True).start()
        return LocalHandle(proc, stdin)

    def read_log(self, plan: TaskPlan, offset: int, tail: int | None) -> tuple[bytes, int]:
        try:
            return read_log(Path(layout.file(_abs(plan), layout.WORKER_LOG)), offset, tail)
        except OSError as exc:
            raise LogUnreadable(exc.strerror or str(exc)) from None

    def probe(self, plans: list[TaskPlan]) -> list[ProbeRow]:
        from worker.task.probe import probe_many

        return probe_many([_abs(p) for p in plans])

    def stop_tasks(self, plans: list[TaskPlan]) -> list[ProbeRow]:
        from worker.task.probe import stop

        return [r.value if r.value is not None else ProbeRow(error=str(r.error))
                for r in parallel(lambda p: stop(_abs(p)), plans)]


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own group: all of it (a shell and its sleep)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def _abs(plan: TaskPlan) -> str:
    return os.path.join(plan.cwd or os.getcwd(), plan.run_dir)
