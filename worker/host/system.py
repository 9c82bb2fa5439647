"""What the task core asks of its host: a port's holder, a program's start (its parent-death signal and
cores), a tree's memory, free space. Standard library only at import (psutil is imported where it is used)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import psutil


def bind_error(port: int) -> str | None:
    """Why `port` cannot be taken on every address as TensorFlow's gRPC takes it, or None when free."""
    dual = socket.has_dualstack_ipv6()
    with socket.socket(socket.AF_INET6 if dual else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT does not stop TensorFlow either
        if dual:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            s.bind(("::" if dual else "", port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


class Ports:
    """Port holders; the (slow) list of listening sockets is read once, at the first busy port."""

    def __init__(self) -> None:
        self.listeners: dict[int, int | None] | None = None

    def holder(self, port: int) -> dict[str, Any] | None:
        err = bind_error(port)
        if err is None:
            return None
        import psutil  # here: a host whose ports are free never needs it

        if self.listeners is None:
            try:
                conns = psutil.net_connections(kind="inet")
            except psutil.AccessDenied:
                conns = []
            self.listeners = {c.laddr.port: c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr}
        if port not in self.listeners:
            return {"pid": None, "name": None, "cmdline": f"bind failed: {err}"}
        holder: dict[str, Any] = {"pid": self.listeners[port], "name": None, "cmdline": None}
        try:
            p = psutil.Process(holder["pid"])
            holder.update(name=p.name(), cmdline=" ".join(p.cmdline()))
        except (psutil.Error, TypeError, ValueError):
            pass
        return holder


def port_holder(port: int) -> str | None:
    """Who listens on `port` here ('pid 12 (python3: python3 serve.py)'), or None when it is free."""
    found = Ports().holder(port)
    if found is None:
        return None
    if found["pid"] is None:
        return f"another process ({found['cmdline']})"
    return f"pid {found['pid']} ({found['name'] or '?'}: {(found['cmdline'] or '')[:200]})"


def _prctl() -> Callable[..., Any] | None:
    """libc's prctl (Linux), or None."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def child_setup(sig: int = signal.SIGTERM, cpus: list[int] | None = None) -> Callable[[], None] | None:
    """A preexec_fn for a program the core starts: `sig` when its parent (the core) dies (Linux), and pinned to
    `cpus` before its exec, so that no thread of it ever runs elsewhere (a pin the child cannot take is left to
    the parent's own `sched_setaffinity`, which says why); None where there is nothing to set. libc is looked up
    here, not in the child."""
    prctl = _prctl()

    def child() -> None:
        if prctl is not None:
            prctl(1, sig)  # PR_SET_PDEATHSIG
        if cpus:
            try:
                os.sched_setaffinity(0, cpus)
            except OSError:
                pass

    return child if prctl is not None or cpus else None


def adopt_orphans() -> bool:
    """This process adopts every orphan of its descendants (a child subreaper, Linux): a daemon its task starts
    the classic way (fork, setsid, fork) stays its descendant, found again whatever its environment says, where
    it would be init's; whether the kernel agreed."""
    prctl = _prctl()
    return prctl is not None and int(prctl(36, 1, 0, 0, 0)) == 0  # PR_SET_CHILD_SUBREAPER


def tree_rss(proc: psutil.Process) -> int:
    """Resident memory of a psutil.Process and all its descendants, in bytes."""
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


def private_memory(pid: int) -> int | None:
    """The memory process `pid` holds that no other process shares: its private anonymous pages and its swap. A
    fork server's other private pages are its libraries' clean file pages, the page cache its trainers map too,
    which the kernel can take back. None where it cannot be read."""
    total, anon = 0, False
    try:
        with open(f"/proc/{pid}/smaps", "rb") as f:
            for line in f:
                head, _, rest = line.partition(b" ")
                if head.endswith(b":"):
                    if head in (b"Private_Clean:", b"Private_Dirty:") and anon or head == b"Swap:":
                        total += int(rest.split()[0]) * 1024
                else:  # a mapping: "start-end perms offset dev inode [path]"
                    fields = line.split(None, 5)
                    path = fields[5].strip() if len(fields) > 5 else b""
                    anon = not path or path.startswith((b"[heap", b"[stack", b"[anon"))
    except (OSError, ValueError, IndexError):
        return None
    return total


class Meter:
    """CPU% (since the last read), resident memory of the tree, and state of one process; Nones where
    psutil has no figures (yet, or any more)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.ps: psutil.Process | None = None

    def read(self) -> tuple[float | None, int | None, str | None]:
        try:
            import psutil

            if self.ps is None:
                self.ps = psutil.Process(self.pid)
                self.ps.cpu_percent(None)  # the first call starts the measuring window
                return None, None, None
            status = self.ps.status()
            if status == psutil.STATUS_ZOMBIE:  # ended, not reaped yet: psutil says 0 bytes, which it never used
                return None, None, status
            return round(self.ps.cpu_percent(None), 1), tree_rss(self.ps), status
        except Exception:  # psutil missing, or the process just ended
            return None, None, None


def free_space(path: Path) -> str:
    """'12.0 MiB free' of the file system holding `path` (or its nearest existing parent)."""
    for folder in [path, *path.parents]:
        try:
            return f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB free"
        except OSError:
            continue
    return "free space unknown"


def write_problem(path: Path, exc: OSError | ValueError) -> str:
    """One sentence for a write that failed (ValueError: to a file closed under it): the path, why, and the
    free space there."""
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    gone = "" if path.parent.exists() else f" (its folder {path.parent} no longer exists)"
    return f"cannot write {path}: {why}{gone}; {free_space(path)} there"
