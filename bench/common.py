"""What every benchmark shares: the Bench context (scratch folders, `mgpu-cluster up` timed,
run records, SSH test hosts), spec writing and process helpers."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bench.timing import children_cpu, machine_cpu

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
JOB = BENCH / "jobs" / "train.py"
HAND = BENCH / "jobs" / "hand_launch.sh"
PY = sys.executable


class SkipBench(Exception):
    """This benchmark cannot run here (quick mode, no root, no sshd...); the reason is shown."""


# --------------------------------------------------------------------------- specs and argv

def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def mgpu_argv() -> list[str]:
    """The console script users run (next to this interpreter, not a pyenv shim), else -m launcher."""
    script = Path(PY).parent / "mgpu-cluster"
    if script.exists():
        return [str(script)]
    found = shutil.which("mgpu-cluster")
    return [found] if found else [PY, "-m", "launcher"]


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(v)


def write_spec(path: Path, hosts: list[dict], command: list[str], defaults: dict | None = None,
               launch: dict | None = None, training: dict | None = None) -> Path:
    """A spec of `hosts` that runs `command`, or (`command` empty) the built-in runner with `training`'s keys."""
    lines = []
    if defaults:
        lines += ["[defaults]"] + [f"{k} = {toml_value(v)}" for k, v in defaults.items()] + [""]
    for h in hosts:
        lines += ["[[hosts]]"] + [f"{k} = {toml_value(v)}" for k, v in h.items()] + [""]
    lines += ["[training]"] + ([f"command = {toml_value(command)}"] if command else [])
    lines += [f"{k} = {toml_value(v)}" for k, v in (training or {}).items()] + [""]
    if launch:
        lines += ["[launch]"] + [f"{k} = {toml_value(v)}" for k, v in launch.items()] + [""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def local_hosts(n: int, cpus: list | None = None) -> list[dict]:
    """`n` [[hosts]] tables on localhost with free ports (pinned to `cpus[i]` when given)."""
    hosts = [{"address": "localhost", "port": p} for p in free_ports(n)]
    for h, c in zip(hosts, cpus or []):
        h["cpus"] = c
    return hosts


LOCAL_DEFAULTS = {"gpus": "none", "env": {"TF_CPP_MIN_LOG_LEVEL": "2"}}


def job_argv(model: str, batch: int, steps: int, warmup: int, *extra: str) -> list[str]:
    return [PY, str(JOB), "--model", model, "--batch", str(batch), "--steps", str(steps),
            "--warmup", str(warmup), *extra]


def bench_line(text: str) -> dict | None:
    """The last `BENCH {json}` line of a worker's output."""
    found = None
    for line in text.splitlines():
        at = line.find("BENCH {")
        if at >= 0:
            with contextlib.suppress(ValueError):
                found = json.loads(line[at + 6:])
    return found


# --------------------------------------------------------------------------- processes

def alive(pid: int | None) -> bool:
    """A process that exists and is not a zombie."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_tree(proc: subprocess.Popen) -> None:
    """Stop what a bench step started (its own session) if it is still there."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


def wait_for(cond: Callable[[], object], timeout: float, what: str, poll: float = 0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def tail(text: str, n: int = 25) -> str:
    return "\n".join(text.splitlines()[-n:])


@dataclass
class UpResult:
    wall: float
    code: int
    run: dict
    output: str
    launcher_cpu: float
    machine_cpu: float = 0.0


# --------------------------------------------------------------------------- the context

class Bench:
    """One bench run: options, scratch folders, the rows and raw data each benchmark adds."""

    SSH_HOSTS = 32  # namespace hosts made once, shared by the SSH benchmarks

    def __init__(self, quick: bool, reps: int, out_dir: Path, log=print):
        self.quick = quick
        self.reps = reps
        self.out_dir = out_dir.resolve()
        self.scratch = self.out_dir / "out"
        self.home = self.scratch / "mgpu-home"
        self.raw: dict = {}
        self.plot: dict = {}
        self.log = log
        self._hosts = None
        self._hosts_error: str | None = None
        self._seq = 0

    def fresh(self, name: str) -> Path:
        self._seq += 1
        d = self.scratch / f"{self._seq:03d}-{name}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def env(self, base: dict | None = None) -> dict:
        env = dict(os.environ if base is None else base)
        env.update(MGPU_HOME=str(self.home), COLUMNS="200", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
        return env

    def runs(self) -> set[str]:
        d = self.home / "runs"
        return {p.name for p in d.iterdir() if (p / "state.json").exists()} if d.exists() else set()

    def run_state(self, run_id: str) -> dict:
        with contextlib.suppress(OSError, ValueError):
            return json.loads((self.home / "runs" / run_id / "state.json").read_text())
        return {}

    def up(self, spec: Path, env: dict | None = None, timeout: float = 600, args: tuple = ()) -> UpResult:
        """`mgpu-cluster up SPEC`, timed from start to exit; the run's state.json with it."""
        before = self.runs()
        log = spec.with_suffix(".out")
        cpu0, mcpu0 = children_cpu(), machine_cpu()
        with open(log, "w") as out:
            t0 = time.time()
            proc = subprocess.Popen([*mgpu_argv(), "up", str(spec), *args], stdout=out, stderr=subprocess.STDOUT,
                                    env=env or self.env(), cwd=spec.parent, start_new_session=True)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                kill_tree(proc)
                raise RuntimeError(f"mgpu-cluster up {spec} did not finish within {timeout:.0f} s; see {log}")
            wall = time.time() - t0
        new = sorted(self.runs() - before)
        run = self.run_state(new[-1]) if new else {}
        run["_t0"] = t0
        return UpResult(wall, code, run, log.read_text(errors="replace"), children_cpu() - cpu0,
                        machine_cpu() - mcpu0)

    def up_local(self, name: str, command: list[str], hosts: int = 2, cpus: list | None = None,
                 env: dict | None = None) -> UpResult:
        """`up` of `command` on `hosts` local tasks, in a fresh folder."""
        defaults = {**LOCAL_DEFAULTS, "env": {**LOCAL_DEFAULTS["env"], **(env or {})}}
        spec = write_spec(self.fresh(name) / "cluster.toml", local_hosts(hosts, cpus), command, defaults)
        return self.up(spec)

    def hand(self, name: str, command: list[str], env: dict | None = None) -> tuple[float, int, Path]:
        """The baseline launcher: bench/jobs/hand_launch.sh with two local workers; (wall, exit, folder)."""
        d = self.fresh(name)
        p0, p1 = free_ports(2)
        t0 = time.time()
        with open(d / "hand.out", "w") as out:
            code = subprocess.run(["bash", str(HAND), str(p0), str(p1), str(d), "--", *command], stdout=out,
                                  stderr=subprocess.STDOUT, env={**self.env(), **(env or {})}, cwd=d,
                                  timeout=600, start_new_session=True).returncode  # as `up` is: see self.up
        return time.time() - t0, code, d

    def task_log(self, run: dict, index: int, workdir: Path | None = None) -> str:
        run_dir = Path(run["tasks"][index]["run_dir"])
        if not run_dir.is_absolute() and workdir:
            run_dir = workdir / run_dir
        with contextlib.suppress(OSError):
            return (run_dir / "worker.log").read_text(errors="replace")
        return ""

    @staticmethod
    def need_ok(res: UpResult, what: str) -> None:
        if res.code != 0:
            raise RuntimeError(f"{what}: mgpu-cluster up exited {res.code}:\n{tail(res.output)}")

    def hosts(self):
        """The SSH test hosts (deploy/testhosts/), made on first use; SkipBench when they cannot be."""
        if self._hosts is None and self._hosts_error is None:
            try:
                if os.geteuid() != 0:
                    raise RuntimeError("needs root (network namespaces)")
                if not Path("/usr/sbin/sshd").exists():
                    raise RuntimeError("needs /usr/sbin/sshd (apt-get install -y openssh-server)")
                if str(REPO / "deploy") not in sys.path:
                    sys.path.insert(0, str(REPO / "deploy"))
                from testhosts import TestHosts

                th = TestHosts(self.SSH_HOSTS, self.scratch / "testhosts", reaper=True)
                t0 = time.time()
                th.up()
                self._hosts = th
                self.log(f"  {th.n} namespace hosts with sshd up in {time.time() - t0:.1f} s")
            except Exception as exc:  # noqa: BLE001 - any failure here skips the SSH benchmarks, with the reason
                self._hosts_error = f"{type(exc).__name__}: {exc}".strip()[:400]
        if self._hosts is None:
            raise SkipBench(f"SSH test hosts unavailable ({self._hosts_error})")
        return self._hosts

    def close(self) -> None:
        if self._hosts is not None:
            with contextlib.suppress(Exception):
                self._hosts.down()
            self._hosts = None
