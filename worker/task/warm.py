"""The task core's side of its task's fork server (worker.task.forkserver): connect to it, start it where none
runs, and have it fork an attempt, which the core then owns as it owns a process it started (its pid, exit
status, group, output and cores). Standard library only, like the core before its task runs."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from worker.host.clock import Deadline
from worker.host.spawn import OWN_GROUP, module_argv
from worker.host.system import child_setup
from worker.task import forkserver
from worker.task.forkserver import Request
from worker.task.lines import printable

MODULE = "worker.task.forkserver"
CONNECT_S = 10.0  # a server just started binds its address in well under a second
LAST_WORDS_MAX = 200  # characters of a dead server's last line, told to the launcher
PID_WAIT_S = 30.0  # from a request to the trainer's pid (a server may be importing what the last attempt imported)
GONE_WAIT_S = 5.0  # a reaper ends at once after its word; a server at once when its last core goes, imports or not


class NoServer(Exception):
    """No fork server could be had: why (how the one started here ended, in its own last words)."""


class NameTaken(NoServer):
    """The server's name is held by a process of another account: nothing was sent to it (said to the user)."""


class Forked:
    """An attempt forked by the server, as the core sees a child it started (what subprocess.Popen offers the
    core: pid, stdout, poll, wait, returncode), its exit status told by its reaper."""

    def __init__(self, pid: int, link: socket.socket, stdout: int, reaper: int | None = None):
        self.pid, self.link = pid, link
        self.reaper = reaper  # its parent, which adopts what it leaves (worker.task.forkserver._attempt)
        self.stdout = open(stdout, "rb", buffering=0)
        self.returncode: int | None = None
        self.said = b""
        self.orphan = False  # its reaper was killed: the trainer got its parent-death signal, its status is lost
        try:
            self.pidfd: int | None = os.pidfd_open(pid)
        except OSError:
            self.pidfd = None  # gone already

    def _read(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        if self.orphan:  # its end is watched by its pidfd, and told as a kill (its real status died with its reaper)
            if self.pidfd is None or select.select([self.pidfd], [], [], timeout)[0]:
                self.returncode = -signal.SIGKILL
            return
        if not select.select([self.link], [], [], timeout)[0]:
            return
        try:
            data = self.link.recv(256)
        except OSError:
            data = b""
        self.said += data
        self._parse()
        if not data and self.returncode is None:
            self.orphan = True
            self._read(0)

    def _parse(self) -> None:
        for line in self.said.split(b"\n")[:-1]:
            if line.startswith(b"exit "):
                self.returncode = int(line[5:])
                _until_closed(self.link, GONE_WAIT_S)  # its reaper gone too: nothing of the attempt outlives it

    def poll(self) -> int | None:
        self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = Deadline.after(timeout)
        while self.returncode is None:
            if deadline.passed:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            self._read(None if timeout is None else deadline.left())
        return self.returncode


class Server:
    """A core's connection to its task's fork server; `ready` once the server has imported what it imports."""

    def __init__(self, sock: socket.socket, proc: subprocess.Popen[bytes] | None, log: Path):
        self.sock, self.proc, self.log = sock, proc, log
        self.pid = forkserver.peer(sock)[0]
        self.ready = False
        self.gone = False

    @classmethod
    def open(cls, name: str, env: dict[str, str], cwd: str, log: Path, idle: bool, ours: str | None) -> "Server":
        """Connected to the server `name`, started here (at the idle priority with `idle`) where none runs;
        NoServer where none can be (the attempt starts cold)."""
        sock = _connect(name)
        if sock is not None:
            return cls(sock, None, log)
        argv = module_argv(sys.executable, MODULE) + [name, *(["--idle"] if idle else []),
                                                        *(["--ours", ours] if ours else [])]
        try:
            with open(log, "ab") as out:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                        env=env, preexec_fn=child_setup(), **OWN_GROUP)
        except (OSError, ValueError) as exc:
            raise NoServer(f"could not be started: {exc}") from None
        deadline = Deadline.after(CONNECT_S)
        while not deadline.passed:
            ended = proc.poll() is not None  # code 0: another core's server took the name first
            sock = _connect(name)
            if sock is not None:
                return cls(sock, proc, log)
            if ended:
                raise NoServer(f"ended with code {proc.returncode}{last_words(log)}")
            time.sleep(0.02)
        proc.kill()
        raise NoServer(f"did not listen within {CONNECT_S:g} s{last_words(log)}")

    def look(self, timeout: float = 0) -> bool:
        """Whether it is still there (and take its word that it is ready)."""
        if self.proc is not None:
            self.proc.poll()  # our child until it outlives us: never a zombie of ours
        if self.gone or self.ready:
            if not self.gone and select.select([self.sock], [], [], 0)[0]:
                self.gone = True  # it says nothing after "ready": readable is its end
            return not self.gone
        if select.select([self.sock], [], [], timeout)[0]:
            try:
                said = self.sock.recv(64)
            except OSError:
                said = b""
            self.ready = said.startswith(forkserver.READY)
            self.gone = not self.ready
        return not self.gone

    def hurry(self) -> None:
        """Its imports at the normal priority from now on: an attempt waits for them."""
        forkserver.hurry(self.pid)

    def ended(self) -> str:
        """How it ended, as far as this core can tell."""
        code = self.proc.returncode if self.proc is not None else None
        return ("ended" if code is None else f"ended with code {code}") + last_words(self.log)

    def fork(self, request: Request) -> Forked | None:
        """The attempt, forked; None where the server cannot fork it (then it starts cold)."""
        out_r, out_w = os.pipe()
        ours, theirs = socket.socketpair()
        try:
            socket.send_fds(self.sock, [request.encode()], [out_w, theirs.fileno()])
        except OSError:
            for fd in (out_r, out_w):
                os.close(fd)
            ours.close()
            return None
        finally:
            theirs.close()
        os.close(out_w)
        said, deadline = b"", Deadline.after(PID_WAIT_S)
        while b"\n" not in said and select.select([ours], [], [], deadline.left())[0]:
            try:
                data = ours.recv(64)
            except OSError:
                data = b""
            if not data:
                break
            said += data
        line, _, rest = said.partition(b"\n")
        if not line.startswith(b"pid "):
            os.close(out_r)
            ours.close()
            return None
        pids = [int(word) for word in line[4:].split()]
        forked = Forked(pids[0], ours, out_r, reaper=pids[1] if len(pids) > 1 else None)
        forked.said = rest
        forked._parse()
        return forked

    def close(self) -> None:
        self.sock.close()

    def release(self) -> None:
        """Let go of it; where this core was its last, wait (bounded) until it has ended, so that nothing of the
        task outlives its core."""
        self.hurry()  # one at the idle priority (a standby's) may not run for seconds on a busy host to hear it
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        _until_closed(self.sock, GONE_WAIT_S)
        self.sock.close()


def last_words(log: Path) -> str:
    """' (a server log's last line)', cut short (what a server printed: its imports' words, untrusted), or ''."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.path.getsize(log) - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    last = next((line for line in reversed(tail.splitlines()) if line.strip()), "")
    return f" ({printable(last, LAST_WORDS_MAX)})" if last else ""


def _until_closed(sock: socket.socket, seconds: float) -> None:
    """Read `sock` until its other end is closed (its process ended), at most `seconds`."""
    deadline = Deadline.after(seconds)
    while select.select([sock], [], [], deadline.left())[0]:
        try:
            if not sock.recv(256):
                return
        except OSError:
            return


def _connect(name: str) -> socket.socket | None:
    """Connected to the server of `name`, None where none listens. An abstract name has no permissions: a process
    of another account that took it first is refused (NoServer) before a byte of the task's is sent."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(forkserver.address(name))
        pid, uid = forkserver.peer(sock)
    except OSError:
        sock.close()
        return None
    if uid != os.getuid():
        sock.close()
        raise NameTaken(f"its name ({name}) is held by a process of another account (pid {pid}, uid {uid}), which "
                        f"was sent nothing; find who runs it ('ps -o user,pid,cmd -p {pid}')")
    return sock
