"""Shared fixtures: a private MGPU_HOME, the real CLI as a subprocess, and orphan checks."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

# a real slurmctld + slurmd cluster (deploy/slurmcluster.py); the real runs that tests which only read a run share
pytest_plugins = ["slurm_fixtures", "shared_runs"]

REPO = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI") == "true"
# a test that uses one of these starts real tasks, hosts or a Slurm cluster: marked `cluster`, so that
# `pytest -m "not cluster"` runs the pure and single-process tests alone (about 30 s; at most 45)
CLUSTER_FIXTURES = {"cli", "th", "fresh", "slurm_cluster", "make_slurm_cluster", "digits_run", "restart_run",
                    "refused_run_id"}


def pytest_configure(config):
    from budget import Budget

    config.pluginmanager.register(Budget(), "budget")


def pytest_collection_modifyitems(items):
    from budget import heaviest_first

    for item in items:
        if CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)
    items[:] = heaviest_first(items)


def need(module: str):
    """`module` imported; missing, the test is skipped, except under CI=true (.ci/run installs every extra the
    tests need: there a missing one fails)."""
    if IN_CI:
        return importlib.import_module(module)
    return pytest.importorskip(module)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def namespace_hosts(n: int, folder: Path, **kw):
    """For a module fixture (`yield from`): `n` hosts in network namespaces with real sshds (deploy/testhosts;
    `kw`: TestHosts' options), taken down after, nothing of them left; skipped without root only outside CI=true."""
    if os.geteuid() != 0 and not IN_CI:
        pytest.skip("needs root to make network namespaces and run sshd (only outside CI=true)")
    sys.path.insert(0, str(REPO / "deploy"))
    from testhosts import TestHosts

    hosts = TestHosts(n, folder, **kw)
    try:
        hosts.up()
        yield hosts
    finally:
        hosts.down()
    assert hosts.leftovers() == []


def run_processes(home: Path) -> list[psutil.Process]:
    """Every live process that belongs to a run recorded under `home`."""
    found = []
    for proc in psutil.process_iter(["cmdline", "environ", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
                continue
            env = proc.info["environ"] or {}
            cmd = " ".join(proc.info["cmdline"] or [])
            if env.get("MGPU_HOME") == str(home) or str(home) in env.get("MGPU_RUN_DIR", "") or str(home) in cmd:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def wait_gone(home: Path, timeout: float) -> list[psutil.Process]:
    deadline = time.time() + timeout
    while True:
        left = run_processes(home)
        if not left or time.time() > deadline:
            return left
        time.sleep(0.1)


def reap(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Kill what a test left behind (so the next test starts clean); returns the list for the report."""
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    return procs


def command_lines_with(*needles: str) -> list[str]:
    """Every process command line on this machine that contains one of `needles`."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if any(n in cmd for n in needles):
            found.append(cmd)
    return found


def alive(pid: int) -> bool:
    """A process with this pid runs (a zombie does not count)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def status_json(cli, *args) -> dict:
    """`mgpu-cluster status --json [ARGS]`, which must succeed."""
    r = cli("status", "--json", *args, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def wait_for(cond, timeout: float, what: str):
    """Poll cond() until it returns something true; fail naming `what` after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@contextlib.contextmanager
def tmpfs(folder: Path, size: str):
    """A real small disk: a tmpfs of `size` mounted at `folder` (made), unmounted afterwards (needs root)."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def latest_state(cli) -> dict | None:
    """state.json of the newest run under the CLI's MGPU_HOME (None before there is one)."""
    runs = sorted((cli.home / "runs").glob("*/state.json")) if (cli.home / "runs").exists() else []
    try:
        return json.loads(runs[-1].read_text()) if runs else None
    except ValueError:  # caught between write and rename of another writer: try again later
        return None


# a thread's header in a stack (worker.host.stacks), whatever name py-spy reads for the thread: it may read ""
STACK_HEADER = re.compile(r'^thread \d+( of pid \d+)? "[^"\n]*" \((active|idle)\):$', re.M)

DIGITS = 'entrypoint = "worker.examples.digits:task"'


def write_spec(tmp_path: Path, training: str = DIGITS, n: int = 2, launch: str = "", extra: str = "",
               env: str = 'TF_CPP_MIN_LOG_LEVEL = "2"', name: str = "cluster.toml", each: str = "") -> Path:
    """A spec of `n` local hosts on free ports; `each`: keys of every host, {i} for its index."""
    hosts = "".join(f'[[hosts]]\naddress = "localhost"\nport = {free_port()}\n' + each.format(i=i) for i in range(n))
    text = (f'[defaults]\ngpus = "none"\nenv = {{ {env} }}\n{extra}'
            f"{hosts}[training]\n{training}\n[launch]\n{launch}\n")
    path = tmp_path / name
    path.write_text(text)
    return path


def write_slurm_spec(tmp_path: Path, training: str, slurm: str = "", launch: str = "", nodes: int = 2,
                     partition: str = "debug", env: str = 'TF_CPP_MIN_LOG_LEVEL = "2"') -> Path:
    """A [slurm] spec whose workdir is tmp_path/shared (every node sees it: the namespaces share the disk)."""
    shared = tmp_path / "shared"
    shared.mkdir(exist_ok=True)
    path = tmp_path / "cluster.toml"
    path.write_text(f'[slurm]\nnodes = {nodes}\nworkdir = "{shared}"\npartition = "{partition}"\n'
                    f'python = "{sys.executable}"\nenv = {{ {env} }}\n{slurm}\n'
                    f"[training]\n{training}\n[launch]\n{launch}\n")
    return path


def launcher_traceback(out: str) -> bool:
    """A traceback of the launcher itself (workers' own lines carry a 'taskN host |' prefix)."""
    return any(line.startswith("Traceback") for line in out.splitlines())


class Cli:
    def __init__(self, home: Path, cwd: Path):
        self.home, self.cwd = home, cwd
        self.env = {**os.environ, "MGPU_HOME": str(home), "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}

    def argv(self, *args) -> list[str]:
        return [sys.executable, "-m", "launcher", *map(str, args)]

    def __call__(self, *args, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=timeout, **kw)

    def popen(self, *args, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.argv(*args), cwd=self.cwd, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, **kw)

    @contextlib.contextmanager
    def running(self, *args, **kw):
        """`popen(*args)`, reaped on the way out whatever happens: a failing test leaves no launcher behind."""
        proc = self.popen(*args, **kw)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def up_while(self, spec, ready, act, what: str, ready_timeout: float = 240, timeout: float = 120):
        """Run `up SPEC`; once ready() gives a value, act(up, value); then (exit code, output).

        `up` is reaped whatever happens, so a failing test leaves no launcher behind."""
        up = self.popen("up", spec)
        try:
            act(up, wait_for(ready, ready_timeout, what))
            out, _ = up.communicate(timeout=timeout)
            return up.returncode, out
        finally:
            if up.poll() is None:
                up.kill()
                up.wait()


@pytest.fixture
def cli(tmp_path):
    home = tmp_path / "mgpu-home"
    c = Cli(home, tmp_path)
    yield c
    left = reap(run_processes(home))
    assert not left, f"processes left running after the test: {[(p.pid, p.info) for p in left]}"
