"""Checks one host's tasks for the launcher's preflight and prints one JSON report (no TensorFlow import).
Host-wide things (interpreter, versions, entrypoint or program, GPUs) are checked once, ports and folders
per task; with --mesh, the cluster check too. The launcher calls `check_tasks` directly when it can."""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import os
import platform
import shutil
import socket
import sys
import time
from importlib.machinery import PathFinder

from worker.devices import gpu_indices, interface_for, task_devices
from worker.mesh import mesh
from worker.host.system import Ports


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    return {"python": platform.python_version(), "tensorflow": version("tensorflow"), "tf-keras": version("tf-keras")}


def find_module(name: str, path: list[str]):
    """The spec of module `name` as `python` in a folder would find it, executing nothing: the top
    package through the import finders (editable installs included), its submodules on disk."""
    top, *rest = name.split(".")
    spec = None
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = PathFinder.find_spec(top, path) if finder is PathFinder else find(top, None)
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            break
    for i in range(len(rest)):
        if spec is None or not spec.submodule_search_locations:
            return None
        spec = PathFinder.find_spec(".".join([top, *rest[: i + 1]]), list(spec.submodule_search_locations))
    return spec


def entrypoint_problem(entrypoint: str, cwd: str) -> str | None:
    """Whether module:function can be found from `cwd`, without importing anything (no TensorFlow)."""
    module, _, func = entrypoint.partition(":")
    try:
        spec = find_module(module, [cwd, *sys.path[1:]])  # sys.path[0]: this process's own folder
    except (ImportError, ValueError) as exc:
        return f"module {module!r} cannot be found: {exc}"
    if spec is None:
        return f"module {module!r} cannot be found from {cwd} with {sys.executable}"
    if not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError) as exc:
        return f"module {module!r} ({spec.origin}) cannot be parsed: {exc}"
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    names |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    if func not in names:
        return f"module {module!r} ({spec.origin}) defines no {func!r}"
    return None


def program_problem(program: str, cwd: str) -> str | None:
    if "/" not in program:
        if shutil.which(program):
            return None
        found = shutil.which(program, mode=os.F_OK)  # there, but not executable
        if found:
            return f"program {found} (found on PATH) is not executable: chmod +x it, or run it through its interpreter"
        return f"program {program!r} is not found on PATH ({os.environ.get('PATH', '')})"
    path = os.path.join(cwd, program)
    if os.path.isdir(path):
        return f"program {path} is a folder, not a program"
    if not os.path.isfile(path):
        return f"program {program!r} does not exist (looked for {path})"
    if not os.access(path, os.X_OK):
        return f"program {path} is not executable: chmod +x it, or run it through its interpreter"
    return None


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


def check_tasks(tasks: list[dict], entrypoint: str | None = None, program: str | None = None) -> dict:
    """Every task's problems; what depends only on the host (and folder) is looked at once."""
    here = os.getcwd()
    ports = Ports()
    cache: dict[tuple, str | None] = {}
    gpus: list = []  # [indices], filled at the first task that names GPUs

    def once(key: tuple, fn, *args):
        if key not in cache:
            cache[key] = fn(*args)
        return cache[key]

    results = []
    for t in tasks:
        cwd = os.path.join(here, os.path.expanduser(t["cwd"])) if t.get("cwd") else here
        entry = {"index": t["index"], "problems": [], "holder": None, "no_workdir": not os.path.isdir(cwd)}
        results.append(entry)
        if entry["no_workdir"]:
            continue
        problems = entry["problems"]
        holder = entry["holder"] = ports.holder(t["port"])
        if holder:
            who = f"pid {holder['pid']} ({holder['name']}: {holder['cmdline']})" if holder["pid"] else holder["cmdline"]
            problems.append(f"port {t['port']} is in use by {who}")
        if entrypoint:
            problems.append(once(("entrypoint", cwd), entrypoint_problem, entrypoint, cwd))
        if program:
            problems.append(once(("program", cwd), program_problem, program, cwd))
        if t.get("gpus") != "none" and not gpus:
            gpus.append(gpu_indices())
        have = gpus[0] if gpus else None
        if isinstance(t.get("gpus"), list) and t["gpus"]:
            missing = sorted(set(t["gpus"]) - (have or set()))
            if have is None:
                problems.append(f"GPUs {t['gpus']} are named but this host has no nvidia-smi")
            elif missing:
                problems.append(f"GPUs {missing} do not exist here (this host has {sorted(have)})")
        entry["devices"], entry["devices_unknown"] = task_devices(t, have)
        local = t.get("local_replicas")
        if local and entry["devices"] not in (None, local):  # GPUs visible: one replica each
            problems.append(f"local_replicas = {local}, but this task sees {entry['devices']} GPU(s), one "
                            "replica each; leave local_replicas out or make it equal")
        if t.get("address"):
            entry["network"] = once(("address", t["address"]), interface_for, t["address"])
        for p in t.get("writable", []):
            path = os.path.join(cwd, os.path.expanduser(p))
            problems.append(once(("writable", path), writable_problem, path))
        entry["problems"] = [p for p in problems if p]
    return {"hostname": socket.gethostname(), "python": sys.executable, "versions": versions(), "tasks": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.doctor", description=__doc__)
    parser.add_argument("--task", action="append", default=[], type=json.loads, metavar="JSON",
                        help='one task: {"index", "port", "cwd"?, "writable": [...], "gpus"?: [...] | "all" | "none", '
                        '"local_replicas"?, "address"?}')
    parser.add_argument("--entrypoint")
    parser.add_argument("--program")
    parser.add_argument("--mesh", type=json.loads, metavar="PEERS", help="cluster check: every task's "
                        "[index, address, port, group], as JSON; this host's tasks listen on their ports and "
                        "the host connects to every other task's port, as TensorFlow will")
    parser.add_argument("--group", type=int, default=0, help="cluster check: this host's group id")
    parser.add_argument("--token", default="mgpu-doctor", help="cluster check: shared secret of this check")
    parser.add_argument("--seconds", type=float, default=8.0, help="cluster check: give up after this long")
    parser.add_argument("--hold", type=float, metavar="S", help="after the report, wait up to S seconds for "
                        "'go' on stdin and become the task's supervisor (the arguments after --): `up` starts "
                        "a remote task without a second remote shell and Python")
    parser.add_argument("supervisor", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    report = check_tasks(args.task, args.entrypoint, args.program)
    if args.mesh is not None:
        mine = {t["index"]: t["port"] for t in args.task}
        report["mesh"] = mesh(mine, args.group, args.mesh, args.token, args.seconds)
    print(json.dumps(report), flush=True)
    if args.hold and _line(args.hold) == b"go":
        from worker.task import supervised as supervisor

        code = supervisor.main(args.supervisor[1:] if args.supervisor[:1] == ["--"] else args.supervisor)
        os._exit(code)  # as the supervisor's own __main__: don't wait for its watcher threads
    return 0


def _line(seconds: float) -> bytes:
    """One line of stdin, read a byte at a time (what follows it is the supervisor's); b"" on EOF or
    when nothing comes within `seconds` (the launcher refused the cluster, or went away)."""
    import select

    line, deadline = b"", time.monotonic() + seconds
    while not line.endswith(b"\n"):
        if not select.select([0], [], [], max(0.0, deadline - time.monotonic()))[0]:
            return b""
        byte = os.read(0, 1)
        if not byte:
            return b""
        line += byte
    return line.strip()


if __name__ == "__main__":
    sys.exit(main())
