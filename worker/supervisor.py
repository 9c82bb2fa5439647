"""Runs one task's training process on its host and reports on it (no TensorFlow here).

    python -m worker.supervisor --run-dir DIR [--attempt N] [--cpus 0,1] -- PROGRAM ARGS...

The program runs in its own session; its output goes to DIR/worker.log and to our stdout.
Lines starting with MARK are for the launcher: {"event": "started"|"progress"|"exit", ...}.
The task is stopped (TERM to its group, KILL after a grace period) when we get TERM/INT/HUP,
or when our stdin reaches EOF, i.e. the launcher or its SSH connection went away; with
--lifeline N also when nothing (the launcher's keepalive newlines) arrives on stdin for N
seconds: a host cut off from the network never sees an EOF.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

MARK = "\x1emgpu "
GRACE_S = 1.0  # TensorFlow catches SIGTERM (its preemption notifier) and keeps going
PROGRESS_POLL_S = 0.25
STATS_EVERY_S = 2.0  # CPU% and RSS of the task, so that `status` needs no trip to the host


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def stop_group(proc: subprocess.Popen, grace: float = GRACE_S) -> None:
    """TERM the process group, then KILL it if anything is left after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
        # the leader is gone; sweep what it left in its group
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


def _die_with_parent() -> None:
    """Child side: get SIGTERM if the supervisor itself is killed (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Supervisor:
    def __init__(self, run_dir: Path, attempt: int, argv: list[str], cpus: list[int] | None, grace: float = GRACE_S):
        self.run_dir, self.attempt, self.argv, self.cpus, self.grace = run_dir, attempt, argv, cpus, grace
        self.out_lock = threading.Lock()
        self.stopping = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.last_progress = ""
        self.ps = None  # psutil.Process of the task, for its stats

    def emit(self, event: str, **data) -> None:
        self.say(MARK + json.dumps({"event": event, **data}))

    def say(self, line: str) -> None:
        with self.out_lock:
            try:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass  # the launcher went away; the log file still has everything

    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for stale in ("exit_code", "progress.json", "pid"):
            (self.run_dir / stale).unlink(missing_ok=True)
        env = dict(os.environ, MGPU_RUN_DIR=str(self.run_dir), PYTHONUNBUFFERED="1")
        log = open(self.run_dir / "worker.log", "ab", buffering=0)
        log.write(f"--- attempt {self.attempt}: {' '.join(self.argv)}\n".encode())
        try:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True, env=env, preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            msg = f"cannot start {self.argv[0]!r}: {exc.strerror}"
            log.write((msg + "\n").encode())
            self.say(msg)
            return self.finish(127)
        if self.stopping.is_set():  # a stop that came while we were starting
            stop_group(self.proc, self.grace)
        if self.cpus:
            try:
                os.sched_setaffinity(self.proc.pid, self.cpus)
            except OSError as exc:
                self.say(f"cannot pin to cpus {self.cpus}: {exc.strerror}")
        write_atomic(self.run_dir / "pid", f"{self.proc.pid}\n")
        write_atomic(self.run_dir / "supervisor.pid", f"{os.getpid()}\n")
        self.emit("started", pid=self.proc.pid, supervisor_pid=os.getpid(), time=time.time())
        threading.Thread(target=self.watch_progress, daemon=True).start()
        pump = threading.Thread(target=self.pump, args=(log,), daemon=True)
        pump.start()
        code = self.proc.wait()
        pump.join(timeout=2.0)
        self.send_progress()  # the last word of a finished run
        return self.finish(code)

    def finish(self, code: int) -> int:
        write_atomic(self.run_dir / "exit_code", f"{code}\n")
        self.emit("exit", code=code, time=time.time())
        return 128 - code if code < 0 else code

    def pump(self, log) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            log.write(raw)
            self.say(raw.decode("utf-8", "replace").rstrip("\n"))

    def send_progress(self) -> None:
        try:
            text = (self.run_dir / "progress.json").read_text()
            data = json.loads(text)
        except (OSError, ValueError):
            return
        if text != self.last_progress:
            self.last_progress = text
            self.emit("progress", progress=data)

    def watch_progress(self) -> None:
        stats_at = time.monotonic() - STATS_EVERY_S + 0.5  # the first figures half a second in
        self.send_stats()
        while self.proc.poll() is None:
            self.send_progress()
            if time.monotonic() - stats_at >= STATS_EVERY_S:
                stats_at = time.monotonic()
                self.send_stats()
            time.sleep(PROGRESS_POLL_S)

    def send_stats(self) -> None:
        try:
            import psutil

            proc = psutil.Process(self.proc.pid)
            if self.ps is None or self.ps.pid != proc.pid:
                self.ps = proc
                proc.cpu_percent(None)  # the first call starts the measuring window
                return
            rss = sum(p.memory_info().rss for p in [self.ps, *self.ps.children(recursive=True)])
            self.emit("stats", cpu_percent=round(self.ps.cpu_percent(None), 1), rss=rss)
        except Exception:  # psutil missing or the task just ended: stats are optional
            pass

    def stop(self, reason: str) -> None:
        if self.stopping.is_set():
            return
        self.stopping.set()
        self.say(f"stopping task ({reason})")
        if self.proc is not None:  # else run() stops it right after starting it
            stop_group(self.proc, self.grace)


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
            return sup.stop("launcher went away")
        last = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.supervisor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True, type=Path, help="the task's folder on this host")
    parser.add_argument("--attempt", type=int, default=0)
    parser.add_argument("--cpus", default="", help="comma-separated cores to pin the task to")
    parser.add_argument("--grace", type=float, default=GRACE_S, help="seconds between TERM and KILL")
    parser.add_argument("--lifeline", type=float, default=None,
                        help="stop the task when stdin stays silent this many seconds")
    parser.add_argument("--detach", action="store_true", help="keep running when stdin closes")
    parser.add_argument("program", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        parser.error("give the program to run after --")
    cpus = [int(c) for c in args.cpus.split(",") if c.strip()] or None
    sup = Supervisor(args.run_dir.resolve(), args.attempt, program, cpus, args.grace)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: threading.Thread(
            target=sup.stop, args=(signal.Signals(signum).name,), daemon=True).start())
    if not args.detach:
        threading.Thread(target=watch_stdin, args=(sup, args.lifeline), daemon=True).start()
    return sup.run()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # don't wait for the watcher threads
