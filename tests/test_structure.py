"""One owner for every fact (issue 28), kept: read from the source with `ast`, no process started.

- no path piece of the on-host layout outside worker/host/layout.py;
- the launcher's states stay on the launcher's side (no RunState, TaskState, AttemptOutcome in worker/);
- no engine method that only refuses (or only raises NotImplementedError outside an abstract role); no Mode
  switch in the Slurm engine;
- what the Slurm job is doing is asked from one module (the watcher);
- every name of the task environment (MGPU_*, TF_CONFIG, KERAS_*, CUDA_VISIBLE_DEVICES) is spelled in
  worker/host/env.py alone (issue 43);
- a run's or task's state, times and phases change only through the record's own transitions (issue 43).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

LAYOUT = REPO / "worker" / "host" / "layout.py"
ENV = REPO / "worker" / "host" / "env.py"
ENV_KEY = re.compile(r"(MGPU_[A-Z0-9_]+|TF_CONFIG|KERAS_[A-Z0-9_]+|CUDA_VISIBLE_DEVICES)\Z")
# the examples are a user's own scripts: they read the documented variables by name, as a user's would
ENV_KEY_EXCEPTIONS = (REPO / "worker" / "examples",)
FOLDERS = (".mgpu", "task-", "events-", "stacks-")  # the start of a folder's or file's name
FILES = ("worker.log", "progress.json", "task.json", "env.json", "launcher.alive", "exit_code")


def layout_piece(words: str) -> bool:
    """A string that spells a piece of the layout: a name alone or in a path (not a word in a sentence)."""
    if any(words == piece or words.startswith(piece + "/") or f"/{piece}/" in words for piece in FOLDERS):
        return True
    return any(words.endswith("/" + name) or f"/{name}/" in words for name in FILES) or words in FILES[:-1]


def sources(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (REPO / f).rglob("*.py"))


def strings(tree: ast.AST):
    """String constants and f-string parts, docstrings left out."""
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node


def test_no_path_piece_of_the_host_layout_outside_its_module():
    found = [f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}" for path in sources("launcher", "worker")
             if path != LAYOUT for node in strings(ast.parse(path.read_text(encoding="utf-8")))
             if layout_piece(node.value)]
    assert not found, "layout pieces spelled outside worker/host/layout.py:\n" + "\n".join(found)
    assert layout_piece("task-") and layout_piece(".mgpu/runs") and layout_piece("x/task-1/worker.log")
    assert not layout_piece("every line is in the task's worker.log") and not layout_piece("exit_code")


def test_the_launchers_states_live_on_the_launchers_side():
    names = {"RunState", "TaskState", "AttemptOutcome"}
    defined = [f"{p.relative_to(REPO)}: {n.name}" for p in sources("worker")
               for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))) if isinstance(n, ast.ClassDef) and n.name in names]
    assert not defined, defined
    imported = [f"{p.relative_to(REPO)}" for p in sources("worker") if "launcher" in p.read_text(encoding="utf-8")
                and any(isinstance(n, (ast.Import, ast.ImportFrom)) and "launcher" in ast.unparse(n)
                        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))))]
    assert not imported, f"worker modules importing the launcher: {imported}"


def only_raises(fn: ast.FunctionDef) -> bool:
    """A method whose body (its docstring aside) is one raise: NotImplementedError too (a role's method is
    abstract, in an ABC or a Protocol, not a refusal at run time)."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return len(body) == 1 and isinstance(body[0], ast.Raise) and body[0].exc is not None


