"""Links measured before the first step: the verdict and the schedule (pure), the host side over real sockets,
and `check` / `up` on namespace hosts with real sshds, one host's interface slowed with tc."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time

import pytest

from conftest import REPO, free_port, namespace_hosts, reap, wait_gone
from launcher.preflight.links import Link, rounds, verdict
from test_ssh import PY, SSHCli, write_spec

G, M = 10_000.0, 20.0  # a veth's Mbit/s here, and the tbf rate below


# --------------------------------------------------------------------------- pure

def test_verdict_names_every_link_of_a_slow_host_even_when_they_are_most_links():
    links = [Link("h0", "h1", M, M, 0.1), Link("h0", "h2", M, 2 * M, 0.1), Link("h1", "h2", G, G, 0.1)]
    v = verdict(links)
    assert v.reference_mbps == (G + M) / 2  # h1's median link (h2's is higher, h0's lower)
    assert [link.pair for link in v.slow] == ["h0 <-> h1", "h0 <-> h2"]  # slowest first


def test_verdict_names_one_slow_link_and_nothing_when_links_are_alike():
    hosts = [f"h{i}" for i in range(4)]
    even = [Link(a, b, G * (1 + 0.1 * i), G, 0.1) for i, (a, b) in enumerate(itertools.combinations(hosts, 2))]
    assert verdict(even).slow == ()
    one = [Link("h1", "h3", G, G / 5, 0.1) if (x.a, x.b) == ("h1", "h3") else x for x in even]
    assert [link.pair for link in verdict(one).slow] == ["h1 <-> h3"]
    assert verdict([Link("h1", "h3", G, G / 3.9, 0.1) if (x.a, x.b) == ("h1", "h3") else x for x in even]).slow == ()


def test_verdict_of_one_link_or_only_failures_says_nothing():
    assert verdict([Link("a", "b", M, M, 1.0)]).slow == ()
    v = verdict([Link("a", "b", error="refused"), Link("a", "c", error="refused"), Link("b", "c", G, G, 0.1)])
    assert v.slow == () and v.reference_mbps is None


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8])
def test_rounds_pair_every_host_once_and_no_host_twice_in_a_round(n):
    schedule = rounds(n)
    pairs = [p for r in schedule for p in r]
    assert sorted(pairs) == list(itertools.combinations(range(n), 2))
    assert len(schedule) == (n if n % 2 else n - 1)
    for r in schedule:
        hosts = [h for p in r for h in p]
        assert len(hosts) == len(set(hosts))


# --------------------------------------------------------------------------- the host side, real sockets

def links_cmd(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "worker.preflight.links", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_two_hosts_sides_measure_both_ways_and_a_wrong_peer_is_not_measured():
    p0, p1 = free_port(), free_port()
    common = ["--token", "right", "--wait", "3", "--seconds", "0.2"]
    t0 = time.monotonic()
    server = links_cmd("--me", "1", "--port", str(p1), "--steps", '[["serve", 0]]', *common)
    client = links_cmd("--me", "0", "--port", str(p0), "--steps", f'[["probe", 1, "127.0.0.1", {p1}]]', *common)
    found = json.loads(client.communicate(timeout=30)[0])
    took = time.monotonic() - t0
    assert json.loads(server.communicate(timeout=30)[0]) == [{"peer": 0, "role": "serve"}]
    [f] = found
    assert f["out_mbps"] > 100 and f["back_mbps"] > 100 and 0 < f["rtt_ms"] < 50, found
    assert took < 4, took
    server = links_cmd("--me", "1", "--port", str(p1), "--steps", '[["serve", 0]]', *common)
    other = links_cmd("--me", "2", "--port", str(p0), "--steps", f'[["probe", 1, "127.0.0.1", {p1}]]',
                      "--token", "right", "--wait", "1")  # the listener waits for host 0, not 2
    assert "error" in json.loads(other.communicate(timeout=30)[0])[0]
    assert json.loads(server.communicate(timeout=30)[0]) == [
        {"peer": 0, "role": "serve", "error": "no peer connected within 3 s"}]


# --------------------------------------------------------------------------- namespace hosts, real sshd

@pytest.fixture(scope="module")
def th(tmp_path_factory):
    yield from namespace_hosts(3, tmp_path_factory.mktemp("linkhosts"))


@pytest.fixture
def cli(tmp_path, th):
    c = SSHCli(tmp_path / "mgpu-home", tmp_path, th)
    yield c
    left = reap(wait_gone(tmp_path, 30))
    assert not left, f"processes left on the hosts: {[(p.pid, p.info['cmdline']) for p in left]}"


@pytest.fixture
def slowed(th):
    """h0's veth limited to 20 Mbit/s (traffic to h0): both of its links are slow, h1 <-> h2 is not."""
    veth = th.hosts[0].veth
    subprocess.run(["tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", "20mbit", "burst", "32kbit",
                    "latency", "400ms"], check=True)
    try:
        yield th.addresses[0]
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", veth, "root"], check=False)


