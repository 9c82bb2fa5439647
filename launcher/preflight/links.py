"""Links between the hosts, measured before the first step: a round-robin schedule of pairs (worker.preflight.links on
both ends, on the address and port the collective will use), the verdict on which links are slow, and how
both are told."""

from __future__ import annotations

import dataclasses
import json
import secrets
import statistics
import time
from typing import Any, Callable, TypedDict

from launcher.engines.base import parallel
from launcher.engines.supervised.transport import LocalTransport, Transport
from launcher.plan import TaskPlan
from worker.host.spawn import module_argv
from worker.task.lines import printable

SLOW_FACTOR = 4.0  # a link this many times below the reference is slow
STREAM_S = 0.25  # each direction streams this long at most...
LIMIT_MB = 128  # ...or this many MB
WAIT_S = 10.0  # for the peer's listener, or its connection
Step = list[str | int]  # one round of a host's part, as worker.preflight.links reads it: ["serve", a] or ["probe", ...]
Measured = dict[str, Any]  # Any: what a host's worker.preflight.links found in one round (its JSON), read by _number


@dataclasses.dataclass(frozen=True)
class Machine:
    """A distinct machine of the cluster, probed on its first task's address and port."""
    label: str
    address: str
    port: int
    plan: TaskPlan = dataclasses.field(repr=False, compare=False)
    transport: Transport = dataclasses.field(repr=False, compare=False)


class LinkJson(TypedDict):
    a: str
    b: str
    a_to_b_mbps: float | None
    b_to_a_mbps: float | None
    mbps: float | None
    rtt_ms: float | None
    error: str | None


class LinkReportJson(TypedDict):
    hosts: list[str]
    links: list[LinkJson]
    reference_mbps: float | None
    factor: float
    slow: list[str]
    seconds: float


@dataclasses.dataclass(frozen=True)
class Link:
    a: str
    b: str
    a_to_b_mbps: float | None = None
    b_to_a_mbps: float | None = None
    rtt_ms: float | None = None
    error: str | None = None

    @property
    def mbps(self) -> float | None:
        """The link's bandwidth: its slower direction."""
        if self.a_to_b_mbps is None or self.b_to_a_mbps is None:
            return None
        return min(self.a_to_b_mbps, self.b_to_a_mbps)

    @property
    def pair(self) -> str:
        return f"{self.a} <-> {self.b}"

    def to_json(self) -> LinkJson:
        return {"a": self.a, "b": self.b, "a_to_b_mbps": _round(self.a_to_b_mbps),
                "b_to_a_mbps": _round(self.b_to_a_mbps), "mbps": _round(self.mbps),
                "rtt_ms": _round(self.rtt_ms, 3), "error": self.error}


@dataclasses.dataclass(frozen=True)
class Verdict:
    reference_mbps: float | None  # the median over hosts of each host's median link
    slow: tuple[Link, ...]  # slowest first


@dataclasses.dataclass(frozen=True)
class LinkReport:
    hosts: tuple[str, ...]
    links: tuple[Link, ...]
    verdict: Verdict
    seconds: float

    def to_json(self) -> LinkReportJson:
        return {"hosts": list(self.hosts), "links": [link.to_json() for link in self.links],
                "reference_mbps": _round(self.verdict.reference_mbps), "factor": SLOW_FACTOR,
                "slow": [link.pair for link in self.verdict.slow], "seconds": round(self.seconds, 3)}


def _round(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)


# --------------------------------------------------------------------------- the verdict (pure)

def verdict(links: list[Link], factor: float = SLOW_FACTOR) -> Verdict:
    """Slow links: `factor` times below the reference, the median over hosts of each host's median link. (Not
    the median of all links: with one slow host, most of a small cluster's links are its links.)"""
    measured = [(link, mbps) for link in links if (mbps := link.mbps) is not None]
    if len(measured) < 2:
        return Verdict(None, ())  # one link has nothing to be compared with
    of_host: dict[str, list[float]] = {}
    for link, mbps in measured:
        for host in (link.a, link.b):
            of_host.setdefault(host, []).append(mbps)
    reference = statistics.median(statistics.median(v) for v in of_host.values())
    slow = sorted(((link, mbps) for link, mbps in measured if mbps * factor < reference), key=lambda lm: lm[1])
    return Verdict(reference, tuple(link for link, _mbps in slow))


