#!/usr/bin/env python3
"""A real Slurm cluster on one machine for tests: slurmctld and N slurmd in network namespaces.

Each daemon runs in its own namespace on a private bridge (Debian's Slurm 22.05, no munge, no
slurmdbd).

Standard library only (plus `ip`, `nsenter` and Debian's slurmctld, slurmd, slurm-client);
needs root. Namespace, bridge and subnet helpers come from testhosts.py. See deploy/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from testhosts import (  # noqa: E402  (namespace helpers shared with the SSH test hosts)
    TestHostsError, _claim_bridge, _link_names, _netns_list, _netns_pids, _tail, _write)

__all__ = ["Node", "SlurmCluster", "SlurmClusterError", "parse_record", "slurm_missing"]

SLURMCTLD = "/usr/sbin/slurmctld"
SLURMD = "/usr/sbin/slurmd"
CLIENTS = ("srun", "sbatch", "scontrol", "sinfo", "squeue", "scancel")
CLIENT_COMMS = {"srun", "sbatch", "salloc", "sattach", "scontrol", "sinfo", "squeue", "scancel", "sstat"}
CTL_HOST, FIRST_NODE = 10, 11     # controller at <subnet>.10, node i at <subnet>.(11 + i); bridge .1
MAX_NODES = 200
MIN_JOB_AGE = 3600                # finished jobs stay in `scontrol show job` / `squeue -t all` 1 h
STATE_FILE = "cluster.json"
# Each daemon runs under this tiny reaper. Orphans of jobs (e.g. srun's helper child) are
# otherwise re-parented to PID 1, which here reaps only every ~2 s; until then the zombie
# keeps the job's process group alive and proctrack/pgid's wait (sleep 1 s, 2 s, ...) adds 3 s
# to every batch job that ran srun.
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
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


class SlurmClusterError(RuntimeError):
    """Starting, using or removing the test cluster failed; the message says what and where."""


class Node(NamedTuple):
    """One Slurm node: unpacks as (name, address)."""

    name: str
    address: str


def slurm_missing() -> str | None:
    """Why a cluster cannot be started here (not root, a tool missing), or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, slurmd)"
    for path in (SLURMCTLD, SLURMD):
        if not os.access(path, os.X_OK):
            return f"{path} not found: apt-get install -y slurmctld slurmd slurm-client"
    for tool, package in [(c, "slurm-client") for c in CLIENTS] + [("ip", "iproute2"), ("nsenter", "util-linux")]:
        if shutil.which(tool) is None:
            return f"`{tool}` not found: apt-get install -y {package}"
    return None


