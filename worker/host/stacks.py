"""The Python stacks of a process on this host, read from outside it with py-spy (also when it is stuck
or stopped): every thread, innermost frame last. `python -m worker.host.stacks --pid P [--json] [--out FILE]`.

Reading another process needs ptrace rights over it: the same user, and kernel.yama.ptrace_scope 0
(or 1 with CAP_SYS_PTRACE, or as root); see the README.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from worker.host import procs
from worker.host.clock import Deadline

TRIES = 3
TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.function} ({self.file}:{self.line})"


@dataclass(frozen=True)
class Thread:
    name: str
    os_id: int
    pid: int
    active: bool
    frames: list[Frame]  # outermost first, innermost last


@dataclass
class Stacks:
    pid: int
    threads: list[Thread] = field(default_factory=list)
    error: str | None = None  # why none could be read

    @property
    def ok(self) -> bool:
        return self.error is None

    def main_thread(self) -> Thread | None:
        """The thread that trains: the process's main thread, else the first one."""
        return next((t for t in self.threads if t.os_id == self.pid), self.threads[0] if self.threads else None)

    def innermost(self, n: int = 3) -> list[str]:
        """The main thread's innermost `n` frames, innermost last."""
        main = self.main_thread()
        return [str(f) for f in main.frames[-n:]] if main else []

    def text(self) -> str:
        if self.error:
            return f"no stacks: {self.error}"
        lines = []
        for t in self.threads:
            pid = f" of pid {t.pid}" if t.pid != self.pid else ""
            lines.append(f'thread {t.os_id}{pid} "{t.name}" ({"active" if t.active else "idle"}):')
            lines += [f"    {f}" for f in t.frames] or ["    (no Python frames)"]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Stacks":  # Any: a host's JSON, read field by field
        threads = [Thread(**{**t, "frames": [Frame(**f) for f in t["frames"]]}) for t in data.get("threads", [])]
        return cls(pid=int(data["pid"]), threads=threads, error=data.get("error"))


def py_spy() -> str | None:
    """py-spy on PATH or beside this interpreter (a venv's bin/)."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return shutil.which("py-spy") or (beside if os.access(beside, os.X_OK) else None)


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger): py-spy must not try to pause it again."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def parse(text: str, pid: int) -> Stacks:
    """py-spy dump --json output (innermost frame first) as Stacks (innermost last)."""
    threads = []
    for t in json.loads(text):
        frames = [Frame(function=f.get("name") or "?", file=f.get("short_filename") or f.get("filename") or "?",
                        line=int(f.get("line") or 0)) for f in reversed(t.get("frames") or [])]
        threads.append(Thread(name=t.get("thread_name") or "", os_id=int(t.get("os_thread_id") or 0),
                              pid=int(t.get("pid") or pid), active=bool(t.get("active")), frames=frames))
    # a thread listed twice (py-spy, of a process stopped as it read it: once without frames) is told once
    framed = {(t.pid, t.os_id) for t in threads if t.frames}
    return Stacks(pid=pid, threads=[t for t in threads if t.frames or (t.pid, t.os_id) not in framed])


def dump(pid: int, timeout: float = TIMEOUT_S, create_time: float | None = None) -> Stacks:
    """The stacks of `pid` (and of its Python children) now; failures as Stacks.error, never raised.
    `create_time`: read it only if it is still the process started then (a pid is reused)."""
    exe = py_spy()
    if exe is None:
        return Stacks(pid, error="py-spy is not installed on this host: pip install py-spy "
                                 "(it comes with mgpu-cluster[tensorflow])")
    if not os.path.exists(f"/proc/{pid}"):
        return Stacks(pid, error=f"no process {pid} on this host")
    if create_time is not None and procs.same(pid, create_time) is None:
        return Stacks(pid, error=f"the task's process {pid} has ended (that pid now names another process, started "
                                 "later; it was not touched)")
    deadline = Deadline.after(timeout)
    for _ in range(TRIES):
        argv = [exe, "dump", "--json", "--subprocesses", "--pid", str(pid)]
        if stopped(pid):  # already still: read it as it is
            argv.append("--nonblocking")
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=max(0.1, deadline.left()))
        except subprocess.TimeoutExpired:
            return Stacks(pid, error=f"py-spy did not answer within {timeout:g} s")
        # py-spy fails on a process that changes state under it (one being stopped): look again
        if res.returncode == 0 or "Failed to get stack traces" not in res.stderr or deadline.passed:
            break
        time.sleep(0.2)
    if res.returncode != 0:
        err = next((line for line in res.stderr.splitlines() if line.strip()), f"exit code {res.returncode}")
        if "ermission" in res.stderr or "Operation not permitted" in res.stderr:
            err += (" (reading another process needs the same user and kernel.yama.ptrace_scope = 0, "
                    "or CAP_SYS_PTRACE)")
        return Stacks(pid, error=f"py-spy: {err}")
    try:
        return parse(res.stdout, pid)
    except (ValueError, TypeError, KeyError) as exc:
        return Stacks(pid, error=f"py-spy gave output that is not its JSON ({exc})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.host.stacks", description=__doc__)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--json", action="store_true", help="print the stacks as one JSON object")
    p.add_argument("--out", default=None, help="also write the text to this file")
    p.add_argument("--timeout", type=float, default=TIMEOUT_S)
    p.add_argument("--create-time", type=float, default=None, help="only the process started at this time")
    args = p.parse_args(argv)
    stacks = dump(args.pid, args.timeout, args.create_time)
    if args.out:
        try:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(f"--- pid {args.pid}\n{stacks.text()}\n")
        except OSError as exc:
            print(f"cannot write {args.out}: {exc.strerror}", file=sys.stderr)
    print(json.dumps(stacks.to_json()) if args.json else stacks.text())
    return 0 if stacks.ok else 1


if __name__ == "__main__":
    sys.exit(main())