def test_no_engine_method_only_refuses_and_the_slurm_engine_has_no_mode_switch():
    refusing = []
    for path in sources("launcher/engines"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            abstract = any(isinstance(b, ast.Name) and b.id in ("Protocol", "ABC") for b in cls.bases)
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and not abstract and only_raises(fn) \
                        and not any("abstractmethod" in ast.unparse(d) for d in fn.decorator_list):
                    refusing.append(f"{path.relative_to(REPO)}: {cls.name}.{fn.name}")
    assert not refusing, f"engine methods that only refuse: {refusing}"
    engine = ast.parse((REPO / "launcher" / "engines" / "slurm" / "__init__.py").read_text(encoding="utf-8"))
    main = next(n for n in engine.body if isinstance(n, ast.ClassDef) and n.name == "SlurmEngine")
    assert "Mode." not in ast.unparse(main), "the Slurm engine's main class branches on its mode"


def test_the_job_is_asked_about_from_one_module():
    """`squeue` and `scontrol show job` (what the job is doing) only from the watcher, which caches it."""
    asking = set()
    for path in sources("launcher"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.List) and node.elts and isinstance(node.elts[0], ast.Constant):
                words = [e.value for e in node.elts if isinstance(e, ast.Constant)]
                if words[0] == "squeue" or words[0] == "scontrol" and "job" in words:
                    asking.add(path.relative_to(REPO).as_posix())
    assert asking == {"launcher/engines/slurm/watch.py"}, asking


def test_the_task_environments_names_are_spelled_in_its_builder_alone():
    found = [f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}" for path in sources("launcher", "worker")
             if path != ENV and not any(folder in path.parents for folder in ENV_KEY_EXCEPTIONS)
             for node in strings(ast.parse(path.read_text(encoding="utf-8"))) if ENV_KEY.match(node.value)]
    assert not found, "environment names spelled outside worker/host/env.py (import its constant):\n" + "\n".join(found)
    builder = {node.value for node in strings(ast.parse(ENV.read_text(encoding="utf-8"))) if ENV_KEY.match(node.value)}
    assert {"MGPU_RUN_DIR", "MGPU_ATTEMPT", "TF_CONFIG", "KERAS_BACKEND", "CUDA_VISIBLE_DEVICES"} <= builder
    assert not ENV_KEY.match("no TF_CONFIG") and not ENV_KEY.match("KERAS_DISTRIBUTION_* variables")


RECORD = REPO / "launcher" / "run" / "record.py"
MUTATORS = {"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault", "add",
            "discard", "sort", "reverse"}


def record_fields(tree: ast.AST) -> set[str]:
    """Every field of every record class in launcher/run/record.py (the annotated names of its classes' bodies)."""
    return {stmt.target.id for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
            for stmt in node.body if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)}


def record_writes(tree: ast.AST, fields: set[str]) -> list[int]:
    """Lines that change a record's field: `x.field = ...` or `x.field += ...` (not `self.`'s own: another
    class's), `x.field[k] = ...` and `del x.field[k]`, `x.field.append/update/pop/...(...)`."""
    def field_of(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr in fields and not (
            isinstance(node.value, ast.Name) and node.value.id == "self")

    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if field_of(t) or isinstance(t, ast.Subscript) and field_of(t.value):
                    found.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS and \
                field_of(node.func.value):
            found.append(node.lineno)
    return sorted(found)


def test_the_record_changes_only_through_its_own_transitions():
    """Every field of the run record (the run's, each task's, each attempt's) is written in launcher/run/record.py
    alone, by its transitions; the agent, watch, teardown, up and `status` call them."""
    fields = record_fields(ast.parse(RECORD.read_text()))
    assert {"state", "phases", "attempts", "hosts_lost", "proc_status", "progress", "engine", "restarts"} <= fields
    found = {f"{p.relative_to(REPO)}:{line}": None for p in sources("launcher") if p != RECORD
             for line in record_writes(ast.parse(p.read_text()), fields)}
    assert not found, sorted(found)
    assert record_writes(ast.parse("t.state = 1\nrun.phases['x'] = 2\nrun.phases.setdefault('y', 3)\n"
                                   "run.restarts += 1\nrun.attempts.append(a)\nself.state = 1\n"), fields) == [1, 2, 3, 4, 5]
