"""The task's fork server as its core holds it (worker.task.warm): an attempt forked from it, and a standby that
holds it for the next attempt, told in Standby records. Standard library only until the task runs, as the core:
worker.host.procs and protocol are imported in the methods, once load_rest() (the core's) has."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from worker.host import env, layout
from worker.host.system import Meter, private_memory
from worker.task import forkserver
from worker.task.forkserver import Request
from worker.task.program import Program
from worker.task.warm import Forked, NameTaken, NoServer, Server

if TYPE_CHECKING:
    from worker.task.core import TaskSetup

# a server's memory is read from its smaps (thousands of mappings: tens of ms of a core) this seldom, once it is ready
MEMORY_EVERY_S = 30.0
WARM_TRIES = 3  # a fork server that dies while its standby holds it is started again, this many times in all


class WarmStart:
    """The task's fork server, while this core holds it. What it needs of the core is handed in: the stop event,
    the program's environment, how to say things (emit a record, warn, tell) and load_rest, which imports what
    the running task needs (the core says nothing through the channel before)."""

    def __init__(self, setup: TaskSetup, stopping: threading.Event, program_env: Callable[[], dict[str, str]],
                 emit: Callable[[Any], None], warn: Callable[[str], None], tell: Callable[[str], None],
                 load_rest: Callable[[], None]):
        self.setup, self.stopping, self.program_env = setup, stopping, program_env
        self.emit, self.warn, self.tell, self.load_rest = emit, warn, tell, load_rest
        self.name = forkserver.name(setup.env.get(env.RUN_ID, ""), setup.env.get(env.TASK_INDEX, ""))
        self.program = Program.of(setup.argv, sys.executable) if setup.warm else None  # None: it starts cold
        self.begun, self.woken = threading.Event(), threading.Event()  # a standby's start; any reason to look
        self.server: Server | None = None  # the task's fork server, while this core holds it
        self.memory: tuple[int, float, int | None] | None = None  # (server pid, when read, what holding it adds)

    @property
    def server_env(self) -> dict[str, str]:
        return {**self.program_env(), env.ATTEMPT: env.FORK_SERVER}

    def open_server(self, idle: bool) -> Server:
        assert self.program is not None
        return Server.open(self.name, self.server_env, os.getcwd(),
                           layout.file(self.setup.run_dir, layout.FORK_LOG), idle, self.program.ours)

    def start_forked(self) -> tuple[Forked | None, bool]:
        """The attempt forked by its task's fork server, started here where none runs (then the built-in runner's
        attempt pays for the imports, as a cold one does; a user's program starts cold while its server imports in
        the idle time), and whether the server had them done already. The attempt is None where it is not forked
        (it starts cold) or a stop came first."""
        if self.program is None:
            return None, False
        self.load_rest()
        from worker.host import protocol
        ours = self.program.ours is not None
        if self.server is None or not self.server.look():
            try:
                self.server = self.open_server(idle=not ours)
            except NameTaken as exc:
                self.warn(f"attempt {self.setup.attempt} starts cold: its fork server's {exc}")
                return None, False
            except NoServer:
                return None, False  # the attempt starts cold: what is wrong (an import that fails), its program says
        server = self.server
        if not server.ready and not ours:  # a user's program may import nothing heavy: it starts cold, its server
            return None, False  # imports in the CPU time left, for the attempts after it
        warm, meter, beat_at = server.ready, Meter(server.pid), 0.0
        server.hurry()
        while not server.ready and not self.stopping.is_set():
            if time.monotonic() - beat_at >= protocol.BEAT_S:  # its imports are this attempt's start: a beat
                beat_at = time.monotonic()
                cpu, rss, status = meter.read()
                self.emit(protocol.Stats(cpu_percent=cpu, rss=rss, status=status))
            if not server.look(0.2):
                return None, False
        if self.stopping.is_set():
            return None, False
        forked = server.fork(Request(self.program, self.program_env(), os.getcwd(),
                                     tuple(self.setup.cpus) if self.setup.cpus else None, self.setup.parent_death,
                                     self.setup.grace))
        return forked, warm and forked is not None

    def hold(self) -> bool:
        """Hold the task's fork server for the next attempt (started, at the idle priority, where none runs)
        until begin() (True) or a stop (False), told to the launcher in Standby records. One that dies is started
        again (WARM_TRIES in all), then the attempt will start cold."""
        self.load_rest()
        from worker.host import protocol
        tries, beat_at, ended = 0, 0.0, ""
        if self.program is None and self.setup.warm:  # said once, where the run would otherwise not know why
            self.tell(f"no standby: {Program.cold(self.setup.argv, sys.executable)}; a restart starts it cold")
        while not self.begun.is_set() and not self.stopping.is_set():
            if self.server is not None and not self.server.look():
                ended = self.server.ended()
                self.server.close()
                self.server = None
                if tries >= WARM_TRIES:
                    self.gave_up(ended)
            if self.server is None and self.program is not None and tries < WARM_TRIES:
                tries += 1
                try:
                    self.server = self.open_server(idle=True)
                except NameTaken as exc:
                    self.warn(f"no standby for attempt {self.setup.attempt}: its fork server's {exc}")
                    ended, tries = str(exc), WARM_TRIES  # another account's: asking again changes nothing
                except NoServer as exc:
                    ended = str(exc)
                    if tries >= WARM_TRIES:
                        self.gave_up(ended)
            if time.monotonic() - beat_at >= protocol.BEAT_S:
                beat_at = time.monotonic()
                self.tell_standby(ended)
            self.woken.wait(0.2)
            self.woken.clear()
        return self.begun.is_set() and not self.stopping.is_set()

    def gave_up(self, ended: str) -> None:
        self.tell(f"its fork server {ended}, {WARM_TRIES} times in all: none is started again, so attempt "
                  f"{self.setup.attempt} starts cold if the run restarts")

    def tell_standby(self, ended: str) -> None:
        """Its fork server, whether it is ready, and the memory holding it adds: the server's own and ours."""
        from worker.host import procs, protocol
        server = self.server
        ident = procs.identity(server.pid) if server else None
        if server is not None and server.ready and (self.memory is None or self.memory[0] != server.pid
                                                    or time.monotonic() - self.memory[1] >= MEMORY_EVERY_S):
            held = [private_memory(server.pid), private_memory(os.getpid())]
            self.memory = (server.pid, time.monotonic(), sum(held) if None not in held else None)  # type: ignore
        memory = self.memory[2] if server is not None and self.memory and self.memory[0] == server.pid else None
        self.emit(protocol.Standby(pid=ident[0] if ident else 0, create_time=ident[1] if ident else 0.0,
                                   ready=bool(server and server.ready), memory=memory, ended=ended if not server else ""))

    def begin(self) -> None:
        """The launcher's word: this standby's attempt starts now."""
        self.begun.set()
        self.woken.set()

    def wake(self) -> None:
        """A stop: a standby looks at once."""
        self.woken.set()

    @property
    def server_pid(self) -> int | None:
        """The pid of the fork server this core holds (it serves the next attempt: never an attempt's leftover)."""
        return self.server.pid if self.server is not None else None

    def release_server(self) -> None:
        """Let go of the task's fork server: where this core held it last, it has ended before the core tells its
        own end (a run's end leaves no server behind)."""
        if self.server is not None:
            self.server.release()
            self.server = None
