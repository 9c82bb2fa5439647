"""The cluster check of the preflight: every host listens on its tasks' ports and reaches every peer's
port, as TensorFlow's gRPC will (no TensorFlow import)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, TypedDict

Peer = list[Any]  # Any: a task of --mesh's JSON (the launcher's), [index, address, port, group]


def _connect_reason(exc: OSError) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens there, or a firewall rejects it)"
    if isinstance(exc, socket.timeout):
        return "timed out (a firewall drops it, or the address leads nowhere)"
    return exc.strerror or str(exc) or type(exc).__name__


FOREIGN = "something else answers on that address and port (not this check's listener)"
ANSWER_S = 2.0


class MeshTask(TypedDict):
    """What the check found for one of this host's tasks: {j: {"address", "reason"}} for each peer unreached."""
    listen_error: str | None
    unreached: dict[str, dict[str, str]]


class _Mesh:
    """One host's part of the check: its listeners, its reachers, what each heard, and the deadline that
    moves on while anything progresses."""

    def __init__(self, mine: dict[int, int], group: int, peers: list[Peer], token: str, seconds: float) -> None:
        self.mine, self.group, self.peers, self.token, self.seconds = mine, group, peers, token, seconds
        self.start = time.monotonic()
        self.until = self.start + seconds
        self.lock = threading.Lock()
        self.heard: dict[int, set[int]] = {i: set() for i in mine}
        self.expect = {i: {g for j, _a, _p, g in peers if j != i} for i in mine}  # the groups that connect to i
        self.failed: dict[int, str] = {}
        self.listen_errors: dict[int, str] = {}
        self.servers: list[socket.socket] = []

    def progress(self) -> None:  # under the lock
        self.until = min(self.start + 4 * self.seconds, time.monotonic() + self.seconds)

    def left(self) -> float:
        return self.until - time.monotonic()

    def serve_one(self, i: int, conn: socket.socket) -> None:
        """Hello '<token> <group>' in, '<token> ok' out; the peer closes first (no TIME_WAIT here)."""
        try:
            conn.settimeout(max(0.5, self.left()))
            data = b""
            while not data.endswith(b"\n") and len(data) < 200:
                chunk = conn.recv(200)
                if not chunk:
                    return
                data += chunk
            words = data.decode("ascii", "replace").split()
            if len(words) == 2 and words[0] == self.token and words[1].isdigit():
                conn.sendall(f"{self.token} ok\n".encode())
                with self.lock:
                    self.heard[i].add(int(words[1]))
                    self.progress()
                while conn.recv(200):
                    pass
        except OSError:
            pass
        finally:
            conn.close()

    def accept(self, i: int, server: socket.socket) -> None:
        while True:
            try:
                conn, _addr = server.accept()
            except OSError:
                return
            threading.Thread(target=self.serve_one, args=(i, conn), daemon=True).start()

    def listen(self) -> None:
        dual = socket.has_dualstack_ipv6()
        for i, port in self.mine.items():
            try:  # all addresses, like TensorFlow's gRPC server (IPv6 too where the host has it)
                server = socket.create_server(("", port), family=socket.AF_INET6 if dual else socket.AF_INET,
                                              backlog=128, dualstack_ipv6=dual)
            except OSError as exc:
                self.listen_errors[i] = self.failed[i] = exc.strerror or str(exc)
                self.expect[i] = set()
                continue
            self.servers.append(server)
            threading.Thread(target=self.accept, args=(i, server), daemon=True).start()

    def reach(self, j: int, host: str, port: int) -> None:
        """Connect to j until its listener answers (each peer on its own thread: one that times out
        does not hold up the others); not up yet or not reachable: tried again, less and less often."""
        pause, reason = 0.1, "not tried before the deadline"
        while self.left() > 0:
            try:
                c = socket.create_connection((host.strip("[]"), port), timeout=max(0.2, min(2.0, self.left())))
            except OSError as exc:
                reason = _connect_reason(exc)
                time.sleep(min(pause, max(0.0, self.left())))
                pause = min(1.0, pause * 1.5)
                continue
            with c:  # our listeners answer at once: anything else is a holder of that port
                try:
                    c.settimeout(ANSWER_S)
                    c.sendall(f"{self.token} {self.group}\n".encode())
                    answer = c.makefile("rb").readline(200).decode("ascii", "replace").split()
                except OSError:
                    answer = []
            with self.lock:
                self.progress()
            if answer == [self.token, "ok"]:
                return
            reason = FOREIGN
            break
        with self.lock:
            self.failed[j] = reason

    def reach_all(self) -> None:
        reachers = [threading.Thread(target=self.reach, args=(j, address, port), daemon=True)
                    for j, address, port, _g in self.peers
                    if j not in self.failed and any(i != j for i in self.mine)]
        for t in reachers:
            t.start()
        for t in reachers:
            t.join()

    def close(self) -> None:
        """Stay up until every peer reached us (or the deadline), then stop listening."""
        while self.servers and self.left() > 0:
            with self.lock:
                if all(self.heard[i] >= self.expect[i] for i in self.mine):
                    break
            time.sleep(0.02)
        for server in self.servers:  # shutdown() wakes a thread blocked in accept(); close() alone leaves it listening
            try:
                server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            server.close()
        time.sleep(0.05)  # let the last answers go out before the process ends

    def result(self) -> dict[str, MeshTask]:
        where = {j: f"{address}:{port}" for j, address, port, _g in self.peers}
        return {str(i): {"listen_error": self.listen_errors.get(i),
                         "unreached": {str(j): {"address": where[j], "reason": why}
                                       for j, why in sorted(self.failed.items()) if j != i}}
                for i in self.mine}


def mesh(mine: dict[int, int], group: int, peers: list[Peer], token: str, seconds: float) -> dict[str, MeshTask]:
    """Listen on this host's ports (`mine`: index -> port) and reach every port of `peers`
    ([index, address, port, group] for the whole cluster) that one of this host's tasks talks to.

    Done when every target answered and every listener heard from every group that talks to it, or
    after `seconds` with no progress (hosts start their checks at different times), 4 x `seconds` at
    most. Per task of this host: {"listen_error", "unreached": {j: {"address", "reason"}}}."""
    check = _Mesh(mine, group, peers, token, seconds)
    check.listen()
    check.reach_all()
    check.close()
    return check.result()
