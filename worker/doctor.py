"""Checks one host for the launcher's preflight and prints them as JSON (no TensorFlow import).

    python -m worker.doctor --port 20000 [--port ...] [--entrypoint mod:fn | --program prog]
                            [--gpus 0,1] [--writable DIR ...]

Cluster check (every worker must reach every other worker's port), run on all hosts at once:

    python -m worker.doctor --listen 20000 --token T --index I --peer J=ADDR:PORT ... [--seconds S]

listens on the port for S seconds at most, connects to every peer's port (the peers run the same
at the same time), and prints which peers it reached and which reached it. Only a listener that
answers with the same token counts, so an unrelated service on the port does not pass.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import time


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def port_holder(port: int) -> dict | None:
    """Who listens on `port` (any address), or None when it is free."""
    import psutil  # here: the cluster check (mesh) starts faster without it

    try:
        conns = psutil.net_connections(kind="inet")
    except psutil.AccessDenied:
        conns = []
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            holder = {"pid": c.pid, "name": None, "cmdline": None}
            try:
                p = psutil.Process(c.pid)
                holder.update(name=p.name(), cmdline=" ".join(p.cmdline()))
            except (psutil.Error, TypeError):
                pass
            return holder
    with socket.socket() as s:  # not listed (e.g. no permission to see it): try to bind
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as exc:
            return {"pid": None, "name": None, "cmdline": f"bind failed: {exc.strerror}"}
    return None


def entrypoint_problem(entrypoint: str) -> str | None:
    """Whether module:function can be found, without importing the module (no TensorFlow)."""
    module, _, func = entrypoint.partition(":")
    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        return f"module {module!r} cannot be found: {exc}"
    if spec is None:
        return f"module {module!r} cannot be found from {os.getcwd()} with {sys.executable}"
    if not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        tree = ast.parse(open(spec.origin, encoding="utf-8").read())
    except (OSError, SyntaxError) as exc:
        return f"module {module!r} ({spec.origin}) cannot be parsed: {exc}"
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    names |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    if func not in names:
        return f"module {module!r} ({spec.origin}) defines no {func!r}"
    return None


def gpu_problem(wanted: list[int]) -> str | None:
    if not shutil.which("nvidia-smi"):
        return f"GPUs {wanted} are named but this host has no nvidia-smi"
    out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20)
    have = {int(x) for x in out.stdout.split() if x.strip().isdigit()}
    missing = sorted(set(wanted) - have)
    return f"GPUs {missing} do not exist here (this host has {sorted(have)})" if missing else None


def writable_problem(path: str) -> str | None:
    """Whether `path` can be made and written, checked on its nearest existing folder (creates nothing)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{path} cannot be made: {existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{path} is not writable: {existing} does not allow it for this user"
    return None


def doctor(ports, entrypoint=None, program=None, gpus=None, writable=()) -> dict:
    problems = []
    holders = {}
    for port in ports:
        holder = port_holder(port)
        if holder:
            holders[str(port)] = holder
            who = f"pid {holder['pid']} ({holder['name']}: {holder['cmdline']})" if holder["pid"] else holder["cmdline"]
            problems.append(f"port {port} is in use by {who}")
    if entrypoint:
        problems.append(entrypoint_problem(entrypoint))
    if program and not (shutil.which(program) or os.path.isfile(program)):
        problems.append(f"program {program!r} is not found on PATH ({os.environ.get('PATH', '')})")
    if gpus:
        problems.append(gpu_problem(gpus))
    problems += [writable_problem(p) for p in writable]
    return {
        "hostname": socket.gethostname(),
        "python": sys.executable,
        "versions": {"python": platform.python_version(), "tensorflow": version("tensorflow"),
                     "tf-keras": version("tf-keras")},
        "holders": holders,
        "problems": [p for p in problems if p],
    }


def _connect_reason(exc: OSError) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens there, or a firewall rejects it)"
    if isinstance(exc, socket.timeout):
        return "timed out (a firewall drops it, or the address leads nowhere)"
    return exc.strerror or str(exc) or type(exc).__name__


