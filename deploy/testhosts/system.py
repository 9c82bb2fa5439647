"""Namespaces, links, processes and files: the `ip`/procfs helpers under the test hosts
(slurmcluster.py uses them too)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shlex
import signal
import subprocess
import tempfile
import time
from pathlib import Path

_LOCK_DIR = "/run/lock" if os.path.isdir("/run/lock") else tempfile.gettempdir()
_LOCK_FILE = os.path.join(_LOCK_DIR, "mgpu-testhosts.lock")


class TestHostsError(RuntimeError):
    """Setting up or tearing down the test hosts failed; the message says what and where."""

    __test__ = False


def _run(argv, check=True, timeout=30) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise TestHostsError(f"`{shlex.join(map(str, argv))}` failed ({proc.returncode}): "
                             f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def _netns_list() -> set[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return {line.split()[0] for line in proc.stdout.splitlines() if line.strip()}


def _link_names() -> set[str]:
    proc = _run(["ip", "-o", "link", "show"], check=False)
    names = set()
    for line in proc.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.add(parts[1].strip().split("@")[0])
    return names


def _netns_pids(netns: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _kill_netns(netns: str, timeout: float = 5.0, reap=lambda: None) -> list[int]:
    """SIGKILL every process in `netns` until none is left; returns the pids killed.
    `reap` collects the caller's own dead children (never waitpid(-1): that would steal
    exit codes from other subprocesses of a test process)."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        pids = _netns_pids(netns)
        if not pids:
            return killed
        if time.monotonic() > deadline:
            raise TestHostsError(f"processes {pids} in namespace {netns} survived SIGKILL")
        for pid in pids:
            _kill(pid)
        killed += [p for p in pids if p not in killed]
        reap()
        time.sleep(0.01)


def clear_stale_rehash_lock() -> bool:
    """A login shell killed by `crash` while pyenv's ~/.bashrc hook rehashed leaves pyenv's lock file behind, and
    every later login then waits 60 s for it (PYENV_REHASH_TIMEOUT): removed where no rehash runs. True if it was."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    lock = root / "shims" / ".pyenv-shim"
    if not lock.exists():
        return False
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and b"pyenv-rehash" in (proc / "cmdline").read_bytes():
                return False  # a rehash runs: its lock
        except OSError:
            continue
    lock.unlink(missing_ok=True)
    return True


def _used_third_octets() -> set[tuple[int, int]]:
    """(second, third) octets of 198.18.0.0/15 subnets already in use in this namespace."""
    out = _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    out += _run(["ip", "-4", "route", "show", "table", "all"], check=False).stdout
    return {(int(a), int(b)) for a, b in re.findall(r"\b198\.(18|19)\.(\d+)\.\d+", out)}


def _claim_bridge(bridge: str) -> str:
    """Make `bridge` with the .1 address of a free /24 in 198.18.0.0/15; returns "198.X.Y".
    The lock makes "pick a free subnet, claim it on our bridge" atomic across processes
    (the SSH test hosts and the Slurm test cluster both use it)."""
    with open(_LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        used = _used_third_octets()
        free = [(18, k) for k in range(1, 255) if (18, k) not in used]
        free = free or [(19, k) for k in range(0, 255) if (19, k) not in used]
        if not free:
            raise TestHostsError("no free /24 left in 198.18.0.0/15")
        second, third = free[secrets.randbelow(min(len(free), 64))]
        subnet = f"198.{second}.{third}"
        _run(["ip", "link", "add", bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{subnet}.1/24", "dev", bridge])
        _run(["ip", "link", "set", bridge, "up"])
    return subnet


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except OSError:
        return ""


def _sshd_version(sshd: str) -> tuple[int, int]:
    proc = _run([sshd, "-V"], check=False)
    m = re.search(r"OpenSSH_(\d+)\.(\d+)", proc.stdout + proc.stderr)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _write(path: Path, text: str, mode: int = 0o600) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def netns_usage(namespaces: list[str]) -> list[tuple[int, float]]:
    """(processes, CPU seconds) of each namespace now: the sum over its processes of their own
    CPU and that of the children they have reaped (utime + stime + cutime + cstime). With a
    subreaper in the namespace (TestHosts(reaper=True)) nothing that ran there since is missed."""
    inodes = {}
    for k, ns in enumerate(namespaces):
        with contextlib.suppress(OSError):
            inodes[os.stat(f"/run/netns/{ns}").st_ino] = k
    usage = [[0, 0.0] for _ in namespaces]
    tick = os.sysconf("SC_CLK_TCK")
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            k = inodes.get(os.stat(f"/proc/{name}/ns/net").st_ino)
            if k is None:
                continue
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        usage[k][0] += 1
        usage[k][1] += sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    return [(n, cpu) for n, cpu in usage]
