"""Checks one host's tasks for the launcher's preflight and prints one JSON report (no TensorFlow import).
Host-wide things (interpreter, versions, entrypoint or program, GPUs) are checked once, ports and folders
per task; with --mesh, the cluster check too. The launcher calls `check_tasks` directly when it can. With
--import (`check`), the entrypoint is also imported, in a child python with the task's folder and environment."""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from importlib.machinery import ModuleSpec, PathFinder
from typing import Any, Callable, ParamSpec, TypedDict, TypeVar, cast

from worker.host.clock import Deadline
from worker.host.devices import gpu_indices, interface_for, task_devices
from worker.host.env import Backend
from worker.preflight.packages import missing_problem, versions
from worker.preflight.ports import MeshTask, mesh
from worker.host.startpoint import look_first
from worker.host.spawn import OWN_GROUP, module_argv
from worker.host.system import Ports
from worker.task.lines import printable

IMPORT_TIMEOUT_S = 45.0  # below the launcher's wait for the whole report
OUTPUT_MAX = 8192  # bytes of the import's output kept (its last ones)
TaskDoc = dict[str, Any]  # Any: a task's JSON (--task, the launcher's), each field read where it is used
P = ParamSpec("P")
T = TypeVar("T")


class TaskReport(TypedDict, total=False):
    """One task's part of the report: index, problems, holder and no_workdir always, the rest where its folder is."""
    index: int
    problems: list[str]
    holder: dict[str, object] | None
    no_workdir: bool
    devices: int | None
    devices_unknown: str | None
    network: dict[str, object]
    checkpoint: dict[str, object]


class Report(TypedDict, total=False):
    """The report the launcher reads (one JSON line): all but mesh always, mesh with --mesh."""
    hostname: str
    python: str
    versions: dict[str, str | None]
    tasks: list[TaskReport]
    mesh: dict[str, MeshTask]


def find_module(name: str, path: list[str]) -> ModuleSpec | None:
    """The spec of module `name` as `python` in a folder would find it, executing nothing: the top
    package through the import finders (editable installs included), its submodules on disk."""
    top, *rest = name.split(".")
    spec: ModuleSpec | None = None
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


def entrypoint_problem(entrypoint: str, cwd: str, search: list[str] | None = None) -> str | None:
    """Whether module:function can be found from `cwd`, without importing anything (no TensorFlow); `search`:
    the interpreter's own path (default: this process's, less sys.path[0], its own folder)."""
    module, _, func = entrypoint.partition(":")
    search = sys.path[1:] if search is None else search
    try:  # our package comes first in the runner, whatever the workdir holds (worker.host.spawn)
        spec = find_module(module, search if module.split(".")[0] == "worker" else [cwd, *search])
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


def _keep_tail(stream: io.BufferedReader, into: bytearray) -> None:
    for chunk in iter(lambda: stream.read1(65536), b""):
        into.extend(chunk)
        del into[:-OUTPUT_MAX]