def slow_hosts(report: LinkReport) -> list[str]:
    """Hosts whose every measured link is slow (more than one): their own interface, not a link, is the cause."""
    slow = set(report.verdict.slow)
    return [h for h in report.hosts
            if len(mine := [x for x in report.links if h in (x.a, x.b) and x.mbps is not None]) > 1
            and all(x in slow for x in mine)]


def rounds(n: int) -> list[list[tuple[int, int]]]:
    """Every pair of n once, in rounds where no machine is in two pairs (the circle method)."""
    ids: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
    out: list[list[tuple[int, int]]] = []
    for _ in range(len(ids) - 1):
        half = len(ids) // 2
        out.append([(min(a, b), max(a, b)) for a, b in zip(ids[:half], reversed(ids[half:]))
                    if a is not None and b is not None])
        ids = [ids[0], ids[-1], *ids[1:-1]]
    return out


# --------------------------------------------------------------------------- the measurement

def machines(plans: list[TaskPlan], transports: list[Transport]) -> list[Machine]:
    """One per distinct host (two tasks on one host share no link), at its first task's address and port."""
    seen: dict[int, Machine] = {}
    for p, t in zip(plans, transports):
        if id(t) not in seen:
            seen[id(t)] = Machine(p.host.label, p.host.address, p.host.port, p, t)
    return list(seen.values())


def _call(m: Machine, argv: list[str], timeout: float) -> list[Measured]:
    """A host's part of the schedule: what it found per round, or raises with what went wrong."""
    plan = dataclasses.replace(m.plan, cwd=None)  # not the workdir: nothing of the user's is imported
    code, out, err = m.transport.call(plan, module_argv(plan.python, "worker.preflight.links") + argv, timeout)
    lines = out.strip().splitlines()
    try:
        found = json.loads(lines[-1]) if code == 0 and lines else None
    except ValueError:
        found = None
    if not isinstance(found, list) or not all(isinstance(f, dict) for f in found):
        raise RuntimeError(f"the link probe failed: {printable((err.strip().splitlines() or ['no output'])[-1])}")
    return found


def _number(doc: Measured, key: str) -> float | None:
    value = doc.get(key)
    return float(value) if isinstance(value, (int, float)) and value == value and value >= 0 else None


def steps(found: list[Machine], schedule: list[list[tuple[int, int]]]) -> list[list[Step]]:
    """Each host's rounds in order: in pair (a, b), b listens on its port and a connects to it."""
    out: list[list[Step]] = [[] for _ in found]
    for pairs in schedule:
        for a, b in pairs:
            out[b].append(["serve", a])
            out[a].append(["probe", b, found[b].address, found[b].port])
    return out


