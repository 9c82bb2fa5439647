"""Preflight at scale: one check per host whatever its number of tasks, nothing left after Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from conftest import IN_CI, REPO, free_port, wait_for
from test_check import spec_text

PY = sys.executable


def free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


def wrapper(path, body: str) -> str:
    """An interpreter for the spec that is not this one: a shell script."""
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_check_of_1000_local_tasks_and_one_busy_port(cli, tmp_path):
    ports = free_ports(1000)
    spec = tmp_path / "c.toml"
    spec.write_text(spec_text(ports))
    t0 = time.monotonic()
    r = cli("check", spec, timeout=120)
    took = time.monotonic() - t0
    print(f"\ncheck of 1000 local tasks: {took:.2f} s")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    assert r.stdout.count(" ok ") == 1000
    assert took < 30

    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", ports[500]))
    holder.listen()
    try:
        t0 = time.monotonic()
        r = cli("check", spec, timeout=120)
        took = time.monotonic() - t0
    finally:
        holder.close()
    print(f"check of 1000 local tasks, one port busy: {took:.2f} s")
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2, out[-2000:]
    assert f"task 500 (localhost:{ports[500]}): port {ports[500]} is in use by pid {os.getpid()}" in out, out[-2000:]
    assert r.stdout.count(" ok ") == 999 and "Traceback" not in out
    assert took < 30


def test_other_local_interpreter_runs_one_doctor_for_all_its_tasks(cli, tmp_path):
    log = tmp_path / "calls"
    python = wrapper(tmp_path / "py", f'echo "$@" >> {log}\nexec {PY} "$@"')
    spec = tmp_path / "c.toml"
    spec.write_text(spec_text(free_ports(50), extra=f'python = "{python}"\n'))
    r = cli("check", spec, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    assert r.stdout.count(" ok ") == 50
    calls = log.read_text().splitlines()
    assert len(calls) == 1 and calls[0].count("--task") == 50, calls


def test_ctrl_c_during_check_exits_130_and_kills_its_doctor(cli, tmp_path):
    pidfile = tmp_path / "doctor.pid"
    python = wrapper(tmp_path / "py", f"echo $$ > {pidfile}\nexec sleep 300")
    spec = tmp_path / "c.toml"
    spec.write_text(spec_text(free_ports(3), extra=f'python = "{python}"\n'))
    check = cli.popen("check", spec)
    try:
        pid = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 60, "the doctor to start"))
        doctor = psutil.Process(pid)
        assert doctor.pid != check.pid and os.getsid(pid) == pid  # its own session: a terminal's ^C misses it
        check.send_signal(signal.SIGINT)
        out, _ = check.communicate(timeout=30)
    finally:
        if check.poll() is None:
            check.kill()
            check.wait()
    assert check.returncode == 130, out
    assert "Traceback" not in out, out
    gone = lambda: not doctor.is_running() or doctor.status() == psutil.STATUS_ZOMBIE  # noqa: E731
    assert wait_for(gone, 10, "the doctor to be gone")


# --------------------------------------------------------------------------- over SSH (namespace hosts)

COUNT = """
import json, sys, time
from pathlib import Path
from launcher.plan import plan_tasks
from launcher.engines.supervised.preflight import preflight
from launcher.spec.file import load_spec
from launcher.engines.supervised import transports_for

spec = load_spec(sys.argv[1])
plans = plan_tasks(spec, "check")
transports = transports_for(spec, plans)
calls = {}
for t in set(transports):
    def counted(plan, argv, timeout, t=t, call=t.call):
        calls[plan.host.address] = calls.get(plan.host.address, 0) + 1
        return call(plan, argv, timeout)
    t.call = counted
said = []
t0 = time.monotonic()
checks = preflight(spec, plans, transports, base=Path(sys.argv[1]).parent, say=said.append)
took = time.monotonic() - t0
for t in set(transports):
    t.close()
print(json.dumps({"calls": calls, "problems": [c.problems for c in checks], "said": said, "s": took}))
"""


@pytest.mark.cluster
@pytest.mark.skipif(os.geteuid() != 0 and not IN_CI, reason="needs root to make network namespaces and run sshd")
def test_ssh_preflight_is_one_command_per_host(tmp_path):
    sys.path.insert(0, str(REPO / "deploy"))
    from testhosts import TestHosts

    def run(th, spec) -> dict:
        r = subprocess.run([PY, "-c", COUNT, str(spec)], capture_output=True, text=True, timeout=120,
                           env=th.env(), cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])

    with TestHosts(2, tmp_path / "th") as th:
        workdir = tmp_path / "wd"
        workdir.mkdir()
        hosts = "".join(f'[[hosts]]\naddress = "{a}"\nport = {p}\n'
                        for a in th.addresses for p in (20000, 20001, 20002))
        spec = tmp_path / "c.toml"
        spec.write_text(textwrap.dedent(f"""\
            [defaults]
            python = "{PY}"
            workdir = "{workdir}"
            gpus = "none"
            """) + hosts + '[training]\ncommand = ["true"]\n[launch]\nconnect_timeout = 10\n')  # cluster check: 10 s
        res = run(th, spec)
        print(f"\nSSH preflight, 2 hosts x 3 tasks: {res['s']:.2f} s, commands per host {res['calls']}")
        assert res["calls"] == {a: 1 for a in th.addresses}, res
        assert res["problems"] == [[]] * 6, res
        assert any("every worker reaches every other worker's port (30 pairs" in s for s in res["said"]), res

        blocker = subprocess.Popen(th.netns_argv(1, PY, "-c", "import socket, time; s = socket.socket(); "
                                                 "s.bind(('', 20001)); s.listen(); print('ok', flush=True); "
                                                 "time.sleep(300)"), stdout=subprocess.PIPE, text=True)
        try:
            assert blocker.stdout.readline().strip() == "ok"
            res = run(th, spec)
        finally:
            blocker.kill()
            blocker.wait()
        print(f"SSH preflight with a port held on one host: {res['s']:.2f} s")
        assert res["calls"] == {a: 1 for a in th.addresses}, res
        assert res["problems"][4] and f"port 20001 is in use by pid {blocker.pid}" in res["problems"][4][0], res
        assert [bool(p) for p in res["problems"]] == [False] * 4 + [True, False], res
        assert res["s"] < 7, "a failing host's peers should not wait out the cluster check (10 s)"

        missing = tmp_path / "missing"  # tasks of one host in different folders: still one command
        spec.write_text(spec.read_text().replace("port = 20001\n", f'port = 20001\nworkdir = "{missing}"\n', 1))
        res = run(th, spec)
        assert res["calls"] == {a: 1 for a in th.addresses}, res
        assert [bool(p) for p in res["problems"]] == [False, True] + [False] * 4, res
        assert f"workdir '{missing}' does not exist" in res["problems"][1][0], res