def test_check_names_the_slowed_links_and_up_warns_of_them(cli, th, tmp_path, slowed):
    a = th.addresses
    spec = write_spec(tmp_path, a, {"command": [PY, "-c", "pass"]})
    t0 = time.monotonic()
    r = cli("check", spec, timeout=120)
    took = time.monotonic() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert f"slowest links: {a[0]} <-> {a[1]}, {a[0]} <-> {a[2]}" in out or \
        f"slowest links: {a[0]} <-> {a[2]}, {a[0]} <-> {a[1]}" in out, out
    assert f"{a[1]} <-> {a[2]}" in out and "links between 3 hosts (3 pairs" in out
    assert f"every link of {a[0]} is slow" in out and f"every link of {a[1]}" not in out
    print(f"check with links: {took:.1f} s\n{out}")

    r = cli("check", spec, "--json", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    matrix = {(x["a"], x["b"]): x for x in doc["links"]["links"]}
    assert set(matrix) == {(a[0], a[1]), (a[0], a[2]), (a[1], a[2])} and doc["ok"] is True
    assert sorted(doc["links"]["slow"]) == sorted([f"{a[0]} <-> {a[1]}", f"{a[0]} <-> {a[2]}"])
    for pair in [(a[0], a[1]), (a[0], a[2])]:  # traffic into h0 is shaped: b -> a
        assert matrix[pair]["b_to_a_mbps"] < 30 and matrix[pair]["mbps"] < 30, matrix
    assert matrix[(a[1], a[2])]["mbps"] > 200 and matrix[(a[1], a[2])]["rtt_ms"] < 20, matrix

    r = cli("up", spec, timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    warned = [line for line in out.splitlines() if "slow link" in line]
    assert len(warned) == 1 and a[0] in warned[0] and "more slow link(s)" in warned[0], out
    assert out.index("slow link") < out.index("starting 3 task(s)")
    print(out)


def test_healthy_links_say_nothing_in_up_and_no_slow_link_in_check(cli, th, tmp_path):
    spec = write_spec(tmp_path, th.addresses, {"command": [PY, "-c", "pass"]})
    r = cli("check", spec, timeout=120)
    assert r.returncode == 0 and "no slow link" in r.stdout + r.stderr, r.stdout + r.stderr
    r = cli("up", spec, timeout=180)
    assert r.returncode == 0 and "slow link" not in r.stdout + r.stderr, r.stdout + r.stderr


def test_tasks_on_one_host_have_no_link_to_measure(cli, tmp_path):
    spec = write_spec(tmp_path, ["localhost", "localhost"], {"command": [PY, "-c", "pass"]},
                      hosts=[{"port": free_port()}, {"port": free_port()}])
    r = cli("check", spec, "--json", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["links"] is None and "links between" not in r.stderr