def measure(plans: list[TaskPlan], transports: list[Transport]) -> LinkReport | None:
    """Every pair of distinct hosts, one process per host running its rounds; None when there is no pair (one
    host, or only this machine)."""
    found = machines(plans, transports)
    if len(found) < 2 or all(isinstance(m.transport, LocalTransport) for m in found):
        return None
    t0 = time.monotonic()
    schedule = rounds(len(found))
    token = secrets.token_hex(8)
    common = ["--token", token, "--wait", f"{WAIT_S:g}", "--seconds", f"{STREAM_S:g}", "--limit-mb", f"{LIMIT_MB:g}"]
    timeout = len(schedule) * (WAIT_S + 2 * STREAM_S + 12) + 10
    mine = steps(found, schedule)
    done = parallel(lambda i: _call(found[i], ["--me", str(i), "--port", str(found[i].port), "--steps",
                                               json.dumps(mine[i], separators=(",", ":")), *common], timeout),
                    list(range(len(found))), len(found))
    said = {i: r.value if r.value is not None else printable(str(r.error)) for i, r in enumerate(done)}
    links: list[Link] = []
    for a, b in sorted(p for pairs in schedule for p in pairs):
        of_a, of_b = said[a], said[b]
        client = _of(of_a, b, "probe") if isinstance(of_a, list) else {"error": f"{found[a].label}: {of_a}"}
        server = _of(of_b, a, "serve") if isinstance(of_b, list) else {"error": f"{found[b].label}: {of_b}"}
        error = client.get("error") or server.get("error")
        links.append(Link(found[a].label, found[b].label, error=printable(str(error), 300)) if error else
                     Link(found[a].label, found[b].label, _number(client, "out_mbps"), _number(client, "back_mbps"),
                          _number(client, "rtt_ms")))
    return LinkReport(tuple(m.label for m in found), tuple(links), verdict(links), time.monotonic() - t0)


def _of(results: list[Measured], peer: int, role: str) -> Measured:
    return next((r for r in results if r.get("peer") == peer and r.get("role") == role), {"error": "not measured"})


# --------------------------------------------------------------------------- how it is told

def rate(mbps: float | None) -> str:
    if mbps is None:
        return "-"
    return f"{mbps / 1000:.1f} Gbit/s" if mbps >= 1000 else f"{mbps:.1f} Mbit/s"


def warning(report: LinkReport) -> str | None:
    """`up`'s one line, when a link is slow."""
    if not report.verdict.slow:
        return None
    worst, more, hosts = report.verdict.slow[0], len(report.verdict.slow) - 1, slow_hosts(report)
    reference, mbps = report.verdict.reference_mbps, worst.mbps
    assert reference is not None and mbps is not None  # a slow link: measured, and below the reference
    return (f"slow link {worst.pair}: {rate(worst.mbps)}, {reference / mbps:.0f}x below "
            f"a typical link ({rate(report.verdict.reference_mbps)})"
            + (f"; {more} more slow link(s), `mgpu-cluster check` lists them" if more else "")
            + (f"; every link of {', '.join(hosts)} is slow" if hosts else "")
            + "; the collective runs at the slowest link's pace")


def lines(report: LinkReport) -> list[str]:
    """`check`'s lines: every link, slowest first, then the verdict."""
    out = [f"links between {len(report.hosts)} hosts ({len(report.links)} pairs, measured in "
           f"{report.seconds:.1f} s; each way, rtt):"]
    ordered = sorted(report.links, key=lambda link: (link.mbps is not None, link.mbps or 0.0))
    for link in ordered:
        if link.error:
            out.append(f"  {link.pair}: not measured: {link.error}")
        else:
            out.append(f"  {link.pair}: {rate(link.a_to_b_mbps)} / {rate(link.b_to_a_mbps)}, "
                       f"rtt {link.rtt_ms or 0:.2f} ms" + ("  SLOW" if link in report.verdict.slow else ""))
    if report.verdict.slow:
        out.append(f"slowest links: {', '.join(link.pair for link in report.verdict.slow)} "
                   f"({SLOW_FACTOR:g}x or more below {rate(report.verdict.reference_mbps)}, a host's typical link)")
        for host in slow_hosts(report):
            out.append(f"every link of {host} is slow: look at that host's network interface first")
    elif report.verdict.reference_mbps is not None:
        out.append(f"no slow link (none {SLOW_FACTOR:g}x below {rate(report.verdict.reference_mbps)})")
    return out


def preflight_probe(plans: list[TaskPlan], transports: list[Transport], say: Callable[[str], None]) -> None:
    """`up`'s quick probe: one line when a link is slow, nothing otherwise."""
    report = measure(plans, transports)
    line = warning(report) if report else None
    if line:
        say(line)
