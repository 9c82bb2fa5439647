"""TestHosts: N fake hosts (network namespaces, each with its own sshd) on a private bridge."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from .cluster_toml import DEFAULT_PORT, render_cluster_toml
from .system import (TestHostsError, _claim_bridge, _kill, _kill_netns, _link_names, _netns_list, _netns_pids, _run,
                     _sshd_version, _tail, _write, clear_stale_rehash_lock, netns_usage)

SSHD = "/usr/sbin/sshd"
FIRST_HOST = 11  # host i gets 198.18.<k>.(11 + i); the bridge is .1
MAX_HOSTS = 200
STATE_FILE = "hosts.json"
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{1,8}$")  # keeps every interface name <= 15 chars
# reaper=True: each sshd runs under this subreaper, which collects every orphan of its sessions
# (daemonized supervisors too), so their CPU time lands in the namespace's accounts (usage()).
REAPER = """
import ctypes, os, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
pid, code = os.posix_spawn(sys.argv[1], sys.argv[1:], os.environ), 1
while True:
    try:
        done, status = os.wait()
    except ChildProcessError:
        sys.exit(code)
    if done == pid:
        code = os.waitstatus_to_exitcode(status)
"""


@dataclasses.dataclass(frozen=True)
class Host:
    """One fake host. Attribute access (`h.address`) and item access (`h["address"]`) both work."""

    index: int
    name: str
    address: str
    netns: str
    veth: str

    def __getitem__(self, key: str):
        return getattr(self, key)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class TestHosts:
    """N fake hosts (network namespaces with their own sshd) on one private bridge.

        with TestHosts(2, tmp_path) as th:
            subprocess.run(["ssh", "-F", th.ssh_config, th.hosts[0].address, "hostname -I"])
            env = {**os.environ, "HOME": str(th.home)}   # fabric/paramiko find ~/.ssh here
    """

    __test__ = False  # not a pytest test class

    def __init__(self, n: int, state_dir, prefix: str | None = None, *, sshd: str = SSHD,
                 ready_timeout: float = 15.0, reaper: bool = False, static_neighbours: bool | None = None,
                 disk: str | None = None, disk_size: str = "64m"):
        if not 1 <= int(n) <= MAX_HOSTS:
            raise ValueError(f"n must be between 1 and {MAX_HOSTS}, not {n}")
        if prefix is not None and not _PREFIX_RE.match(prefix):
            raise ValueError(f"prefix {prefix!r} must be 2-9 chars of [a-z0-9], starting with a letter")
        self.n = int(n)
        self.state_dir = Path(state_dir).resolve()
        self._fixed_prefix = prefix is not None
        self.prefix = prefix or self._new_prefix()
        self.sshd = sshd
        self.ready_timeout = ready_timeout
        self.reaper = reaper
        # The kernel's ARP table is shared by all namespaces (gc_thresh3: 1024 entries); n hosts that
        # all talk to each other need n * (n - 1): past ~30 it overflows and connections time out.
        # Permanent entries between the hosts do not count (the SSH side stays dynamic ARP).
        self.static_neighbours = self.n > 16 if static_neighbours is None else static_neighbours
        # disk: a path that each host sees as a disk of its own (a private tmpfs of disk_size in its sshd's mount
        # namespace, empty again after a crash): hosts that share no storage there
        self.disk, self.disk_size = disk, disk_size
        self.subnet: str | None = None  # "198.18.<k>", chosen in up()
        self.hosts: list[Host] = []
        self.timings: dict[str, float] = {}
        self._procs: dict[int, subprocess.Popen] = {}
        self._is_up = False

    # ---- names and paths
    @staticmethod
    def _new_prefix() -> str:
        return "mgt" + secrets.token_hex(3)  # 9 chars: "mgt" + 6 hex

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    def _netns(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def _veth(self, i: int) -> str:
        return f"{self.prefix}-v{i}"

    @property
    def home(self) -> Path:
        return self.state_dir / "home"

    @property
    def ssh_config(self) -> Path:
        return self.home / ".ssh" / "config"

    @property
    def known_hosts(self) -> Path:
        return self.home / ".ssh" / "known_hosts"

    @property
    def identity_file(self) -> Path:
        return self.home / ".ssh" / "id_ed25519"

    @property
    def authorized_keys(self) -> Path:
        return self.state_dir / "authorized_keys"

    @property
    def state_file(self) -> Path:
        return self.state_dir / STATE_FILE

    @property
    def addresses(self) -> list[str]:
        return [h.address for h in self.hosts]

    @property
    def bridge_address(self) -> str | None:
        return f"{self.subnet}.1" if self.subnet else None

    def _host_dir(self, i: int) -> Path:
        return self.state_dir / "hosts" / f"h{i}"

    def sshd_log(self, i: int) -> Path:
        return self._host_dir(i) / "sshd.log"

    def _pidfile(self, i: int) -> Path:
        return self._host_dir(i) / "sshd.pid"

    def _sshd_config_file(self, i: int) -> Path:
        return self._host_dir(i) / "sshd_config"

    def _hostkey(self, i: int) -> Path:
        return self._host_dir(i) / "ssh_host_ed25519_key"

    # ---- context manager
    def __enter__(self) -> "TestHosts":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # ---- up
    def up(self) -> "TestHosts":
        """Create bridge, namespaces, keys and sshds; return once every sshd accepts TCP on :22."""
        if self._is_up:
            return self
        if os.geteuid() != 0:
            raise TestHostsError("testhosts needs root (network namespaces, veth, sshd)")
        for tool, package in (("ip", "iproute2"), ("ssh-keygen", "openssh-client")):
            if shutil.which(tool) is None:
                raise TestHostsError(f"`{tool}` not found: apt-get install -y {package}")
        if not os.access(self.sshd, os.X_OK):
            raise TestHostsError(f"{self.sshd} not found: apt-get install -y openssh-server")
        existing = _netns_list() | _link_names()
        if self._fixed_prefix and {self.bridge, self._netns(0)} & existing:
            raise TestHostsError(f"prefix {self.prefix!r} is in use (run `down --prefix {self.prefix}`)")
        while self.bridge in existing or self._netns(0) in existing:
            self.prefix = self._new_prefix()
        t0 = time.perf_counter()
        try:
            self._up()
        except BaseException:
            with contextlib.suppress(Exception):
                self.down()
            raise
        self._is_up = True
        self.timings["up"] = time.perf_counter() - t0
        return self

    def _up(self) -> None:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        (self.home / ".ssh").mkdir(parents=True, exist_ok=True)
        os.chmod(self.home / ".ssh", 0o700)
        for i in range(self.n):
            self._host_dir(i).mkdir(parents=True, exist_ok=True)
        self._save(phase="creating")  # so `down` can clean up even if we die half-way

        keygens = self._start_keygens()
        t = time.perf_counter()
        self._make_bridge()
        self.hosts = [Host(i, f"h{i}", f"{self.subnet}.{FIRST_HOST + i}", self._netns(i), self._veth(i))
                      for i in range(self.n)]
        self._save(phase="creating")
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, self.n)) as pool:
            list(pool.map(self._make_host, range(self.n)))
            if self.static_neighbours:
                list(pool.map(self._add_neighbours, range(self.n)))
        self.timings["network"] = time.perf_counter() - t
        for argv, proc in keygens:
            _, err = proc.communicate(timeout=30)
            if proc.returncode != 0:
                raise TestHostsError(f"`{shlex.join(argv)}` failed: {err.decode(errors='replace').strip()}")
        self._write_ssh_files()
        t = time.perf_counter()
        for i in range(self.n):
            self._start_sshd(i)
        self._wait_ready(range(self.n))
        self.timings["sshd"] = time.perf_counter() - t
        self._save(phase="up")

    def _start_keygens(self):
        jobs = [(self.identity_file, "testhosts-client")]
        jobs += [(self._hostkey(i), f"testhosts-{self._netns(i)}") for i in range(self.n)]
        started = []
        for path, comment in jobs:
            for p in (path, path.with_name(path.name + ".pub")):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            argv = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)]
            started.append((argv, subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
        return started

    def _make_bridge(self) -> None:
        self.subnet = _claim_bridge(self.bridge)

    def _make_host(self, i: int) -> None:
        ns, veth, addr = self._netns(i), self._veth(i), self.hosts[i].address
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "address", self._mac(i), "netns", ns])
        _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _mac(self, i: int) -> str:
        """Host i's eth0 address: locally administered, from its IP address."""
        return "02:00:" + ":".join(f"{int(x):02x}" for x in self.hosts[i].address.split(".")[1:]) + ":00"

    def _add_neighbours(self, i: int) -> None:
        batch = self._host_dir(i) / "neighbours.batch"
        batch.write_text("".join(f"neigh replace {h.address} lladdr {self._mac(h.index)} dev eth0 nud permanent\n"
                                 for h in self.hosts if h.index != i))
        _run(["ip", "-n", self._netns(i), "-batch", str(batch)])

    def _write_ssh_files(self) -> None:
        pub = self.identity_file.with_name("id_ed25519.pub").read_text().strip()
        _write(self.authorized_keys, pub + "\n", 0o600)
        lines = []
        for h in self.hosts:
            ktype, key = self._hostkey(h.index).with_suffix(".pub").read_text().split()[:2]
            lines.append(f"{h.address} {ktype} {key}\n")
        _write(self.known_hosts, "".join(lines), 0o600)
        _write(self.ssh_config, self._client_config(), 0o600)
        penalties = "PerSourcePenalties no\n" if _sshd_version(self.sshd) >= (9, 8) else ""
        for h in self.hosts:
            _write(self._sshd_config_file(h.index), self._server_config(h) + penalties, 0o600)

    def _client_config(self) -> str:
        return (
            f"# generated by deploy/testhosts.py for {self.prefix}\n"
            f"Host {' '.join(self.addresses)}\n"
            "    User root\n"
            "    Port 22\n"
            f"    IdentityFile {self.identity_file}\n"
            "    IdentitiesOnly yes\n"
            f"    UserKnownHostsFile {self.known_hosts}\n"
            "    GlobalKnownHostsFile /dev/null\n"
            "    StrictHostKeyChecking yes\n"
            "    BatchMode yes\n"
            "    ConnectTimeout 5\n"
            "    LogLevel ERROR\n"
        )

    def _server_config(self, h: Host) -> str:
        return (
            f"# generated by deploy/testhosts.py for {h.netns}\n"
            f"ListenAddress {h.address}:22\n"
            f"HostKey {self._hostkey(h.index)}\n"
            f"PidFile {self._pidfile(h.index)}\n"
            f"AuthorizedKeysFile {self.authorized_keys}\n"
            "StrictModes no\n"
            "UsePAM no\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "PubkeyAuthentication yes\n"
            "PermitRootLogin prohibit-password\n"
            "MaxSessions 64\n"
            "MaxStartups 100:30:200\n"
            "UseDNS no\n"
            "PrintMotd no\n"
            "AcceptEnv LANG LC_*\n"
            # a login whose shell rehashes pyenv's shims (this machine's ~/.bashrc) tries its lock once, never waits:
            # a lock left by a login killed mid-way (a host stopped or crashed) made every later login wait 60 s
            "SetEnv PYENV_REHASH_TIMEOUT=0\n"
            "Subsystem sftp internal-sftp\n"
            "LogLevel INFO\n"
        )

    def _start_sshd(self, i: int) -> None:
        log = self.sshd_log(i)
        with open(log, "ab") as out:
            reaper = [sys.executable, "-c", REAPER] if self.reaper else []
            disk = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                    'mkdir -p "$0" && mount -t tmpfs -o "size=$1" tmpfs "$0" && shift && exec "$@"',
                    self.disk, self.disk_size] if self.disk else []
            self._procs[i] = subprocess.Popen(
                ["ip", "netns", "exec", self._netns(i), *disk, *reaper, self.sshd, "-D",
                 "-f", str(self._sshd_config_file(i)), "-E", str(log)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)

    def _wait_ready(self, indices) -> None:
        pending = set(indices)
        deadline = time.monotonic() + self.ready_timeout
        while pending:
            for i in sorted(pending):
                proc = self._procs.get(i)
                if proc is not None and proc.poll() is not None:
                    raise TestHostsError(f"sshd of {self._netns(i)} exited with {proc.returncode}; "
                                         f"log {self.sshd_log(i)}:\n{_tail(self.sshd_log(i))}")
                try:
                    with socket.create_connection((self.hosts[i].address, 22), timeout=0.5):
                        pending.discard(i)
                except OSError:
                    pass
            if pending:
                if time.monotonic() > deadline:
                    names = ", ".join(self._netns(i) for i in sorted(pending))
                    raise TestHostsError(f"sshd not accepting on port 22 after {self.ready_timeout}s: "
                                         f"{names}; see {self.state_dir}/hosts/*/sshd.log")
                time.sleep(0.01)

    # ---- state file
    def _save(self, phase: str) -> None:
        data = {
            "prefix": self.prefix, "n": self.n, "phase": phase, "subnet": self.subnet,
            "bridge": self.bridge, "bridge_address": self.bridge_address,
            "hosts": [h.as_dict() for h in self.hosts],
            "home": str(self.home), "ssh_config": str(self.ssh_config),
            "known_hosts": str(self.known_hosts), "identity_file": str(self.identity_file),
            "sshd": self.sshd, "reaper": self.reaper, "created_by_pid": os.getpid(),
        }
        self.state_dir.mkdir(parents=True, exist_ok=True)
        _write(self.state_file, json.dumps(data, indent=2) + "\n", 0o644)

    @classmethod
    def load(cls, state_dir) -> "TestHosts":
        """Re-open hosts that `up` (maybe in another process) created under `state_dir`."""
        path = Path(state_dir) / STATE_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise TestHostsError(f"{path} not found: no test hosts were created with --state {state_dir}")
        th = cls(data["n"], state_dir, data["prefix"], sshd=data.get("sshd", SSHD), reaper=data.get("reaper", False))
        th.subnet = data.get("subnet")
        th.hosts = [Host(**h) for h in data.get("hosts", [])]
        th._is_up = data.get("phase") == "up"
        return th

    # ---- faults and inspection
    def _check(self, i: int) -> Host:
        if not self.hosts:
            raise TestHostsError("hosts are not up")
        return self.hosts[i]

    def pids(self, i: int) -> list[int]:
        """Pids of every process in host i's namespace (sshd and all it started)."""
        return _netns_pids(self._check(i).netns)

    def usage(self) -> list[tuple[int, float]]:
        """(processes, CPU seconds) of each host's namespace now; see system.netns_usage. Take it
        before and after something: the difference is what the hosts spent on it."""
        return netns_usage([h.netns for h in self.hosts])

    def crash(self, i: int) -> list[int]:
        """Kill (SIGKILL) every process of host i, sshd included; returns the pids killed. A login shell killed on
        its way leaves no stale pyenv lock behind (this machine's ~/.bashrc rehashes at each login)."""
        killed = _kill_netns(self._check(i).netns, reap=self._reap)
        clear_stale_rehash_lock()
        proc = self._procs.pop(i, None)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        return killed

    def revive(self, i: int) -> None:
        """Start host i's sshd again (after `crash`), same host key."""
        self._check(i)
        proc = self._procs.get(i)
        if proc is None or proc.poll() is not None:
            self._start_sshd(i)
        self._wait_ready([i])

    def cut(self, i: int) -> None:
        """Cut host i off the network (its veth goes down; packets to it are dropped)."""
        _run(["ip", "link", "set", self._check(i).veth, "down"])

    def restore(self, i: int, wait: float = 5.0) -> None:
        """Reconnect host i after `cut`, and wait until it answers on TCP again (the kernel
        activates a veth that comes back up lazily, up to ~1 s later; connection refused also
        counts as reachable, so this works after `crash` too)."""
        host = self._check(i)
        _run(["ip", "link", "set", host.veth, "up"])
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((host.address, 22), timeout=0.05):
                    return
            except ConnectionRefusedError:
                return
            except OSError:
                time.sleep(0.01)
        raise TestHostsError(f"{host.netns} ({host.address}) unreachable {wait}s after restore")

    # ---- convenience
    def netns_argv(self, i: int, *command: str) -> list[str]:
        """argv that runs `command` directly in host i's namespace (no SSH)."""
        return ["ip", "netns", "exec", self._check(i).netns, *command]

    def ssh_argv(self, i: int, *command: str) -> list[str]:
        """argv for the `ssh` binary to host i with the generated config (strict host keys)."""
        return ["ssh", "-F", str(self.ssh_config), self._check(i).address, *command]

    def env(self, base: dict | None = None) -> dict:
        """Environment for a launcher/fabric process: `base` (default os.environ) with HOME set."""
        env = dict(os.environ if base is None else base)
        env["HOME"] = str(self.home)
        env.pop("SSH_AUTH_SOCK", None)
        return env

    def cluster_toml(self, port: int = DEFAULT_PORT, *, defaults: dict | None = None,
                     launch: dict | None = None, **training) -> str:
        """cluster.toml for these hosts: `[[hosts]]` (address, port) and `[training]` from kwargs."""
        if not self.hosts:
            raise TestHostsError("hosts are not up: addresses are chosen by up()")
        return render_cluster_toml(self.addresses, port, training, defaults, launch)

    # ---- down
    def down(self) -> None:
        """Remove everything of this instance; idempotent, and complete after a partial `up`."""
        problems: list[str] = []
        pattern = re.compile(rf"^{re.escape(self.prefix)}-(h|v)\d+$")
        namespaces = {self._netns(i) for i in range(self.n)}
        namespaces |= {ns for ns in _netns_list() if pattern.match(ns)}
        present = _netns_list()
        for ns in sorted(namespaces & present):
            try:
                _kill_netns(ns, reap=self._reap)
            except TestHostsError as e:
                problems.append(str(e))
        # sshds we know by pid but whose namespace is gone (e.g. deleted by hand)
        for i in range(self.n):
            pid = self._pid_from_file(i)
            if pid is not None:
                _kill(pid)
        for proc in self._procs.values():
            with contextlib.suppress(Exception):
                proc.kill()
                proc.wait(timeout=5)
        self._procs.clear()
        for ns in sorted(namespaces & _netns_list()):
            if _netns_pids(ns):
                problems.append(f"namespace {ns} still has processes; not deleted")
                continue
            proc = _run(["ip", "netns", "delete", ns], check=False)
            if proc.returncode != 0:
                problems.append(f"ip netns delete {ns}: {proc.stderr.strip()}")
        links = _link_names()
        ours = {self._veth(i) for i in range(self.n)} | {x for x in links if pattern.match(x)}
        for link in sorted(ours & links) + ([self.bridge] if self.bridge in links else []):
            proc = _run(["ip", "link", "delete", link], check=False)
            if proc.returncode != 0 and link in _link_names():
                problems.append(f"ip link delete {link}: {proc.stderr.strip()}")
        self._is_up = False
        if self.state_file.exists():
            with contextlib.suppress(OSError):
                self._save(phase="down")
        if problems:
            raise TestHostsError("test hosts not fully removed:\n  " + "\n  ".join(problems))

    def _reap(self) -> None:
        for proc in self._procs.values():
            proc.poll()

    def _pid_from_file(self, i: int) -> int | None:
        """sshd pid from its PidFile, only if that process still runs our sshd_config."""
        try:
            pid = int(self._pidfile(i).read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):
            return None
        return pid if str(self._sshd_config_file(i)) in cmdline else None

    def leftovers(self) -> list[str]:
        """What of this instance still exists (namespaces, links, live sshds); [] after down()."""
        pattern = re.compile(rf"^{re.escape(self.prefix)}-(h|v)\d+$")
        left = [f"netns {ns}" for ns in sorted(_netns_list()) if pattern.match(ns)]
        left += [f"link {x}" for x in sorted(_link_names()) if pattern.match(x) or x == self.bridge]
        left += [f"sshd pid {p}" for p in (self._pid_from_file(i) for i in range(self.n)) if p]
        return left
