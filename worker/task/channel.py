"""Where the task core's records go: a pipe to our launcher (local and SSH tasks), or an
append-only events file in the task's folder (tasks a scheduler started: the launcher tails it)."""

from __future__ import annotations

import fcntl
import os
import select
import socket
import threading
from pathlib import Path

from worker.host.system import write_problem

F_SETPIPE_SZ = 1031
PIPE_BYTES = 16384  # what may sit in our stdout ahead of an exit report (the SSH window adds its own)


class Channel:
    def send(self, data: bytes) -> None:
        raise NotImplementedError

    def room(self) -> bool:
        """Whether output may be sent now without queueing behind what the link has not drained."""
        return True


class PipeChannel(Channel):
    """Our stdout: records only (the training's output reaches it inside Output records)."""

    def __init__(self, fd: int = 1):
        self.fd, self.lock = fd, threading.Lock()
        try:  # a small pipe: a slow link holds little output ahead of an exit or a beat
            fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            try:  # a socket pair (some sshd builds): its send buffer, likewise
                socket.socket(fileno=os.dup(fd)).setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, PIPE_BYTES)
            except OSError:
                pass

    def send(self, data: bytes) -> None:
        with self.lock:
            view = memoryview(data)
            try:
                while view:  # a big record may be written in parts
                    view = view[os.write(self.fd, view):]
            except OSError:
                pass  # the launcher went away; worker.log still has everything

    def room(self) -> bool:
        try:
            return bool(select.select([], [self.fd], [], 0)[1])
        except (OSError, ValueError):
            return True


class FileChannel(Channel):
    """An events file, appended one record at a time (O_APPEND). A file deleted under us (its task folder
    removed) is made again; a record cut short (a full disk) is followed by a newline, so that the next
    record starts a line of its own (the reader skips the torn one)."""

    def __init__(self, path: Path):
        self.path, self.lock = path, threading.Lock()
        self.fd: int | None = None
        self.torn = False  # the last record was cut short: the next one starts on a fresh line
        self.failed: OSError | None = None  # the first write that failed (said once on stderr)

    def send(self, data: bytes) -> None:
        with self.lock:
            try:
                if self.fd is not None and os.fstat(self.fd).st_nlink == 0:  # deleted: appends would go nowhere
                    os.close(self.fd)
                    self.fd = None
                if self.fd is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                    self.fd, self.torn = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), False
                view = memoryview(b"\n" + data if self.torn else data)
                while view:  # a short write (a disk filling up): write the rest, or end the line next time
                    view = view[os.write(self.fd, view):]
                    self.torn = bool(view)
            except OSError as exc:  # a full disk: the launcher learns the end from the scheduler
                if self.failed is None:
                    self.failed = exc
                    try:
                        os.write(2, f"mgpu task: {write_problem(self.path, exc)}\n".encode())
                    except OSError:
                        pass
