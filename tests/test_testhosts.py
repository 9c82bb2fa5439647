"""The fake multi-host setup (deploy/testhosts.py): namespaces with real sshds, reached over SSH."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import tomllib

import pytest

from conftest import REPO, alive

sys.path.insert(0, str(REPO / "deploy"))
from testhosts import TestHosts, TestHostsError, render_cluster_toml  # noqa: E402

IN_CI = os.environ.get("CI") == "true"
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 and not IN_CI,
    reason="needs root to create network namespaces and run sshd (always runs under CI=true)",
)


def ssh(th, i, command, **kw):
    return subprocess.run(th.ssh_argv(i, command), capture_output=True, text=True, timeout=20, **kw)



@pytest.fixture(scope="module")
def th(tmp_path_factory):
    hosts = TestHosts(2, tmp_path_factory.mktemp("testhosts"))
    try:
        hosts.up()
        print(f"\nup 2 hosts: {hosts.timings['up']:.3f}s")
        yield hosts
    finally:
        hosts.down()
    assert hosts.leftovers() == []


@pytest.fixture
def fresh(tmp_path):
    """A throwaway instance for tests that break their hosts."""
    hosts = TestHosts(2, tmp_path / "fresh")
    try:
        yield hosts.up()
    finally:
        hosts.down()


def test_render_cluster_toml_defaults_and_training():
    text = render_cluster_toml(["198.18.7.11", "198.18.7.12"], 20000)
    data = tomllib.loads(text)
    assert data["hosts"] == [{"address": "198.18.7.11", "port": 20000},
                             {"address": "198.18.7.12", "port": 20000}]
    assert data["training"] == {"command": ["python3", "-c", "print('hello')"]}

    text = render_cluster_toml(["198.18.7.11"], 20001, {"entrypoint": "m:f", "epochs": 2, "lr": 0.5,
                                                       "mixed": False, "env": {"A B": 'x"\\\n'}},
                               launch={"restarts": 1})
    data = tomllib.loads(text)
    assert data["hosts"][0]["port"] == 20001
    assert data["training"] == {"entrypoint": "m:f", "epochs": 2, "lr": 0.5, "mixed": False,
                                "env": {"A B": 'x"\\\n'}}
    assert data["launch"] == {"restarts": 1}


@needs_root
def test_hosts_and_files(th):
    assert len(th.hosts) == 2
    assert [h.address for h in th.hosts] == [f"{th.subnet}.11", f"{th.subnet}.12"]
    assert th.hosts[0]["netns"] == th.hosts[0].netns
    assert len({h.netns for h in th.hosts} | {h.veth for h in th.hosts}) == 4
    assert all(len(h.veth) <= 15 for h in th.hosts) and len(th.bridge) <= 15
    assert th.home == th.state_dir / "home"
    for path in (th.ssh_config, th.known_hosts, th.identity_file):
        assert path.is_file() and path.parent == th.home / ".ssh"
    assert "StrictHostKeyChecking yes" in th.ssh_config.read_text()
    assert json.loads(th.state_file.read_text())["phase"] == "up"
    data = tomllib.loads(th.cluster_toml(epochs=1, command=["true"]))
    assert [h["address"] for h in data["hosts"]] == th.addresses
    assert data["training"] == {"epochs": 1, "command": ["true"]}


@needs_root
@pytest.mark.parametrize("i", [0, 1])
def test_ssh_binary_sees_own_address(th, i):
    r = ssh(th, i, "hostname -I; ip -4 -o addr show")
    assert r.returncode == 0, r.stderr
    assert th.hosts[i].address in r.stdout.split()[0]
    assert th.hosts[1 - i].address not in r.stdout
    assert set(th.pids(i)), "sshd must run inside the host's namespace"


FABRIC_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import paramiko
    from fabric import Connection
    t0 = time.perf_counter()
    c = Connection(sys.argv[1])                  # default fabric.Config: reads ~/.ssh/config
    # fabric itself never checks host keys (AutoAddPolicy, nothing loaded): turn it on.
    c.client.load_host_keys(c.ssh_config["userknownhostsfile"])
    c.client.set_missing_host_key_policy(paramiko.RejectPolicy())
    out = c.run("ip -4 -o addr show dev eth0", hide=True, in_stream=False).stdout
    t1 = time.perf_counter()
    c.run("true", hide=True, in_stream=False)
    t2 = time.perf_counter()
    print(json.dumps({"user": c.user, "ssh_config": c.ssh_config, "out": out,
                      "first": t1 - t0, "second": t2 - t1}))
""")