def _run(argv, check=True, timeout=30, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise SlurmClusterError(f"`{shlex.join(map(str, argv))}` failed ({proc.returncode}): "
                                f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def _alive(pid: int) -> bool:
    """True while pid exists and is not a zombie (PID 1 here reaps nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return pids


def _answers(address: str) -> bool:
    """True once a TCP connect to address reaches its stack (refused counts: nothing listens yet)."""
    try:
        with socket.create_connection((address, 1), timeout=0.2):
            return True
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def parse_record(text: str) -> dict:
    """`scontrol -o show job|node` output (one record) as a dict of its Key=Value fields."""
    out = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep:
            out[key] = value
    return out


class SlurmCluster:
    """slurmctld plus N slurmd, each in its own network namespace, all files in one folder.

        with SlurmCluster(2) as sc:
            subprocess.run(["srun", "-N2", "-n2", "hostname", "-I"], env={**os.environ, **sc.env})
            sc.nodes            # [Node("node1", "198.18.<k>.11"), ...], unpack as (name, address)
            sc.go_away(1); sc.revive(1)
    """

    __test__ = False

    def __init__(self, n: int = 2, workdir=None, *, prefix: str | None = None,
                 slurmd_timeout: int = 10, kill_wait: int = 5, ready_timeout: float = 60.0):
        if not 1 <= int(n) <= MAX_NODES:
            raise ValueError(f"n must be between 1 and {MAX_NODES}, not {n}")
        self.n = int(n)
        self.prefix = prefix or "mgs" + secrets.token_hex(3)   # testhosts uses "mgt..."
        self.workdir = Path(workdir).resolve() if workdir else None
        self.owns_workdir = workdir is None                   # a folder we made is deleted by stop()
        self.slurmd_timeout = int(slurmd_timeout)   # a dead node is DOWN after about 3x this
        self.kill_wait = int(kill_wait)             # SIGTERM .. SIGKILL on scancel, time limit, bad exit
        self.ready_timeout = ready_timeout
        self.partition = "debug"
        self.subnet: str | None = None
        self.nodes: list[Node] = []
        self.timings: dict[str, float] = {}
        self._procs: dict[str, subprocess.Popen] = {}       # "ctl" or str(node index) -> its reaper

    # ---- names and paths
    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    def netns(self, i: int | str) -> str:
        """Namespace of node i (or "ctl" for the controller's)."""
        return f"{self.prefix}-c" if i == "ctl" else f"{self.prefix}-n{i}"

    def _veth(self, i: int | str) -> str:
        return f"{self.prefix}-vc" if i == "ctl" else f"{self.prefix}-v{i}"

    def _keys(self) -> list:
        return ["ctl", *range(self.n)]

    @property
    def controller_address(self) -> str | None:
        return f"{self.subnet}.{CTL_HOST}" if self.subnet else None

    @property
    def conf(self) -> Path:
        return self.workdir / "slurm.conf"

    @property
    def env(self) -> dict:
        """What a Slurm client needs to use this cluster: {"SLURM_CONF": ...}."""
        return {"SLURM_CONF": str(self.conf)}

    def environ(self, base: dict | None = None) -> dict:
        """`base` (default os.environ) plus SLURM_CONF."""
        return {**(os.environ if base is None else base), **self.env}

    @property
    def jobcomp_file(self) -> Path:
        """One line per finished job (jobcomp/filetxt): JobId=.. JobState=.. ExitCode=.."""
        return self.workdir / "jobcomp.txt"

    def log(self, i: int | str = "ctl") -> Path:
        return self.workdir / "log" / ("slurmctld.log" if i == "ctl" else f"slurmd-{self.nodes[i].name}.log")

    # ---- context manager
    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- start
    def start(self) -> "SlurmCluster":
        """Create namespaces, write slurm.conf, start the daemons; return once every node is idle."""
        why = slurm_missing()
        if why:
            raise SlurmClusterError(f"cannot start a Slurm test cluster: {why}")
        if {self.bridge, self.netns("ctl")} & (_netns_list() | _link_names()):
            raise SlurmClusterError(f"prefix {self.prefix!r} is in use (`slurmcluster.py down --prefix {self.prefix}`)")
        t0 = time.perf_counter()
        try:
            if self.workdir is None:
                self.workdir = Path(tempfile.mkdtemp(prefix=f"slurmcluster-{self.prefix}-"))
            for sub in ["state", "log", "run", *(f"spool/node{i + 1}" for i in range(self.n))]:
                (self.workdir / sub).mkdir(parents=True, exist_ok=True)
            self._save("creating")           # so `down` finds everything even if we die half-way
            self._make_network()
            self._save("creating")
            addresses = [self.controller_address, *(a for _, a in self.nodes)]
            self._wait(lambda: all(map(_answers, addresses)), "the namespaces to answer on the bridge",
                       diagnose=lambda: _run(["ip", "-o", "link", "show", "master", self.bridge], check=False).stdout)
            _write(self.conf, self._slurm_conf(), 0o644)
            _write(self.workdir / "plugstack.conf", "", 0o644)   # no SPANK plugins from /etc/slurm
            self.timings["network"] = time.perf_counter() - t0
            self._start_daemon("ctl")
            self._wait(self._controller_up, "slurmctld to answer `scontrol ping`")
            self.timings["controller"] = time.perf_counter() - t0
            for i in range(self.n):
                self._start_daemon(i)
            self._wait(self._all_idle, f"{self.n} node(s) idle in `sinfo`")
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop()
            raise
        self.timings["start"] = time.perf_counter() - t0
        self._save("up")
        return self

    def _make_network(self) -> None:
        try:
            self.subnet = _claim_bridge(self.bridge)
        except TestHostsError as e:
            raise SlurmClusterError(str(e)) from None
        self.nodes = [Node(f"node{i + 1}", f"{self.subnet}.{FIRST_NODE + i}") for i in range(self.n)]
        for key in self._keys():
            ns, veth = self.netns(key), self._veth(key)
            addr = self.controller_address if key == "ctl" else self.nodes[key].address
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _slurm_conf(self) -> str:
        d = self.workdir
        host = socket.gethostname().split(".")[0]   # slurmctld only runs where `hostname -s` matches
        lines = [
            f"# generated by deploy/slurmcluster.py for {self.prefix}",
            f"ClusterName={self.prefix}",
            f"SlurmctldHost={host}({self.controller_address})",
            "SlurmctldPort=6817", "SlurmdPort=6818",
            "AuthType=auth/none", "CredType=cred/none",
            "SlurmUser=root", "SlurmdUser=root", "MailProg=/bin/true",
            f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/run/slurmctld.pid", f"SlurmdPidFile={d}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log", f"SlurmdLogFile={d}/log/slurmd-%n.log",
            f"PlugStackConfig={d}/plugstack.conf",
            "ProctrackType=proctrack/pgid", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt", f"JobCompLoc={self.jobcomp_file}",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides", "ReturnToService=2", "MpiDefault=none",
            "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0",
            f"KillWait={self.kill_wait}", f"MinJobAge={MIN_JOB_AGE}", f"SlurmdTimeout={self.slurmd_timeout}",
            "InactiveLimit=0", "SlurmctldDebug=info", "SlurmdDebug=info",
            "TCPTimeout=10",   # connect timeout (default 2 s): rides out SYNs lost for a while
            "NodeName=DEFAULT CPUs=1 State=UNKNOWN",
            *(f"NodeName={name} NodeAddr={addr}" for name, addr in self.nodes),
            f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        return "\n".join(lines) + "\n"

    def _start_daemon(self, key) -> None:
        if key == "ctl":
            argv, log = [SLURMCTLD, "-D", "-c", "-f", str(self.conf)], "slurmctld.out"
        else:
            name = self.nodes[key].name
            argv, log = [SLURMD, "-D", "-N", name, "-f", str(self.conf)], f"slurmd-{name}.out"
        # nsenter, not `ip netns exec`: the latter remounts /sys and slurmd then finds no cgroups
        with open(self.workdir / "log" / log, "ab") as out:
            self._procs[str(key)] = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{self.netns(key)}", sys.executable, "-I", "-S", "-c", REAPER, *argv],
                env=self.environ(),
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)

    def _check_daemons(self) -> None:
        for key, proc in self._procs.items():
            if proc.poll() is not None:
                which = "ctl" if key == "ctl" else int(key)
                what = "slurmctld" if which == "ctl" else f"slurmd of {self.nodes[which].name}"
                raise SlurmClusterError(f"{what} exited with {proc.returncode}; "
                                        f"{self.log(which)}:\n{_tail(self.log(which))}")

    def _wait(self, cond, what: str, timeout: float | None = None, diagnose=None):
        deadline = time.monotonic() + (timeout or self.ready_timeout)
        while True:
            self._check_daemons()
            value = cond()
            if value:
                return value
            if time.monotonic() > deadline:
                detail = diagnose() if diagnose else f"logs in {self.workdir}/log:\n{_tail(self.log('ctl'))}"
                raise SlurmClusterError(f"timed out waiting for {what}; {detail}")
            time.sleep(0.02)

    def _controller_up(self) -> bool:
        return " is UP" in self.command("scontrol", "ping", check=False).stdout

    def node_states(self) -> dict[str, str]:
        """{node name: state} as `sinfo` reports it, e.g. "idle", "alloc", "down*"."""
        proc = self.command("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return dict(line.split() for line in proc.stdout.splitlines() if len(line.split()) == 2)

    def _all_idle(self) -> bool:
        states = self.node_states()
        return all(states.get(name) == "idle" for name, _ in self.nodes)

    # ---- use
    def command(self, *argv, check: bool = True, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        """Run a Slurm client command (`srun`, `sbatch`, ...) against this cluster; text output."""
        proc = subprocess.run([str(a) for a in argv], env=self.environ(kw.pop("env", None)),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, **kw)
        if check and proc.returncode != 0:
            raise SlurmClusterError(f"`{shlex.join(map(str, argv))}` failed ({proc.returncode}): "
                                    f"{(proc.stderr + proc.stdout).strip()}")
        return proc

    def job(self, job_id) -> dict | None:
        """`scontrol show job` as a dict (JobState, ExitCode, NodeList, ...); None once purged."""
        proc = self.command("scontrol", "-o", "show", "job", job_id, check=False)
        return parse_record(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else None

    def wait_job(self, job_id, timeout: float = 60) -> dict:
        """Wait until the job reached a final state; return its `scontrol show job` record."""
        def final():
            info = self.job(job_id)
            return info if info and info.get("JobState") in FINAL_STATES else None
        return self._wait(final, f"job {job_id} to finish", timeout)

    # ---- faults and inspection
    def pids(self, i: int | str) -> list[int]:
        """Every process of node i's namespace (slurmd, slurmstepd, tasks); "ctl" for slurmctld's."""
        return _netns_pids(self.netns(i))

    def go_away(self, i: int) -> list[int]:
        """Node i dies: SIGKILL its slurmd, slurmstepds and tasks; returns the pids killed.
        slurmctld marks it DOWN after about 3 x SlurmdTimeout; `revive(i)` brings it back."""
        killed = self._kill_ns(self.netns(i))
        self._reap(str(i))
        return killed

    def revive(self, i: int, timeout: float | None = None) -> None:
        """Start node i's slurmd again and wait until it is idle (ReturnToService=2)."""
        proc = self._procs.get(str(i))
        if proc is None or proc.poll() is not None:
            self._start_daemon(i)
        name = self.nodes[i].name
        self._wait(lambda: self.node_states().get(name) == "idle", f"{name} idle again", timeout)

    # ---- stop
    def _kill_ns(self, ns: str, timeout: float = 10.0) -> list[int]:
        killed: list[int] = []
        deadline = time.monotonic() + timeout
        while pids := [p for p in _netns_pids(ns) if _alive(p)]:
            if time.monotonic() > deadline:
                raise SlurmClusterError(f"processes {pids} in namespace {ns} survived SIGKILL")
            self._kill(pids)
            killed += [p for p in pids if p not in killed]
        return killed

    def _kill(self, pids, timeout: float = 10.0) -> None:
        """SIGKILL pids and wait until each is gone or a zombie."""
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.01)
        self._reap()

    def _reap(self, key: str | None = None) -> None:
        for k, proc in list(self._procs.items()):
            if proc.poll() is not None and key in (None, k):
                del self._procs[k]

    def processes(self) -> list[int]:
        """Live processes of this cluster seen from outside its namespaces too: daemons started
        with its slurm.conf, and Slurm clients (srun, sbatch, ...) whose SLURM_CONF names it."""
        if self.workdir is None:
            return []
        conf, skip, found = str(self.conf), _ancestors(), []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in skip:
                continue
            try:   # daemons (and their reapers) name the conf in argv, clients in SLURM_CONF
                ours = conf in (entry / "cmdline").read_bytes().decode(errors="replace")
                if not ours and (entry / "comm").read_text().strip() in CLIENT_COMMS:
                    ours = f"SLURM_CONF={conf}\0".encode() in (entry / "environ").read_bytes() + b"\0"
            except OSError:
                continue
            if ours and _alive(int(entry.name)):
                found.append(int(entry.name))
        return found

    def stop(self) -> None:
        """Kill every daemon, job and client process of the cluster, delete namespaces, links and
        (if start() made it) the folder. Idempotent; raises if anything is left."""
        problems: list[str] = []
        namespaces = {self.netns(k) for k in self._keys()} & _netns_list()
        for _ in range(3):   # a client may start a step while we kill; go round until all is quiet
            for ns in sorted(namespaces):
                try:
                    self._kill_ns(ns)
                except SlurmClusterError as e:
                    problems.append(str(e))
            self._kill(self.processes())
            if not self.processes() and not any(_netns_pids(ns) for ns in namespaces):
                break
        for proc in self._procs.values():
            with contextlib.suppress(Exception):
                proc.kill()
                proc.wait(timeout=5)
        self._procs.clear()
        for ns in sorted(namespaces):
            proc = _run(["ip", "netns", "delete", ns], check=False)
            if proc.returncode != 0:
                problems.append(f"ip netns delete {ns}: {proc.stderr.strip()}")
        links = _link_names()
        for link in [self._veth(k) for k in self._keys()] + [self.bridge]:
            if link in links:
                proc = _run(["ip", "link", "delete", link], check=False)
                if proc.returncode != 0 and link in _link_names():
                    problems.append(f"ip link delete {link}: {proc.stderr.strip()}")
        if self.workdir is not None:
            if self.owns_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)
            elif (self.workdir / STATE_FILE).exists():
                with contextlib.suppress(OSError):
                    self._save("down")
        problems += self.leftovers()
        if problems:
            raise SlurmClusterError("Slurm test cluster not fully removed:\n  " + "\n  ".join(problems))

    def leftovers(self) -> list[str]:
        """What of this cluster still exists (namespaces, links, processes); [] after stop()."""
        names = {self.netns(k) for k in self._keys()}
        links = {self._veth(k) for k in self._keys()} | {self.bridge}
        left = [f"netns {ns}" for ns in sorted(names & _netns_list())]
        left += [f"link {x}" for x in sorted(links & _link_names())]
        left += [f"process {pid}" for pid in self.processes()]
        return left

    # ---- state file (for the CLI)
    def _save(self, phase: str) -> None:
        data = {"n": self.n, "prefix": self.prefix, "phase": phase, "subnet": self.subnet,
                "workdir": str(self.workdir), "owns_workdir": self.owns_workdir,
                "conf": str(self.conf), "partition": self.partition, "nodes": self.nodes,
                "slurmd_timeout": self.slurmd_timeout, "kill_wait": self.kill_wait}
        _write(self.workdir / STATE_FILE, json.dumps(data, indent=2) + "\n", 0o644)

    @classmethod
    def load(cls, workdir) -> "SlurmCluster":
        """Re-open a cluster that `up` (maybe in another process) started in `workdir`."""
        path = Path(workdir) / STATE_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise SlurmClusterError(f"{path} not found: no cluster was started there")
        sc = cls(data["n"], data["workdir"], prefix=data["prefix"],
                 slurmd_timeout=data["slurmd_timeout"], kill_wait=data["kill_wait"])
        sc.owns_workdir, sc.subnet = data["owns_workdir"], data["subnet"]
        sc.nodes = [Node(*x) for x in data["nodes"]]
        return sc


# --------------------------------------------------------------------------- CLI

def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="slurmcluster.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start slurmctld and N slurmd; print `export SLURM_CONF=...`")
    up.add_argument("n", type=int)
    up.add_argument("--state", help="folder for slurm.conf, logs, state (default: a new temp folder)")
    up.add_argument("--slurmd-timeout", type=int, default=10)
    down = sub.add_parser("down", help="stop the cluster of --state (or of --prefix) and remove it")
    g = down.add_mutually_exclusive_group(required=True)
    g.add_argument("--state")
    g.add_argument("--prefix")
    for name, text in (("go-away", "kill node I's slurmd and processes"), ("revive", "restart node I's slurmd")):
        f = sub.add_parser(name, help=text)
        f.add_argument("i", type=int)
        f.add_argument("--state", required=True)
    args = p.parse_args(argv)
    try:
        if args.cmd == "up":
            sc = SlurmCluster(args.n, args.state, slurmd_timeout=args.slurmd_timeout)
            sc.owns_workdir = not args.state or not Path(args.state).exists()   # `down` removes it then
            sc.start()
            print(f"export SLURM_CONF={shlex.quote(str(sc.conf))}")
            print(f"slurmcluster: {sc.n} node(s) up in {sc.timings['start']:.2f}s: "
                  f"{', '.join(f'{n}={a}' for n, a in sc.nodes)}, controller {sc.controller_address}, "
                  f"partition {sc.partition}\n  stop: python {sys.argv[0]} down --state {sc.workdir}",
                  file=sys.stderr)
        elif args.cmd == "down":
            if args.state:
                sc = SlurmCluster.load(args.state)
            else:
                sc = SlurmCluster(MAX_NODES, None, prefix=args.prefix)
                sc.owns_workdir = False
            sc.stop()
            print(f"slurmcluster: {sc.prefix} removed", file=sys.stderr)
        elif args.cmd == "go-away":
            killed = SlurmCluster.load(args.state).go_away(args.i)
            print(f"killed {len(killed)} processes: {' '.join(map(str, killed))}", file=sys.stderr)
        else:
            SlurmCluster.load(args.state).revive(args.i)
    except (SlurmClusterError, ValueError) as e:
        print(f"slurmcluster: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
