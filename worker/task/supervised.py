"""Runs one task's training process on its host and reports on it (no TensorFlow here).

    python -m worker.task.supervised --run-dir DIR [--attempt N] [--port P] [--env-stdin] -- PROGRAM ARGS...

Our stdout carries only `worker.protocol` records; the program's output goes to DIR/worker.log
whole and reaches the launcher inside Output records (long lines cut, a flood thinned), so the
training can neither forge an event nor slow one down. With --env-stdin the first line of stdin
is a JSON object of the task's environment (kept off every command line).

The task is stopped (TERM to its group, KILL after --grace; then every process that still
carries the task's run id in its environment) when our stdin reaches EOF (the launcher stopped
it, or went away) or on INT/HUP; TERM or USR1 is a notice (a host or scheduler taking the
machine) and gets --preempt-grace. With --lifeline N, silence on stdin for N seconds also stops
the task: a host cut off from the network never sees an EOF.
"""

from __future__ import annotations

import argparse
import collections
import errno
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from worker.task.files import write_private
from worker.task.spawn import OWN_GROUP

# worker.task.procs (psutil) and worker.protocol (dataclasses) take ~30 ms to import: time every task
# would wait for. They are imported by `_import_rest` once the task is started.
procs: Any = None
protocol: Any = None

GRACE_S = 1.0  # TensorFlow catches SIGTERM (its preemption notifier) and keeps going
# progress.json is written at most once a second (MGPU_PROGRESS_INTERVAL): a faster poll shows nothing
# newer, and each wake-up takes a core from the training (4 a second cost ~2% of the steps on 2 cores)
PROGRESS_POLL_S = 1.0
FORWARD_EVERY_S = 0.1  # output is sent at most this often (a flood in batches); a quiet task wakes us for none
FORWARD_MAX_LINES = 400  # per FORWARD_EVERY_S; beyond that a flood is thinned (worker.log keeps all)
PENDING_MAX_LINES = 2000
LINE_MAX = 4096  # longer lines are cut on the way to the launcher
TAIL_LINES = 20


def port_holder(port: int) -> str | None:
    """Who listens on `port` here ('pid 12 (python3: python3 serve.py)'), or None when it is free."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no holder
        try:
            s.bind(("0.0.0.0", port))
            return None
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return None
    try:
        import psutil

        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                p = psutil.Process(c.pid)
                return f"pid {c.pid} ({p.name()}: {' '.join(p.cmdline())[:200]})"
    except Exception:  # holder unknown (another user's process): the port is still taken
        pass
    return "another process"


def _import_rest() -> None:
    global procs, protocol
    from worker import protocol
    from worker.task import procs


def _die_with_parent():
    """The preexec_fn that gives the child SIGTERM if the supervisor itself is killed (Linux only;
    None elsewhere). libc is looked up here, not in the child between fork and exec."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Lines:
    """Splits raw output into lines for the launcher: cut at LINE_MAX, a bounded queue, a full tail."""

    def __init__(self):
        self.partial = b""
        self.cutting = False  # inside a line that was already cut: skip to its end
        self.pending: collections.deque[str] = collections.deque()
        self.dropped = 0
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.lock = threading.Lock()
        self.arrived = threading.Event()  # lines are waiting to be taken

    def feed(self, chunk: bytes) -> None:
        data = self.partial + chunk
        *complete, self.partial = data.split(b"\n")
        out = []
        for raw in complete:
            if self.cutting:
                self.cutting = False
                continue
            out.append(raw.decode("utf-8", "replace").rstrip("\r"))
        if len(self.partial) > LINE_MAX:
            if not self.cutting:
                out.append(self.partial[:LINE_MAX].decode("utf-8", "replace") + " [... line cut; whole in worker.log]")
            self.cutting, self.partial = True, b""
        self._add(out)

    def close(self) -> None:
        if self.partial and not self.cutting:
            self._add([self.partial.decode("utf-8", "replace")])
        self.partial = b""

    def _add(self, lines: list[str]) -> None:
        with self.lock:
            self.tail.extend(lines)
            room = max(0, PENDING_MAX_LINES - len(self.pending))
            self.pending.extend(lines[:room])
            self.dropped += max(0, len(lines) - room)
            if lines:
                self.arrived.set()

    def take(self, limit: int) -> tuple[list[str], int]:
        with self.lock:
            lines = [self.pending.popleft() for _ in range(min(limit, len(self.pending)))]
            if not self.pending:
                self.arrived.clear()
            if len(self.pending) > PENDING_MAX_LINES // 2:  # still flooding: thin it, keep the newest
                self.dropped += len(self.pending) - PENDING_MAX_LINES // 2
                while len(self.pending) > PENDING_MAX_LINES // 2:
                    self.pending.popleft()
            dropped, self.dropped = self.dropped, 0
            return lines, dropped