@needs_root
def test_fabric_with_private_home_in_subprocess(th):
    for h in th.hosts:
        r = subprocess.run([sys.executable, "-c", FABRIC_SCRIPT, h.address], env=th.env(),
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got["user"] == "root"
        assert got["ssh_config"]["identityfile"] == [str(th.identity_file)]
        assert got["ssh_config"]["userknownhostsfile"] == str(th.known_hosts)
        assert f"inet {h.address}/24" in got["out"]
        print(f"\nfabric {h.address}: first command {got['first']:.3f}s, next {got['second']:.3f}s")


@needs_root
def test_fabric_in_process_with_explicit_config(th):
    import paramiko
    from fabric import Config, Connection

    config = Config(runtime_ssh_path=str(th.ssh_config))  # replaces system and user files
    with Connection(th.hosts[1].address, config=config) as c:
        c.client.load_host_keys(str(th.known_hosts))
        c.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        assert th.hosts[1].address in c.run("hostname -I", hide=True, in_stream=False).stdout


@needs_root
def test_unknown_or_wrong_host_key_is_refused(th, tmp_path):
    import paramiko
    from fabric import Config, Connection

    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    wrong = tmp_path / "wrong_known_hosts"  # host 0's address with host 1's key
    line = next(x for x in th.known_hosts.read_text().splitlines() if x.startswith(th.hosts[1].address + " "))
    wrong.write_text(line.replace(th.hosts[1].address, th.hosts[0].address, 1) + "\n")

    for kh, message in ((empty, "Host key verification failed"), (wrong, "IDENTIFICATION HAS CHANGED")):
        r = subprocess.run(["ssh", "-F", str(th.ssh_config), "-o", f"UserKnownHostsFile={kh}",
                            th.hosts[0].address, "true"], capture_output=True, text=True, timeout=20)
        assert r.returncode == 255 and message in r.stderr, r.stderr

    config = Config(runtime_ssh_path=str(th.ssh_config))
    for kh, error in ((empty, paramiko.SSHException), (wrong, paramiko.BadHostKeyException)):
        c = Connection(th.hosts[0].address, config=config)
        c.client.load_host_keys(str(kh))
        c.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        with pytest.raises(error):
            c.run("true", hide=True, in_stream=False)
        c.close()


@needs_root
def test_sshd_takes_many_connections_and_sessions(th):
    import paramiko

    address = th.hosts[0].address
    # 16 connections at once, none authenticated yet: sshd's default MaxStartups (10) would drop some.
    socks = [socket.create_connection((address, 22), timeout=5) for _ in range(16)]
    try:
        assert all(s.recv(64).startswith(b"SSH-2.0-") for s in socks)
    finally:
        for s in socks:
            s.close()
    # 12 sessions on one connection at once: sshd's default MaxSessions (10) would refuse two.
    client = paramiko.SSHClient()
    client.load_host_keys(str(th.known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(address, username="root", key_filename=str(th.identity_file),
                   look_for_keys=False, allow_agent=False, timeout=5)
    try:
        channels = [client.get_transport().open_session() for _ in range(12)]
        for ch in channels:
            ch.exec_command("sleep 0.2; echo ok")
        assert [ch.makefile().read().strip() for ch in channels] == [b"ok"] * 12
    finally:
        client.close()


SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket()
    s.bind(("", 20000))          # all addresses: on one shared stack the second bind would fail
    s.listen()
    print("ready", flush=True)
    for _ in range(2):
        conn, peer = s.accept()
        conn.sendall((sys.argv[1] + " " + peer[0]).encode())
        conn.close()
""")

CLIENT = textwrap.dedent("""
    import socket, sys
    with socket.create_connection((sys.argv[1], 20000), timeout=5) as s:
        print(s.recv(100).decode())
""")


@needs_root
def test_two_hosts_bind_the_same_port_and_reach_each_other(th):
    servers = [subprocess.Popen(th.netns_argv(i, sys.executable, "-c", SERVER, h.netns),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i, h in enumerate(th.hosts)]
    try:
        for s in servers:
            assert s.stdout.readline().strip() == "ready", s.stderr.read()
        for i, h in enumerate(th.hosts):  # host i -> the other host
            other = th.hosts[1 - i]
            r = subprocess.run(th.netns_argv(i, sys.executable, "-c", CLIENT, other.address),
                               capture_output=True, text=True, timeout=20)
            assert r.stdout.split() == [other.netns, h.address], r.stderr
        for h in th.hosts:  # control machine -> each host, through the bridge
            with socket.create_connection((h.address, 20000), timeout=5) as s:
                assert s.recv(100).decode().split() == [h.netns, th.bridge_address]
        for s in servers:
            assert s.wait(timeout=10) == 0
    finally:
        for s in servers:
            s.kill()
            s.communicate()  # reaps it and closes its pipes


@needs_root
def test_crash_kills_every_process_of_the_host(fresh):
    r = ssh(fresh, 1, "nohup sleep 300 >/dev/null 2>&1 & echo $!")
    assert r.returncode == 0, r.stderr
    sleeper = int(r.stdout.strip())
    assert sleeper in fresh.pids(1) and alive(sleeper)
    before0 = fresh.pids(0)

    killed = fresh.crash(1)
    assert sleeper in killed
    assert not alive(sleeper)
    assert fresh.pids(1) == []
    assert ssh(fresh, 1, "true").returncode == 255  # nobody listens any more
    assert fresh.pids(0) == before0 and ssh(fresh, 0, "true").returncode == 0

    fresh.revive(1)
    assert ssh(fresh, 1, "true").returncode == 0


@needs_root
def test_cut_and_restore(fresh):
    address = fresh.hosts[1].address
    fresh.cut(1)
    with pytest.raises(OSError):  # packets are dropped: a timeout, not a refusal
        socket.create_connection((address, 22), timeout=0.5).close()
    assert ssh(fresh, 0, "true").returncode == 0
    fresh.restore(1)
    assert ssh(fresh, 1, "true").returncode == 0


@needs_root
def test_down_removes_everything_and_is_idempotent(tmp_path):
    hosts = TestHosts(2, tmp_path)
    hosts.up()
    sleeper = subprocess.Popen(hosts.netns_argv(0, "sleep", "300"))
    names = [h.netns for h in hosts.hosts] + [h.veth for h in hosts.hosts] + [hosts.bridge]
    sshd_pids = [pid for i in range(2) for pid in hosts.pids(i)]
    hosts.down()
    assert sleeper.wait(timeout=5) == -9
    assert hosts.leftovers() == []
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    listing += subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert not [n for n in names if n in listing]
    assert not [p for p in sshd_pids if alive(p)]
    hosts.down()  # again: nothing to do, no error
    assert hosts.leftovers() == []


@needs_root
def test_failed_up_leaves_nothing(tmp_path):
    hosts = TestHosts(2, tmp_path, sshd="/bin/false")
    with pytest.raises(TestHostsError, match="exited"):
        hosts.up()
    assert hosts.leftovers() == []


@needs_root
def test_cli_up_env_down_beside_another_instance(th, tmp_path):
    state = tmp_path / "cli"
    cli = [sys.executable, str(REPO / "deploy" / "testhosts.py")]
    r = subprocess.run(cli + ["up", "2", "--state", str(state)], capture_output=True, text=True, timeout=60)
    try:
        assert r.returncode == 0, r.stderr
        data = tomllib.loads(r.stdout)
        assert len(data["hosts"]) == 2 and {h["port"] for h in data["hosts"]} == {20000}
        assert data["training"]["command"] == ["python3", "-c", "print('hello')"]
        saved = json.loads((state / "hosts.json").read_text())
        assert saved["subnet"] != th.subnet and saved["prefix"] != th.prefix
        assert [h["address"] for h in data["hosts"]] == [h["address"] for h in saved["hosts"]]

        env = subprocess.run(cli + ["env", "--state", str(state)], capture_output=True, text=True)
        assert f"export HOME={state / 'home'}" in env.stdout.splitlines()

        loaded = TestHosts.load(state)
        assert ssh(loaded, 1, "hostname -I").stdout.split() == [saved["hosts"][1]["address"]]
        assert ssh(th, 0, "true").returncode == 0  # the other instance is untouched
    finally:
        d = subprocess.run(cli + ["down", "--state", str(state)], capture_output=True, text=True, timeout=60)
    assert d.returncode == 0, d.stderr
    assert TestHosts.load(state).leftovers() == []
