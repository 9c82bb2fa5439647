"""The on-host task core: runs one task on its host, whoever started it (our supervisor over a pipe,
`srun`, a Kubernetes pod), and reports on it in `worker.host.protocol` records on a Channel.

It starts the training in its own process group (given SIGTERM if the core dies), or forks it from the task's
fork server (worker.task.warmstart), keeps worker.log whole, has its output, progress and stats relayed
(worker.task.relay), stops with grace (a notice gets preempt_grace), sweeps what the task left behind, and guards
every write: a full disk or a deleted folder never loses the exit code.
Standard library only until the task runs (procs/psutil and protocol are imported after).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.host.devices import GpuMeter
from worker.host import env, layout
from worker.host.entries import GRACE_S
from worker.host.spawn import OWN_GROUP, stop_group
from worker.host.system import Meter, adopt_orphans, child_setup, port_holder
from worker.task.channel import Channel
from worker.task.folder import TaskFolder
from worker.task.lines import NOTE, Lines
from worker.task.relay import Relay
from worker.task.warm import Forked
from worker.task.warmstart import WarmStart

procs: Any = None  # worker.host.procs and worker.host.protocol: imported once the task runs (~30 ms)
protocol: Any = None
BROKEN_GRACE_S = 0.0  # a broken group's stop: a peer failed, so a save with the group cannot land (KILL at once)
EXIT_SETUP, EXIT_NOT_FOUND = 2, 127  # the task could not be set up (see worker.log); its program not found


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
        self.notice = ""  # the signal that gave notice, if one did
        self.grace = setup.grace  # TERM to KILL, as the stop asked
        self.folder = TaskFolder(setup.run_dir, self.tell)
        self.run_id = setup.env.get(env.RUN_ID, "")
        self.index = setup.env.get(env.TASK_INDEX, "")
        self.warm_start = WarmStart(setup, self.stopping, lambda: self.program_env, emit=self.emit, warn=self.warn,
                                    tell=self.tell, load_rest=_import_rest)
        self.relay = Relay(self.folder, channel, self.lines, emit=self.emit, tell=self.tell, noticed=self.took_notice)

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
        adopt_orphans()  # what the task starts stays under this core, setsid or not (leftovers())
        if s.standby and not self.warm_start.hold():
            self.warm_start.release_server()
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
        self.proc, warm = self.warm_start.start_forked()
        if self.proc is None and self.stopping.is_set():  # stopped while its fork server imported (or before)
            _import_rest()
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
        meter = Meter(self.proc.pid)
        gpus = GpuMeter(self.program_env.get(env.VISIBLE_DEVICES)) if GpuMeter.wanted() else None
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
        threading.Thread(target=self.relay.watch, args=(self.child, meter, gpus), daemon=True).start()
        ended = threading.Event()
        threading.Thread(target=self.collect, args=(ended,), daemon=True).start()
        code = self.proc.wait()
        ended.set()
        self.folder.write(layout.EXIT_CODE, f"{code}\n")  # before any send: a send may block (a cut-off link)
        pump.join(timeout=2.0)
        self.relay.send_progress()  # the last word of a finished run
        left = self.leftovers()
        if left:  # the program exited but left processes behind (setsid, daemons): they go too
            self.note(procs.left_behind(left))
            procs.stop(left, s.grace)
        return self.finish(code)

    @staticmethod
    def collect(ended: threading.Event) -> None:
        """The orphans this core adopted that have ended, collected while its task runs (no zombie piles up)."""
        while not ended.wait(procs.COLLECT_EVERY_S):
            procs.collect_adopted()

    def refuse(self, code: int, reason: str) -> int:
        self.folder.write(layout.EXIT_CODE, f"{code}\n")
        self.note(reason)
        _import_rest()
        return self.finish(code, reason)

    def send_notes(self) -> None:
        while self.setup.notes:
            self.emit(protocol.Note(text=self.setup.notes.pop(0)))

    def finish(self, code: int, reason: str = "") -> int:
        self.warm_start.release_server()
        self.send_notes()
        self.relay.forward(final=True)
        # a notice to a task that then exited 0 is no preemption: it finished
        self.emit(protocol.Exit(code=code, time=time.time(), tail=self.lines.tail_lines(), reason=reason,
                                notice=self.notice if code != 0 else ""))
        return 128 - code if code < 0 else code

    @property
    def child(self) -> subprocess.Popen[bytes] | Forked:
        """The task's process, once started (pump, the relay's watch and the stops run only then)."""
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

    # ---- stopping
    def took_notice(self, ago: float) -> None:
        """The task took a notice (a SIGTERM sent to it, or one of its peers', `ago` s before, as progress.json
        says): a preemption, whatever comes next; it gets preempt_grace to save with its group, not more."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self.notice = "SIGTERM (to the task or a peer)"
        threading.Timer(self.setup.preempt_grace - ago, self.past_grace).start()

    def past_grace(self) -> None:
        if self.child.poll() is None:
            self.note(f"still running {self.setup.preempt_grace:g} s (preempt_grace) after its notice: killed")
            self.stop_task(0)

    def stop(self, reason: str, notice: str = "", broken: bool = False) -> None:
        """Stop the task: TERM to its group, KILL after grace. A `notice` (the signal's name: a host or
        scheduler taking the machine) gets preempt_grace, and the task's end is a preemption; a `broken`
        group's (a peer failed: a save with it cannot land) at most BROKEN_GRACE_S."""
        # a notice after a stop (Slurm's TERM after our INT) is no preemption; one after the task ended is nothing
        if self.stopping.is_set() or self.proc is not None and self.proc.poll() is not None:
            return
        self.stopping.set()
        self.warm_start.wake()
        self.notice = notice
        grace = self.setup.preempt_grace if notice else self.setup.grace
        self.grace = min(grace, BROKEN_GRACE_S) if broken and not notice else grace
        self.note(f"stopping task ({reason}; " + (f"KILL after {self.grace:g} s)" if self.grace else "KILL at once)"))
        if self.proc is not None:  # else run() stops it right after starting it
            self.stop_task(self.grace)

    def stop_task(self, grace: float) -> None:
        _import_rest()  # a stop may come from another thread as the task starts
        stop_group(self.child, grace)
        procs.stop(self.leftovers(), 0)

    def leftovers(self) -> list[Any]:  # psutil.Process: imported once the task runs
        """The attempt's processes other than its program, whoever started them and wherever they went (setsid):
        this core's descendants (it adopts their orphans), its fork server's aside (that one serves the next
        attempt); those under a forked program's reaper (which adopts the program's); any whose environment says
        it is this attempt's."""
        server = self.warm_start.server_pid
        found = procs.tree(os.getpid(), without={server} if server else ())
        if isinstance(self.proc, Forked) and self.proc.reaper:
            found += procs.tree(self.proc.reaper)
        if self.run_id:
            found += procs.of_task(self.run_id, self.index, attempt=self.setup.attempt)
        return list({p.pid: p for p in found if p.pid != self.child.pid}.values())