class ImportCheck:
    """The entrypoint imported as the runner will (`python -m worker.training.entrypoint`, this interpreter, the task's
    folder and environment), in a child of its own: started at once, read last, bounded by a timeout; what the
    module prints is untrusted and cut. `python`: the interpreter as the spec names it for this host (the hint's)."""

    def __init__(self, entrypoint: str, cwd: str, env: dict[str, str], timeout: float = IMPORT_TIMEOUT_S,
                 python: str | None = None, backend: Backend = Backend.TENSORFLOW) -> None:
        self.entrypoint, self.cwd, self.timeout = entrypoint, cwd, timeout
        self.python = python or sys.executable
        self.deadline = Deadline.after(timeout)
        self.out, self.err = bytearray(), bytearray()
        argv = module_argv(sys.executable, "worker.training.entrypoint") + [entrypoint, backend.value]
        self.proc = subprocess.Popen(argv, cwd=cwd, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     **OWN_GROUP)
        self.readers = [threading.Thread(target=_keep_tail, args=(stream, buf), daemon=True)
                        for stream, buf in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self.readers:
            t.start()

    def problem(self) -> str | None:
        module = self.entrypoint.partition(":")[0]
        try:
            self.proc.wait(self.deadline.left())
        except subprocess.TimeoutExpired:
            self.stop()
            return (f"importing entrypoint module {module!r} did not finish within {self.timeout:g} s (in "
                    f"{self.cwd}, with {self.python}): does it load data or wait at import? Move that into "
                    "the entrypoint function")
        for t in self.readers:
            t.join(1.0)
        try:
            report = json.loads(bytes(self.out).decode("utf-8", "replace").strip().splitlines()[-1])
            ok, error, where = report["ok"] is True, printable(str(report.get("error"))), report.get("where")
            raised = report.get("raised") is not False
        except (ValueError, IndexError, KeyError, TypeError, AttributeError):
            said = bytes(self.err).decode("utf-8", "replace").strip().splitlines() or ["no output"]
            return (f"importing entrypoint module {module!r} ended (exit code {self.proc.returncode}) before it "
                    f"could say how it went, in {self.cwd} with {self.python}: {printable(said[-1])}")
        if ok:
            return None
        if not raised:  # imported, but no such function there
            return f"entrypoint {self.entrypoint!r}: {error} (in {self.cwd}, with {self.python})"
        at = f" at {printable(str(where))}" if where else ""
        shadow = [n for n in ("worker.py", "worker") if os.path.exists(os.path.join(self.cwd, n))]
        note = (f"; {os.path.join(self.cwd, shadow[0])} has the name of mgpu-cluster's package 'worker', which "
                "the runner imports first: rename yours" if shadow and "worker" in error else "")
        if report.get("during") == "call":
            return (f"entrypoint {self.entrypoint!r} raised {error}{at} when called with its Task's train_data, as "
                    "the jax runner will call them")
        return (f"entrypoint {self.entrypoint!r} cannot be imported: {error}{at}{note}. Run "
                f"`{self.python} -c 'import {module}'` in {self.cwd} to see the whole traceback")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, 9)  # its own group: whatever the module started too
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


def start_imports(tasks: list[TaskDoc], entrypoint: str, env: dict[str, str],
                  backend: Backend = Backend.TENSORFLOW) -> dict[str, ImportCheck]:
    """One import check per task folder, started now (they run while the other checks do); on jax it also
    calls the entrypoint and its train_data, to tell a TensorFlow pipeline before the run."""
    here = os.getcwd()
    found: dict[str, ImportCheck] = {}
    for t in tasks:
        cwd = os.path.join(here, os.path.expanduser(t["cwd"])) if t.get("cwd") else here
        if cwd not in found and os.path.isdir(cwd):
            found[cwd] = ImportCheck(entrypoint, cwd, env, python=t.get("python"), backend=backend)
    return found


def check_host(tasks: list[TaskDoc], entrypoint: str | None, program: str | None, env: dict[str, str] | None = None,
               search: list[str] | None = None, also: Callable[[Report], None] = lambda report: None,
               backend: Backend = Backend.TENSORFLOW) -> Report:
    """check_tasks, and with `env` (`check`) the entrypoint imported in each task folder meanwhile (in place of
    the static look for it); `also(report)` runs while the imports do (the cluster check)."""
    imports = start_imports(tasks, entrypoint, env, backend) if env is not None and entrypoint else {}
    try:
        report = check_tasks(tasks, None if imports else entrypoint, program, search, backend)
        also(report)
        here = os.getcwd()
        problems = {cwd: check.problem() for cwd, check in imports.items()}
        for t, entry in zip(tasks, report["tasks"]):
            problem = problems.get(os.path.join(here, os.path.expanduser(t["cwd"])) if t.get("cwd") else here)
            entry["problems"] += [problem] if problem else []
        return report
    finally:
        for check in imports.values():
            check.stop()


