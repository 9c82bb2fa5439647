"""Locks held by a process until it releases them or dies (kill -9 included): a run's record has one
writer, and a host:port one run."""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path

from launcher.errors import HomeError, MgpuError, PreflightError
from launcher.run.home import PORTS, mgpu_home
from launcher.plan import TaskPlan
from worker.host.clock import wait_until
from launcher.run.files import read_file


class Lock:
    """An flock on a file; held until released or until the holder dies (kill -9 included)."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def acquire(self, timeout: float = 0.0) -> bool:
        """Held within `timeout` s, else False; OSError when the file cannot be opened at all."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:  # a read-only MGPU_HOME: an flock needs no write, so its readers still take turns
            try:
                fd = os.open(self.path, os.O_RDONLY)
            except OSError:
                raise exc from None
        def taken() -> bool:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False

        if not wait_until(taken, timeout, 0.05):
            os.close(fd)
            return False
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def claim_ports(run_id: str, plans: list[TaskPlan]) -> list[Lock]:
    """Hold host:port of every task for this run (released when the launcher ends, even by kill -9):
    a second `up` on the same port is refused, naming the run that holds it, before anything starts."""
    folder = mgpu_home() / PORTS
    held, problems = [], []
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        for plan in plans:
            host = "localhost" if plan.host.is_local else plan.host.address.lower()
            lock = Lock(folder / f"{re.sub(r'[^A-Za-z0-9.:-]', '_', host)}_{plan.host.port}")
            if lock.acquire():
                held.append(lock)
                assert lock.fd is not None  # acquire() keeps what it holds
                os.ftruncate(lock.fd, 0)
                os.pwrite(lock.fd, f"{run_id} {os.getpid()}\n".encode(), 0)
            else:
                problems.append(_held_by(plan, lock))
    except OSError as exc:
        for taken in held:
            taken.release()
        raise HomeError(f"cannot hold the port claims of run {run_id} in {folder}: {exc.strerror or exc}, so "
                        "nothing was started. Free space there or fix its permissions, or set MGPU_HOME to a "
                        "folder you can write, then run again.") from None
    if problems:
        for lock in held:
            lock.release()
        raise PreflightError("preflight refused the cluster, nothing was started:\n  " + "\n  ".join(problems))
    return held


def _held_by(plan: TaskPlan, lock: Lock) -> str:
    try:
        holder, pid = read_file(lock.path, limit=200).decode().split()
    except (OSError, ValueError, MgpuError):
        holder, pid = "another run", "?"
    return (f"{plan.label}: port {plan.host.port} on {plan.host.label} is held by run {holder} (launcher pid "
            f"{pid}); stop it with 'mgpu-cluster down {holder}', or choose another port")
