"""The task core's side of a standby (worker.task.standby): the next attempt's program, started early and
held until the core is told to start it. Standard library only, like the core before its task runs."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time

from worker.host.spawn import OWN_GROUP, stop_group
from worker.host.system import child_setup
from worker.task import standby
from worker.task.lines import printable

STOP_GRACE_S = 0.5  # a standby runs nothing of the user's yet: TERM ends it at once
LAST_WORDS_MAX = 200  # characters of a dead standby's last line, told to the launcher
HELD_OUTPUT_MAX = 65536  # what a standby prints while it imports (TensorFlow's start-up lines), kept for the log


class Warm:
    """A program started through worker.task.standby, waiting for "go"."""

    def __init__(self, proc: subprocess.Popen, link: socket.socket, cpus: list[int] | None):
        self.proc, self.link, self.cpus = proc, link, cpus
        self.ready_at: float | None = None  # when it said it had imported what it needs
        self.held = b""
        os.set_blocking(proc.stdout.fileno(), False)

    @classmethod
    def start(cls, argv: list[str], env: dict[str, str], cpus: list[int] | None, parent_death: int) -> "Warm | None":
        """`argv` started warm, or None where it cannot be (not the core's Python: it starts cold)."""
        warm_argv = standby.warm_argv(argv, sys.executable)
        if warm_argv is None:
            return None
        ours, theirs = socket.socketpair()
        try:
            own = {standby.ENV_GROUP: "own"} if os.getsid(0) == os.getpid() else {}  # nothing else in its autogroup
            proc = subprocess.Popen(warm_argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, env={**env, standby.ENV_FD: str(theirs.fileno()), **own},
                                    pass_fds=(theirs.fileno(),), preexec_fn=child_setup(parent_death),
                                    **OWN_GROUP)
        except (OSError, ValueError):
            ours.close()
            return None
        finally:
            theirs.close()
        return cls(proc, ours, cpus)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def look(self) -> None:
        """Take what it printed and whether it is ready (never blocks)."""
        try:
            chunk = os.read(self.proc.stdout.fileno(), HELD_OUTPUT_MAX)
        except (BlockingIOError, OSError):
            chunk = b""
        self.held = (self.held + chunk)[-HELD_OUTPUT_MAX:]
        if self.ready_at is None and select.select([self.link], [], [], 0)[0]:
            try:
                said = self.link.recv(64)
            except OSError:
                said = b""
            if said.startswith(standby.READY):
                self.ready_at = time.time()

    def last_words(self) -> str:
        """' (its last line)' of what it printed, cut short (untrusted: the program's own words), or ''."""
        last = next((line for line in reversed(self.held.decode(errors="replace").splitlines()) if line.strip()), "")
        return f" ({printable(last, LAST_WORDS_MAX)})" if last else ""

    def go(self) -> bool:
        """Start it: True once it was told (its output pipe back to blocking, for the core's pump). The link
        stays open while the program runs: closed with "ready" unread, it would reset the program's end."""
        self.look()
        self.pin()
        try:
            self.link.sendall(standby.GO)
        except OSError:
            return False
        os.set_blocking(self.proc.stdout.fileno(), True)
        return self.alive

    def pin(self) -> None:
        """The task's cores for every thread it has (importing TensorFlow starts a few). Until now it ran on
        any core, at idle priority: its import takes what idle time the whole host has, not its task's."""
        if not self.cpus:
            return
        try:
            threads = os.listdir(f"/proc/{self.proc.pid}/task")
        except OSError:
            threads = [str(self.proc.pid)]
        for tid in threads:
            try:
                os.sched_setaffinity(int(tid), self.cpus)
            except (OSError, ValueError):
                pass

    def stop(self) -> None:
        """Gone, with all it started (its own group): nothing of a standby is ever left behind."""
        self.link.close()
        stop_group(self.proc, STOP_GRACE_S)
        self.proc.wait()