def mesh(port: int, token: str, index: int, peers: dict[int, str], seconds: float) -> dict:
    """Listen on `port` and reach every peer's listener; done when all are reached both ways."""
    deadline = time.monotonic() + seconds
    heard: set[int] = set()
    lock = threading.Lock()
    result = {"index": index, "port": port, "listen_error": None, "reached": [], "unreached": {},
              "heard_from": []}
    try:  # all addresses, like TensorFlow's gRPC server (IPv6 too where the host has it)
        dual = socket.has_dualstack_ipv6()
        server = socket.create_server(("", port), family=socket.AF_INET6 if dual else socket.AF_INET,
                                      backlog=64, reuse_port=False, dualstack_ipv6=dual)
    except OSError as exc:
        result["listen_error"] = exc.strerror or str(exc)
        server = None

    def serve_one(conn: socket.socket) -> None:
        """Hello '<token> <peer index>' in, '<token> ok' out; the peer closes first (no TIME_WAIT here)."""
        try:
            conn.settimeout(max(0.5, deadline - time.monotonic()))
            data = b""
            while not data.endswith(b"\n") and len(data) < 200:
                chunk = conn.recv(200)
                if not chunk:
                    return
                data += chunk
            words = data.decode("ascii", "replace").split()
            if len(words) == 2 and words[0] == token and words[1].isdigit():
                conn.sendall(f"{token} ok\n".encode())
                with lock:
                    heard.add(int(words[1]))
                while conn.recv(200):
                    pass
        except OSError:
            pass
        finally:
            conn.close()

    def accept() -> None:
        while True:
            try:
                conn, _addr = server.accept()
            except OSError:
                return
            threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    if server is not None:
        threading.Thread(target=accept, daemon=True).start()

    pending = dict(peers)
    last: dict[int, str] = {}
    while pending and time.monotonic() < deadline:
        for j, address in list(pending.items()):
            host, _, p = address.rpartition(":")
            try:
                with socket.create_connection((host.strip("[]"), int(p)),
                                              timeout=max(0.2, min(2.0, deadline - time.monotonic()))) as c:
                    c.settimeout(max(0.2, min(2.0, deadline - time.monotonic())))
                    c.sendall(f"{token} {index}\n".encode())
                    answer = c.makefile("rb").readline(200).decode("ascii", "replace").split()
                if answer == [token, "ok"]:
                    del pending[j]
                    result["reached"].append(j)
                else:
                    last[j] = "something else answers on that address and port (not this check's listener)"
            except OSError as exc:
                last[j] = _connect_reason(exc)
        if pending:
            time.sleep(0.1)
    result["unreached"] = {str(j): {"address": a, "reason": last.get(j, "not tried before the deadline")}
                           for j, a in pending.items()}
    while server is not None and time.monotonic() < deadline:  # stay up until every peer reached us
        with lock:
            if heard >= set(peers):
                break
        time.sleep(0.02)
    if server is not None:
        server.close()
    time.sleep(0.05)  # let the last answers go out before the process ends
    with lock:
        result["heard_from"] = sorted(heard)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.doctor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, action="append", default=[])
    parser.add_argument("--entrypoint")
    parser.add_argument("--program")
    parser.add_argument("--gpus", default="")
    parser.add_argument("--writable", action="append", default=[])
    parser.add_argument("--listen", type=int, metavar="PORT", help="cluster check: listen on PORT")
    parser.add_argument("--token", default="mgpu-doctor", help="cluster check: shared secret of this check")
    parser.add_argument("--index", type=int, default=0, help="cluster check: this task's index")
    parser.add_argument("--peer", action="append", default=[], metavar="J=ADDR:PORT",
                        help="cluster check: another task's index and address")
    parser.add_argument("--seconds", type=float, default=8.0, help="cluster check: give up after this long")
    args = parser.parse_args(argv)
    if args.listen is not None:
        peers = {}
        for item in args.peer:
            j, _, address = item.partition("=")
            if not j.isdigit() or ":" not in address:
                parser.error(f"--peer {item!r}: give J=ADDR:PORT")
            peers[int(j)] = address
        print(json.dumps(mesh(args.listen, args.token, args.index, peers, args.seconds)), flush=True)
        return 0
    gpus = [int(g) for g in args.gpus.split(",") if g.strip()]
    print(json.dumps(doctor(args.port, args.entrypoint, args.program, gpus, args.writable)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
