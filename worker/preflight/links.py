"""The link probe's host side (stdlib only): one process per host runs its part of the round-robin schedule,
in order: listen on its task's port for one peer, or connect to one and measure the round trip and the
bandwidth each way. Pairs pace each other (a peer busy in an earlier round is not listening yet)."""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import sys
import threading
import time
from typing import Any, Mapping

CHUNK = 64 * 1024
PINGS = 5
REPORT = struct.Struct("!dd")  # bytes received, seconds
Step = list[Any]  # Any: a round of --steps' JSON (the launcher's), each field converted where it is used


def abort(sock: socket.socket) -> None:
    """Close with a reset: no TIME_WAIT on the task's port, and unsent data is dropped at once."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def receive(sock: socket.socket, seconds: float, limit: int) -> tuple[int, float]:
    """Bytes read and the seconds they took, timed from the first byte, for `seconds` or `limit` bytes."""
    first = sock.recv(CHUNK)
    if not first:
        raise ConnectionError("the peer closed before sending")
    t0, got = time.monotonic(), 0
    while got < limit and time.monotonic() - t0 < seconds:
        data = sock.recv(CHUNK)
        if not data:
            break
        got += len(data)
    return got, time.monotonic() - t0


def send_until(sock: socket.socket, stop: float) -> None:
    """Stream zeros until the peer stops us (its report, a reset) or the deadline."""
    block = bytes(CHUNK)
    sock.settimeout(0.5)
    while time.monotonic() < stop:
        try:
            sock.sendall(block)
        except socket.timeout:
            continue
        except OSError:
            return


def drain(sock: socket.socket, until: float) -> None:
    try:
        while time.monotonic() < until and sock.recv(CHUNK):
            pass
    except OSError:
        pass


def exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the peer closed")
        data += chunk
    return data


# --------------------------------------------------------------------------- the listening side

def serve(port: int, token: str, peer: int, wait: float, seconds: float, limit: int) -> dict[str, str] | None:
    """Two sessions of `peer`: 'u' (it sends, we time it and report), then 'd' (we send until it resets).
    None when done; else {"error"} (the peer, which measures, says more)."""
    dual = socket.has_dualstack_ipv6()
    try:  # all addresses, as TensorFlow's gRPC server listens
        server = socket.create_server(("", port), family=socket.AF_INET6 if dual else socket.AF_INET,
                                      dualstack_ipv6=dual)
    except OSError as exc:
        return {"error": f"cannot listen on port {port}: {exc.strerror or exc}"}
    done: set[str] = set()
    until, hello = time.monotonic() + wait, f"{token} {peer} ".encode()
    with server:
        while done != {"u", "d"}:
            server.settimeout(max(0.01, until - time.monotonic()))
            try:
                conn, _ = server.accept()
            except socket.timeout:
                return {"error": f"no peer connected within {wait:g} s"}
            conn.settimeout(seconds + 5)
            mode = ""
            try:
                said = exact(conn, len(hello) + 1)
                if said[:-1] != hello:  # another probe's peer, early for a later round: it tries again
                    continue
                mode = chr(said[-1])
                conn.sendall(b"k")
                if mode == "u":
                    for _ in range(PINGS):  # echo the round-trip pings
                        conn.sendall(exact(conn, 1))
                    got, took = receive(conn, seconds, limit)
                    conn.sendall(REPORT.pack(got, took))
                    drain(conn, time.monotonic() + 5)  # until the peer, which has its report, resets
                elif mode == "d":
                    send_until(conn, time.monotonic() + seconds + 5)
                done.add(mode)
            except OSError:
                done.add(mode)
            finally:
                abort(conn)
    return None


# --------------------------------------------------------------------------- the connecting side

def session(address: str, port: int, hello: bytes, until: float, seconds: float) -> socket.socket:
    """A connection the peer accepted ('k'): tried again while it is not listening yet, or is still
    listening for an earlier round's peer."""
    pause = 0.02
    while True:
        try:
            sock = socket.create_connection((address.strip("[]"), port),
                                            timeout=max(0.2, min(2.0, until - time.monotonic())))
            try:
                sock.settimeout(seconds + 5)
                sock.sendall(hello)
                exact(sock, 1)
                return sock
            except OSError:
                abort(sock)
                raise
        except OSError:
            if time.monotonic() + pause > until:
                raise
            time.sleep(pause)
            pause = min(0.1, pause * 1.5)


def probe(me: int, address: str, port: int, token: str, wait: float, seconds: float,
          limit: int) -> dict[str, str | float]:
    """{"rtt_ms", "out_mbps" (to the peer), "back_mbps" (from it)}, or {"error"}."""
    until = time.monotonic() + wait
    hello = f"{token} {me} ".encode()
    try:
        up = session(address, port, hello + b"u", until, seconds)
        try:
            rtts: list[float] = []
            for _ in range(PINGS):
                t0 = time.monotonic()
                up.sendall(b"p")
                exact(up, 1)
                rtts.append(time.monotonic() - t0)
            up.settimeout(None)
            report: list[bytes] = []
            reader = threading.Thread(target=lambda: report.append(exact(up, REPORT.size)), daemon=True)
            reader.start()
            stop = time.monotonic() + seconds + 5
            block = bytes(CHUNK)
            up.settimeout(0.2)
            while reader.is_alive() and time.monotonic() < stop:
                try:
                    up.sendall(block)
                except socket.timeout:
                    continue
            reader.join(1.0)
            if not report:
                raise ConnectionError("the peer sent no report")
            got, took = REPORT.unpack(report[0])
        finally:
            abort(up)
        down = session(address, port, hello + b"d", until, seconds)
        try:
            back, back_took = receive(down, seconds, limit)
        finally:
            abort(down)
    except OSError as exc:
        return {"error": f"{address}:{port}: {exc.strerror or exc or type(exc).__name__}"}
    return {"rtt_ms": statistics.median(rtts) * 1000, "out_mbps": mbps(got, took),
            "back_mbps": mbps(back, back_took)}


def mbps(n: float, seconds: float) -> float:
    return n * 8 / 1e6 / max(seconds, 1e-6)


def run(me: int, port: int, token: str, steps: list[Step], wait: float, seconds: float,
        limit: int) -> list[dict[str, str | float]]:
    """This host's rounds in order: ["serve", peer] or ["probe", peer, address, port]; what each found."""
    found: list[dict[str, str | float]] = []
    for step in steps:
        result: Mapping[str, str | float] | None
        if step[0] == "serve":
            result = serve(port, token, int(step[1]), wait, seconds, limit)
        else:
            result = probe(me, str(step[2]), int(step[3]), token, wait, seconds, limit)
        found.append({"peer": int(step[1]), "role": step[0], **(result or {})})
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.preflight.links", description=__doc__)
    parser.add_argument("--me", type=int, required=True, help="this host's number in the schedule")
    parser.add_argument("--port", type=int, required=True, help="where this host listens (its task's port)")
    parser.add_argument("--steps", type=json.loads, required=True,
                        help='JSON: [["serve", peer] | ["probe", peer, address, port], ...], one per round')
    parser.add_argument("--token", required=True, help="this probe's secret: anything else on the port is ignored")
    parser.add_argument("--wait", type=float, default=10.0, help="give up on a peer not there after this")
    parser.add_argument("--seconds", type=float, default=0.25, help="each direction streams this long at most")
    parser.add_argument("--limit-mb", type=float, default=128.0, help="... or this many MB, whichever first")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.me, args.port, args.token, args.steps, args.wait, args.seconds,
                         int(args.limit_mb * 1e6))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