def check_tasks(tasks: list[TaskDoc], entrypoint: str | None = None, program: str | None = None,
                search: list[str] | None = None, backend: Backend = Backend.TENSORFLOW) -> Report:
    """Every task's problems; what depends only on the host (and folder) is looked at once."""
    here = os.getcwd()
    found = versions(backend)
    lacking = missing_problem(backend, found)  # host-wide: said for each of its tasks
    ports = Ports()
    cache: dict[tuple[str, str], object] = {}
    gpus: list[set[int] | None] = []  # [indices], filled at the first task that names GPUs

    def once(key: tuple[str, str], fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        if key not in cache:
            cache[key] = fn(*args, **kwargs)
        return cast(T, cache[key])  # what fn gave for this key (each kind of key has its own fn)

    results: list[TaskReport] = []
    for t in tasks:
        cwd = os.path.join(here, os.path.expanduser(t["cwd"])) if t.get("cwd") else here
        entry: TaskReport = {"index": t["index"], "problems": [], "holder": None, "no_workdir": not os.path.isdir(cwd)}
        results.append(entry)
        if entry["no_workdir"]:
            continue
        problems: list[str | None] = [lacking]  # the Nones dropped at the end
        holder = entry["holder"] = ports.holder(t["port"])
        if holder:
            who = f"pid {holder['pid']} ({holder['name']}: {holder['cmdline']})" if holder["pid"] else holder["cmdline"]
            problems.append(f"port {t['port']} is in use by {who}")
        if entrypoint:
            problems.append(once(("entrypoint", cwd), entrypoint_problem, entrypoint, cwd, search))
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
        if t.get("checkpoint"):  # what the run would start from: the launcher decides (launcher.commands.resume)
            folders = [os.path.join(cwd, os.path.expanduser(p)) for p in t["checkpoint"]]
            entry["checkpoint"] = look_first(folders, claims=True).to_json()
        entry["problems"] = [p for p in problems if p]
    return {"hostname": socket.gethostname(), "python": sys.executable, "versions": found, "tasks": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.preflight.doctor", description=__doc__)
    parser.add_argument("--task", action="append", default=[], type=json.loads, metavar="JSON",
                        help='one task: {"index", "port", "cwd"?, "writable": [...], "checkpoint"?: [...], '
                        '"gpus"?: [...] | "all" | "none", "local_replicas"?, "address"?, "python"?: the spec\'s '
                        'name for this interpreter}')
    parser.add_argument("--entrypoint")
    parser.add_argument("--program")
    parser.add_argument("--backend", type=Backend, choices=list(Backend), default=Backend.TENSORFLOW,
                        help="[training] backend: on jax, jax and keras >= 3 must be installed")
    parser.add_argument("--mesh", type=json.loads, metavar="PEERS", help="cluster check: every task's "
                        "[index, address, port, group], as JSON; this host's tasks listen on their ports and "
                        "the host connects to every other task's port, as TensorFlow will")
    parser.add_argument("--group", type=int, default=0, help="cluster check: this host's group id")
    parser.add_argument("--token", default="mgpu-doctor", help="cluster check: shared secret of this check")
    parser.add_argument("--seconds", type=float, default=8.0, help="cluster check: give up after this long")
    parser.add_argument("--hold", type=float, metavar="S", help="after the report, wait up to S seconds for "
                        "'go' on stdin and become the task's supervisor (the arguments after --): `up` starts "
                        "a remote task without a second remote shell and Python")
    parser.add_argument("--import", dest="imports", action="store_true", help="also import the entrypoint, in "
                        "a child python in each task's folder, with the environment given as stdin's first line "
                        "(a JSON object)")
    parser.add_argument("supervisor", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    env = _env_line() if args.imports else None

    def cluster_check(report: Report) -> None:
        if args.mesh is not None:
            mine = {t["index"]: t["port"] for t in args.task}
            report["mesh"] = mesh(mine, args.group, args.mesh, args.token, args.seconds)

    # sys.path as given: our entries run with nothing put before it (worker.host.spawn)
    report = check_host(args.task, args.entrypoint, args.program, env, sys.path, cluster_check, args.backend)
    print(json.dumps(report), flush=True)
    if args.hold and _line(args.hold) == b"go":
        from worker.task import supervised as supervisor

        code = supervisor.main(args.supervisor[1:] if args.supervisor[:1] == ["--"] else args.supervisor)
        os._exit(code)  # as the supervisor's own __main__: don't wait for its watcher threads
    return 0


def _env_line() -> dict[str, str]:
    """The task's environment, stdin's first line (a JSON object; never on a command line)."""
    line = _line(IMPORT_TIMEOUT_S)
    try:
        env = json.loads(line) if line else {}
    except ValueError:
        env = {}
    return {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {}


def _line(seconds: float) -> bytes:
    """One line of stdin, read a byte at a time (what follows it is the supervisor's); b"" on EOF or
    when nothing comes within `seconds` (the launcher refused the cluster, or went away)."""
    import select

    line, deadline = b"", Deadline.after(seconds)
    while not line.endswith(b"\n"):
        if not select.select([0], [], [], deadline.left())[0]:
            return b""
        byte = os.read(0, 1)
        if not byte:
            return b""
        line += byte
    return line.strip()


if __name__ == "__main__":
    sys.exit(main())