class Supervisor:
    def __init__(self, run_dir: Path, attempt: int, argv: list[str], env: dict[str, str], cpus: list[int] | None,
                 grace: float = GRACE_S, preempt_grace: float | None = None, port: int | None = None):
        self.run_dir, self.attempt, self.argv, self.env, self.cpus = run_dir, attempt, argv, env, cpus
        self.grace, self.preempt_grace, self.port = grace, preempt_grace if preempt_grace is not None else grace, port
        self.out_lock = threading.Lock()
        self.stopping = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.lines = Lines()
        self.last_progress = ""
        self.ps = None  # psutil.Process of the task, for its stats
        self.notes: list[str] = []

    # ---- the channel to the launcher
    def emit(self, event: protocol.Event) -> None:
        with self.out_lock:
            data = memoryview(protocol.encode(event))
            try:
                while data:  # a big record may be written in parts
                    data = data[os.write(1, data):]
            except OSError:
                pass  # the launcher went away; worker.log still has everything

    def note(self, text: str) -> None:
        """A line of our own, shown with the task's output and kept in its log."""
        line = f"[mgpu supervisor] {text}"
        self.log_write((line + "\n").encode())
        self.lines._add([line])

    def log_write(self, data: bytes) -> None:
        try:
            self.log.write(data)
        except (OSError, ValueError, AttributeError):
            pass

    # ---- the task
    def run(self) -> int:
        for folder in (self.run_dir.parent, self.run_dir):  # the run's folder and the task's: owner only
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(folder, 0o700)
        for stale in ("exit_code", "progress.json", "pid", "task.json"):
            (self.run_dir / stale).unlink(missing_ok=True)
        env = {**os.environ, **self.env, "MGPU_RUN_DIR": str(self.run_dir), "PYTHONUNBUFFERED": "1"}
        # procs.ENV_RUN and ENV_TASK, spelled out: procs is not imported yet
        self.run_id, self.index = env.get("MGPU_RUN_ID", ""), env.get("MGPU_TASK_INDEX", "")
        fd = os.open(self.run_dir / "worker.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.log = os.fdopen(fd, "ab", buffering=0)
        self.log_write(f"--- attempt {self.attempt}: {' '.join(self.argv)}\n".encode())
        holder = port_holder(self.port) if self.port else None
        if holder:
            reason = (f"port {self.port} was taken by {holder} after the preflight, so the task was not started; "
                      "stop that process or choose another port, then run again")
            self.note(reason)
            _import_rest()
            return self.finish(protocol.EXIT_PORT_BUSY, reason)
        try:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env=env, preexec_fn=_die_with_parent(), **OWN_GROUP,
            )
        except OSError as exc:
            reason = f"cannot start {self.argv[0]!r}: {exc.strerror}"
            self.note(reason)
            _import_rest()
            return self.finish(127, reason)
        _import_rest()
        pump = threading.Thread(target=self.pump, daemon=True)
        pump.start()
        if self.cpus:
            try:
                os.sched_setaffinity(self.proc.pid, self.cpus)
            except OSError as exc:
                self.note(f"cannot pin to cpus {self.cpus}: {exc.strerror}")
        ident = procs.identity(self.proc.pid) or (self.proc.pid, time.time())
        me = procs.identity(os.getpid())
        write_private(self.run_dir / "pid", f"{self.proc.pid}\n")
        write_private(self.run_dir / "task.json", json.dumps({
            "pid": ident[0], "create_time": ident[1], "supervisor_pid": me[0], "supervisor_create_time": me[1],
            "run_id": self.run_id, "index": self.index, "attempt": self.attempt}))
        self.emit(protocol.Started(pid=ident[0], create_time=ident[1], supervisor_pid=os.getpid(), time=time.time()))
        if self.stopping.is_set():  # a stop that came while we were starting
            self.stop_task(self.grace)
        threading.Thread(target=self.watch, daemon=True).start()
        code = self.proc.wait()
        pump.join(timeout=2.0)
        self.send_progress()  # the last word of a finished run
        left = procs.of_task(self.run_id, self.index) if self.run_id else []
        if left:  # the program exited but left processes behind (setsid, daemons): they go too
            self.note(f"stopping {len(left)} process(es) the task left behind: {[p.pid for p in left]}")
            procs.stop(left, self.grace)
        return self.finish(code)

    def finish(self, code: int, reason: str = "") -> int:
        self.forward()
        write_private(self.run_dir / "exit_code", f"{code}\n")
        self.emit(protocol.Exit(code=code, time=time.time(), tail=list(self.lines.tail), reason=reason))
        return 128 - code if code < 0 else code

    def pump(self) -> None:
        fd = self.proc.stdout.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            self.log_write(chunk)
            self.lines.feed(chunk)
        self.lines.close()

    def forward(self) -> bool:
        lines, dropped = self.lines.take(FORWARD_MAX_LINES)
        if lines or dropped:
            self.emit(protocol.Output(lines=lines, dropped=dropped))
        return bool(lines or dropped)

    def send_progress(self) -> None:
        try:
            text = (self.run_dir / "progress.json").read_text()
            if text == self.last_progress:  # read on each output batch too: most reads find nothing new
                return
            data = json.loads(text)
        except (OSError, ValueError):
            return
        if isinstance(data, dict):
            self.last_progress = text
            self.emit(protocol.Progress(progress=data))
            if data.get("state") == "preempting" and not self.stopping.is_set():
                # the task took a notice (a SIGTERM sent to it, or one of its peers): it gets
                # preempt_grace to save with its group, not more
                self.stopping.set()
                threading.Timer(self.preempt_grace - self.since(data.get("time")), self.past_grace).start()

    @staticmethod
    def since(written: Any) -> float:
        """How long ago the task wrote a record that says `time: written`; we read it up to a poll later."""
        try:
            elapsed = time.time() - float(written)
        except (TypeError, ValueError, OverflowError):  # no time, or not one (a user's own record)
            return 0.0
        return min(elapsed, PROGRESS_POLL_S) if elapsed > 0 else 0.0  # (NaN, a clock step back: 0)

    def past_grace(self) -> None:
        if self.proc.poll() is None:
            self.note(f"still running {self.preempt_grace:g} s (preempt_grace) after its notice: killed")
            self.stop_task(0)

    def watch(self) -> None:
        """Forward output, progress and stats until the task ends. Wakes when output arrives (at most
        every FORWARD_EVERY_S) or a poll is due, not on a fixed tick: a quiet task's cores are
        interrupted once a second, not ten times."""
        progress_at = stats_at = 0.0
        while self.proc.poll() is None:
            spoke = self.forward()
            if spoke:
                time.sleep(FORWARD_EVERY_S)  # more is coming: send it in batches
            now = time.monotonic()
            # also read it when the task spoke: the worker prints its notice just after writing
            # "preempting", and preempt_grace may be shorter than a poll
            if spoke or now - progress_at >= PROGRESS_POLL_S:
                progress_at = now
                self.send_progress()
            if now - stats_at >= protocol.BEAT_S:
                stats_at = now
                self.send_stats()
            self.lines.arrived.wait(max(0.0, min(progress_at + PROGRESS_POLL_S, stats_at + protocol.BEAT_S)
                                        - time.monotonic()))

    def send_stats(self) -> None:
        """CPU%, RSS and state of the task (so that `status` needs no trip to the host), and in any
        case a record: the launcher counts a supervisor silent for its lifeline as lost."""
        stats = protocol.Stats()
        try:
            import psutil

            if self.ps is None:
                self.ps = psutil.Process(self.proc.pid)
                self.ps.cpu_percent(None)  # the first call starts the measuring window
            else:
                rss = sum(p.memory_info().rss for p in [self.ps, *self.ps.children(recursive=True)])
                stats = protocol.Stats(cpu_percent=round(self.ps.cpu_percent(None), 1), rss=rss,
                                       status=self.ps.status())
        except Exception:  # psutil missing or the task just ended: the figures are optional
            pass
        self.emit(stats)

    # ---- stopping
    def stop(self, reason: str, notice: bool = False) -> None:
        if self.stopping.is_set():
            return
        self.stopping.set()
        grace = self.preempt_grace if notice else self.grace
        self.note(f"stopping task ({reason}; KILL after {grace:g} s)")
        if self.proc is not None:  # else run() stops it right after starting it
            self.stop_task(grace)

    def stop_task(self, grace: float) -> None:
        _import_rest()  # a stop may come from another thread as the task starts
        for sig in (signal.SIGTERM, signal.SIGCONT):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # also what the leader left in its group
        except ProcessLookupError:
            pass
        if self.run_id:
            procs.stop(procs.of_task(self.run_id, self.index), 0)


