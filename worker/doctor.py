"""Checks one host for the launcher's preflight and prints them as JSON (no TensorFlow import).

    python -m worker.doctor --port 20000 [--port ...] [--entrypoint mod:fn | --program prog]
                            [--gpus 0,1] [--writable DIR ...]
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

import psutil


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def port_holder(port: int) -> dict | None:
    """Who listens on `port` (any address), or None when it is free."""
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.doctor", description=__doc__)
    parser.add_argument("--port", type=int, action="append", default=[])
    parser.add_argument("--entrypoint")
    parser.add_argument("--program")
    parser.add_argument("--gpus", default="")
    parser.add_argument("--writable", action="append", default=[])
    args = parser.parse_args(argv)
    gpus = [int(g) for g in args.gpus.split(",") if g.strip()]
    print(json.dumps(doctor(args.port, args.entrypoint, args.program, gpus, args.writable)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
