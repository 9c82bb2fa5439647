"""The on-host task core: runs one task on its host, whoever started it (our supervisor over a pipe,
`srun`, a Kubernetes pod), and reports on it in `worker.host.protocol` records on a Channel.

It starts the training in its own process group (given SIGTERM if the core dies), keeps worker.log
whole, forwards output (long lines cut, a flood thinned, never ahead of an exit or a beat), relays
progress and stats, stops with grace (a notice gets preempt_grace), sweeps what the task left
behind, and guards every write: a full disk or a deleted folder never loses the exit code.
Standard library only until the task runs (procs/psutil and protocol are imported after).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.host.devices import GpuMeter
from worker.host import env, layout
from worker.host.entries import GRACE_S
from worker.host.spawn import OWN_GROUP, stop_group
from worker.host.system import Meter, child_setup, port_holder, private_memory
from worker.task import forkserver
from worker.task.channel import Channel
from worker.task.folder import TaskFolder
from worker.task.forkserver import Request
from worker.task.lines import NOTE, Lines
from worker.task.program import Program
from worker.task.warm import Forked, NameTaken, NoServer, Server

procs: Any = None  # worker.host.procs and worker.host.protocol: imported once the task runs (~30 ms)
protocol: Any = None
BROKEN_GRACE_S = 0.0  # a broken group's stop: a peer failed, so a save with the group cannot land (KILL at once)
# progress.json is read about once a second: each wake-up takes a core from the training (4 a second cost ~2% of
# the steps on 2 cores); each read 0.5 to 1.5 s after the last, or epochs of about 1 s are read at one step each
PROGRESS_POLL_S, POLL_JITTER = 1.0, 0.5
FORWARD_EVERY_S = 0.1  # output is sent at most this often (a flood in batches)
FORWARD_MAX_LINES = 400  # per batch; beyond that a flood is thinned (worker.log keeps all)
FORWARD_MAX_BYTES = 8192  # per batch: a slow link holds little output ahead of an exit or a beat
EXIT_SETUP, EXIT_NOT_FOUND = 2, 127  # the task could not be set up (see worker.log); its program not found
# a server's memory is read from its smaps (thousands of mappings: tens of ms of a core) this seldom, once it is ready
MEMORY_EVERY_S = 30.0
WARM_TRIES = 3  # a fork server that dies while its standby holds it is started again, this many times in all


def _import_rest() -> None:
    global procs, protocol
    from worker.host import protocol
    from worker.host import procs


@dataclass(frozen=True)
class TaskSetup:
    run_dir: Path  # the task's own folder on this host
    attempt: int
    argv: list[str]
    env: dict[str, str]  # on top of the core's own environment
    cpus: list[int] | None = None
    port: int | None = None  # refuse to start when something listens there
    grace: float = GRACE_S
    preempt_grace: float = GRACE_S
    host: str = ""  # told in Started where the engine learns it only now (a scheduler's node)
    report_port: int = 0
    parent_death: int = signal.SIGTERM  # what the task gets if the core dies (Slurm: SIGKILL, it kills us so)
    echo: bool = False  # the training's output also on our stdout (a pod's: what `kubectl logs` shows)
    notes: list[str] = field(default_factory=list)  # said before the start (the entry's own findings)
    warm: bool = False  # the attempt forked by its task's fork server (worker.task.forkserver), started where none runs
    standby: bool = False  # hold the fork server now, and start the attempt on begin()


class TaskCore:
    def __init__(self, setup: TaskSetup, channel: Channel):
        self.setup, self.channel = setup, channel
        self.run_dir = setup.run_dir
        self.stopping = threading.Event()
        self.proc: subprocess.Popen[bytes] | Forked | None = None
        self.lines = Lines()
        self.last_progress = b""
        self.notice = ""  # the signal that gave notice, if one did
        self.grace = setup.grace  # TERM to KILL, as the stop asked
        self.folder = TaskFolder(setup.run_dir, self.tell)
        self.run_id = setup.env.get(env.RUN_ID, "")
        self.index = setup.env.get(env.TASK_INDEX, "")
        self.begun, self.woken = threading.Event(), threading.Event()  # a standby's start; any reason to look
        self.server: Server | None = None  # the task's fork server, while this core holds it
        self.memory: tuple[int, float, int | None] | None = None  # (server pid, when read, what holding it adds)
        self.gpus: GpuMeter | None = None  # its GPUs' figures, read while it runs where nvidia-smi is
        self.gpus_said = False  # what nvidia-smi's readings left out, said once
        self.program = Program.of(setup.argv, sys.executable) if setup.warm else None  # None: it starts cold

    # ---- what we say
    def emit(self, event: Any) -> None:  # a worker.host.protocol.Event: imported once the task runs
        self.channel.send(protocol.encode(event))

    def note(self, text: str) -> None:
        """A line of our own, shown with the task's output and kept in its log."""
        line = NOTE + text
        self.folder.log_write((line + "\n").encode())
        self.lines._add([line])

    def warn(self, text: str) -> None:
        """A problem the user should know of while the task goes on: a record, and a line in its log."""
        self.note(text)
        self.tell(text)

    def tell(self, text: str) -> None:
        """A Note record, or one kept for the start when the channel's protocol is not loaded yet."""
        if protocol is not None:
            self.emit(protocol.Note(text=text))
        else:
            self.setup.notes.append(text)

    def prepare(self) -> None:
        self.folder.prepare(f"--- attempt {self.setup.attempt}: {' '.join(self.setup.argv)}\n".encode())

    @property
    def program_env(self) -> dict[str, str]:
        return env.program_environment(os.environ, self.setup.env, str(self.run_dir), str(self.setup.attempt))

    def run(self) -> int:
        s = self.setup
        if s.standby and not self.hold():
            self.release_server()
            return 0  # stopped before its start: nothing of it is left, and nothing to report
        self.prepare()
        if self.stopping.is_set():  # a signal before the start: nothing is started
            _import_rest()
            return self.refuse(protocol.EXIT_PREEMPTED if self.notice else -signal.SIGTERM,
                               f"stopped before it started ({self.notice or 'a stop request'})")
        holder = port_holder(s.port) if s.port else None
        if holder:
            _import_rest()
            return self.refuse(protocol.EXIT_PORT_BUSY, f"port {s.port} was taken by {holder} after the preflight, so "
                               "the task was not started; stop that process or choose another port, then run again")
        warm = self.start_forked()
        if self.proc is None and self.stopping.is_set():  # stopped while its fork server imported
            return self.refuse(protocol.EXIT_PREEMPTED if self.notice else -signal.SIGTERM,
                               f"stopped before it started ({self.notice or 'a stop request'})")
        if self.proc is None:
            try:
                self.proc = subprocess.Popen(s.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, env=self.program_env,
                                             preexec_fn=child_setup(s.parent_death, s.cpus), **OWN_GROUP)
            except (OSError, ValueError) as exc:  # ValueError: a NUL in an argument or the environment
                why = exc.strerror if isinstance(exc, OSError) else str(exc)
                return self.refuse(EXIT_NOT_FOUND, f"cannot start {s.argv[0]!r}: {why}")
        _import_rest()
        self.meter = Meter(self.proc.pid)
        self.gpus = GpuMeter(self.program_env.get(env.VISIBLE_DEVICES)) if GpuMeter.wanted() else None
        pump = threading.Thread(target=self.pump, daemon=True)
        pump.start()
        if s.cpus:
            try:
                os.sched_setaffinity(self.proc.pid, s.cpus)
            except OSError as exc:
                self.note(f"cannot pin to cpus {s.cpus}: {exc.strerror}")
        ident = procs.identity(self.proc.pid) or (self.proc.pid, time.time())
        me = procs.identity(os.getpid()) or (os.getpid(), time.time())
        self.folder.write(layout.PID, f"{self.proc.pid}\n")
        self.folder.write(layout.TASK_INFO, json.dumps({
            "pid": ident[0], "create_time": ident[1], "supervisor_pid": me[0], "supervisor_create_time": me[1],
            "run_id": self.run_id, "index": self.index, "attempt": s.attempt, "host": s.host,
            "port": s.report_port}))
        self.emit(protocol.Started(pid=ident[0], create_time=ident[1], supervisor_pid=me[0], time=time.time(),
                                   host=s.host, port=s.report_port, warm=warm))
        self.send_notes()
        if self.stopping.is_set():  # a stop that came while we were starting
            self.stop_task(self.grace)
        threading.Thread(target=self.watch, daemon=True).start()
        code = self.proc.wait()
        self.folder.write(layout.EXIT_CODE, f"{code}\n")  # before any send: a send may block (a cut-off link)
        pump.join(timeout=2.0)
        self.send_progress()  # the last word of a finished run
        left = procs.of_task(self.run_id, self.index, attempt=s.attempt) if self.run_id else []
        if left:  # the program exited but left processes behind (setsid, daemons): they go too
            self.note(f"stopping {len(left)} process(es) the task left behind: {[p.pid for p in left]}")
            procs.stop(left, s.grace)
        return self.finish(code)

    # ---- the fork server: an attempt forked from it, and a standby that holds it for the next attempt
    @property
    def server_env(self) -> dict[str, str]:
        return {**self.program_env, env.ATTEMPT: env.FORK_SERVER}

    def open_server(self, idle: bool) -> Server:
        assert self.program is not None
        return Server.open(forkserver.name(self.run_id, self.index), self.server_env, os.getcwd(),
                           layout.file(self.run_dir, layout.FORK_LOG), idle, self.program.ours)

    def start_forked(self) -> bool:
        """The attempt forked by its task's fork server, started here where none runs (then the built-in runner's
        attempt pays for the imports, as a cold one does; a user's program starts cold while its server imports in
        the idle time): True when the server had them done already; self.proc stays None where it is not forked
        (the attempt starts cold) or a stop came first."""
        if self.program is None:
            return False
        _import_rest()
        ours = self.program.ours is not None
        if self.server is None or not self.server.look():
            try:
                self.server = self.open_server(idle=not ours)
            except NameTaken as exc:
                self.warn(f"attempt {self.setup.attempt} starts cold: its fork server's {exc}")
                return False
            except NoServer:
                return False  # the attempt starts cold: what is wrong (an import that fails), its program says
        server = self.server
        if not server.ready and not ours:  # a user's program may import nothing heavy: it starts cold, its server
            return False  # imports in the CPU time left, for the attempts after it
        warm, meter, beat_at = server.ready, Meter(server.pid), 0.0
        server.hurry()
        while not server.ready and not self.stopping.is_set():
            if time.monotonic() - beat_at >= protocol.BEAT_S:  # its imports are this attempt's start: a beat
                beat_at = time.monotonic()
                cpu, rss, status = meter.read()
                self.emit(protocol.Stats(cpu_percent=cpu, rss=rss, status=status))
            if not server.look(0.2):
                return False
        if self.stopping.is_set():
            return False
        self.proc = server.fork(Request(self.program, self.program_env, os.getcwd(),
                                        tuple(self.setup.cpus) if self.setup.cpus else None, self.setup.parent_death))
        return warm and self.proc is not None

    def hold(self) -> bool:
        """Hold the task's fork server for the next attempt (started, at the idle priority, where none runs)
        until begin() (True) or a stop (False), told to the launcher in Standby records. One that dies is started
        again (WARM_TRIES in all), then the attempt will start cold."""
        _import_rest()
        tries, beat_at, ended = 0, 0.0, ""
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

    def refuse(self, code: int, reason: str) -> int:
        self.folder.write(layout.EXIT_CODE, f"{code}\n")
        self.note(reason)
        _import_rest()
        return self.finish(code, reason)

    def send_notes(self) -> None:
        while self.setup.notes:
            self.emit(protocol.Note(text=self.setup.notes.pop(0)))

    def release_server(self) -> None:
        """Let go of the task's fork server: where this core held it last, it has ended before the core tells its
        own end (a run's end leaves no server behind)."""
        if self.server is not None:
            self.server.release()
            self.server = None

    def finish(self, code: int, reason: str = "") -> int:
        self.release_server()
        self.send_notes()
        self.forward(final=True)
        # a notice to a task that then exited 0 is no preemption: it finished
        self.emit(protocol.Exit(code=code, time=time.time(), tail=self.lines.tail_lines(), reason=reason,
                                notice=self.notice if code != 0 else ""))
        return 128 - code if code < 0 else code

    @property
    def child(self) -> subprocess.Popen[bytes] | Forked:
        """The task's process, once started (pump, watch and the stops run only then)."""
        assert self.proc is not None, "the task is not started"
        return self.proc

    def pump(self) -> None:
        stdout = self.child.stdout
        assert stdout is not None  # started with stdout=PIPE (a forked one: its pipe)
        fd = stdout.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            self.folder.log_write(chunk)
            self.lines.feed(chunk)
            if self.setup.echo:
                try:
                    os.write(1, chunk)
                except OSError:
                    pass
        self.lines.close()

    def forward(self, final: bool = False) -> bool:
        """Send output the channel has room for now; what it has no room for waits, and a flood is
        thinned (so output is bounded by what the link drains, never ahead of an exit or a beat)."""
        if not self.channel.room():
            if final:
                self.lines.drop_pending()
            return False
        lines, dropped = self.lines.take(FORWARD_MAX_LINES, FORWARD_MAX_BYTES)
        if lines or dropped:
            self.emit(protocol.Output(lines=lines, dropped=dropped))
        return bool(lines or dropped)

    def send_progress(self, notice_only: bool = False) -> None:
        """progress.json as a Progress record (`notice_only`: only one that says "preempting"); one that cannot
        be read, parsed or encoded is no progress (the training writes it: untrusted input)."""
        try:
            with open(layout.file(self.run_dir, layout.PROGRESS), "rb") as f:
                raw = f.read(protocol.FILE_MAX_BYTES + 1)
            if raw == self.last_progress:  # read on each output batch too: most reads find nothing new
                return
            data = protocol.json_object(raw)
            if notice_only and protocol.ProgressState.of(data) != protocol.ProgressState.PREEMPTING:
                return
            self.last_progress = raw
            if data is None:
                return
            record = protocol.encode(protocol.Progress(progress=data))
        except (OSError, ValueError, RecursionError, MemoryError):
            return
        self.channel.send(record)
        if protocol.ProgressState.of(data) == protocol.ProgressState.PREEMPTING and not self.stopping.is_set():
            # the task took a notice (a SIGTERM sent to it, or one of its peers'): a preemption, whatever
            # comes next; it gets preempt_grace to save with its group, not more
            self.stopping.set()
            self.notice = "SIGTERM (to the task or a peer)"
            threading.Timer(self.setup.preempt_grace - self.since(data.get("time")), self.past_grace).start()

    @staticmethod
    def since(written: Any) -> float:
        """How long ago the task wrote a record that says `time: written`; we read it up to a poll later."""
        try:
            elapsed = time.time() - float(written)
        except (TypeError, ValueError, OverflowError):  # no time, or not one (a user's own record)
            return 0.0
        return min(elapsed, PROGRESS_POLL_S * (1 + POLL_JITTER)) if elapsed > 0 else 0.0  # (NaN, a clock step back)

    def past_grace(self) -> None:
        if self.child.poll() is None:
            self.note(f"still running {self.setup.preempt_grace:g} s (preempt_grace) after its notice: killed")
            self.stop_task(0)

    def watch(self) -> None:
        """Forward output, progress and stats until the task ends. Wakes when output arrives (at most
        every FORWARD_EVERY_S) or a poll is due, not on a fixed tick."""
        poll_at = stats_at = 0.0
        while self.child.poll() is None:
            spoke = self.forward()
            if spoke:
                time.sleep(FORWARD_EVERY_S)  # more is coming: send it in batches
            now = time.monotonic()
            # also read it when the task spoke: the worker prints its notice just after writing
            # "preempting", and preempt_grace may be shorter than a poll. Only a notice goes out then:
            # progress read at each epoch line would show a short epoch's step as its last, always
            if now >= poll_at:
                poll_at = now + PROGRESS_POLL_S * random.uniform(1 - POLL_JITTER, 1 + POLL_JITTER)
                self.send_progress()
            elif spoke:
                self.send_progress(notice_only=True)
            if now - stats_at >= protocol.BEAT_S:
                stats_at = now
                self.send_stats()
            wait = max(0.0, min(poll_at, stats_at + protocol.BEAT_S) - time.monotonic())
            if self.lines.pending:  # output that waits for room on the channel: look again soon
                time.sleep(min(wait, FORWARD_EVERY_S))
            else:
                self.lines.arrived.wait(wait)

    def send_stats(self) -> None:
        """CPU%, RSS, state and GPUs of the task, and in any case a record: the launcher counts a core
        silent for its lifeline as lost."""
        cpu, rss, status = self.meter.read()
        gpus = self.gpus.latest if self.gpus else None
        if self.gpus is not None and self.gpus.dropped and not self.gpus_said:
            self.gpus_said = True
            said = (f"{self.gpus.dropped}; the task goes on, and its GPUs show only the figures kept (check "
                    "nvidia-smi on this host)")
            self.folder.log_write((NOTE + said + "\n").encode())  # in its log; on screen once, as the launcher's
            self.tell(said)
        self.emit(protocol.Stats(cpu_percent=cpu, rss=rss, status=status, gpus=gpus))

    # ---- stopping
    def stop(self, reason: str, notice: str = "", broken: bool = False) -> None:
        """Stop the task: TERM to its group, KILL after grace. A `notice` (the signal's name: a host or
        scheduler taking the machine) gets preempt_grace, and the task's end is a preemption; a `broken`
        group's (a peer failed: a save with it cannot land) at most BROKEN_GRACE_S."""
        # a notice after a stop (Slurm's TERM after our INT) is no preemption; one after the task ended is nothing
        if self.stopping.is_set() or self.proc is not None and self.proc.poll() is not None:
            return
        self.stopping.set()
        self.woken.set()
        self.notice = notice
        grace = self.setup.preempt_grace if notice else self.setup.grace
        self.grace = min(grace, BROKEN_GRACE_S) if broken and not notice else grace
        self.note(f"stopping task ({reason}; " + (f"KILL after {self.grace:g} s)" if self.grace else "KILL at once)"))
        if self.proc is not None:  # else run() stops it right after starting it
            self.stop_task(self.grace)

    def stop_task(self, grace: float) -> None:
        _import_rest()  # a stop may come from another thread as the task starts
        stop_group(self.child, grace)
        if self.run_id:
            procs.stop(procs.of_task(self.run_id, self.index, attempt=self.setup.attempt), 0)