def read_env_line() -> tuple[dict[str, str] | None, bytes]:
    """The first line of stdin as the task's environment; the rest of what was read. None when stdin
    ends before a whole line: the launcher went away before the start."""
    buf = b""
    while b"\n" not in buf:
        data = os.read(0, 65536)
        if not data:
            return None, b""
        buf += data
    line, _, rest = buf.partition(b"\n")
    env = json.loads(line) if line.strip() else {}
    if not isinstance(env, dict):
        raise ValueError("the environment line is not a JSON object")
    return {str(k): str(v) for k, v in env.items()}, rest


def watch_stdin(sup: Supervisor, lifeline: float | None) -> None:
    """EOF on stdin, or silence past the lifeline: the launcher (or the connection to it) is gone."""
    last = time.monotonic()
    while True:
        if lifeline and not select.select([0], [], [], 1.0)[0]:
            if time.monotonic() - last > lifeline:
                return sup.stop(f"no word from the launcher for {lifeline:g} s")
            continue
        try:
            data = os.read(0, 4096)  # the raw fd: a buffered reader's lock would block our exit
        except OSError:
            data = b""
        if not data:
            return sup.stop("the launcher stopped it, or went away")
        last = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.task.supervised", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True, type=Path, help="the task's folder on this host")
    parser.add_argument("--attempt", type=int, default=0)
    parser.add_argument("--cpus", default="", help="comma-separated cores to pin the task to")
    parser.add_argument("--port", type=int, default=None, help="the task's TF port: refuse to start if taken")
    parser.add_argument("--grace", type=float, default=GRACE_S, help="seconds between TERM and KILL")
    parser.add_argument("--preempt-grace", type=float, default=None,
                        help="seconds between a notice (TERM/USR1 to us) and KILL (default: --grace)")
    parser.add_argument("--lifeline", type=float, default=None,
                        help="stop the task when stdin stays silent this many seconds")
    parser.add_argument("--env-stdin", action="store_true", help="read the task's environment from stdin's first line")
    parser.add_argument("--detach", action="store_true", help="keep running when stdin closes")
    parser.add_argument("program", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        parser.error("give the program to run after --")
    env: dict[str, str] | None = {}
    if args.env_stdin:
        try:
            env, _rest = read_env_line()
        except (ValueError, OSError) as exc:
            parser.error(f"--env-stdin: {exc}")
        if env is None:  # not a task without its TF_CONFIG and run id: nothing at all
            print("mgpu supervisor: stdin ended before the task's environment; nothing was started",
                  file=sys.stderr)
            return 1
    cpus = [int(c) for c in args.cpus.split(",") if c.strip()] or None
    sup = Supervisor(args.run_dir.resolve(), args.attempt, program, env, cpus, args.grace, args.preempt_grace,
                     args.port)

    def on_signal(signum, _frame):
        notice = signum in (signal.SIGTERM, signal.SIGUSR1)
        threading.Thread(target=sup.stop, args=(signal.Signals(signum).name, notice), daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    if not args.detach:
        threading.Thread(target=watch_stdin, args=(sup, args.lifeline), daemon=True).start()
    return sup.run()


if __name__ == "__main__":
    code = main()
    os._exit(code)  # don't wait for the watcher threads
