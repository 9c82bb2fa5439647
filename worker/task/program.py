"""A task's program as a fork server runs it (worker.task.forkserver): what `python ...` would have run (one of
our modules, a user's script or module), in a process forked from one that has imported the framework already.
Standard library only: the task core reads programs with it before its task runs."""

from __future__ import annotations

import atexit
import enum
import os
import re
import shutil
import sys
import threading
import traceback
import types
from typing import Any
from dataclasses import dataclass

from worker.host.spawn import BOOT

_PYTHON = re.compile(r"python(\d+(\.\d+)*)?\Z")
FORMS = "`python SCRIPT.py ...` or `python -m MODULE ...`"  # the commands a fork server can start


def not_a_form(argv: list[str] | tuple[str, ...]) -> str:
    """Why `argv`, by its form, is no program a fork server can start."""
    return f"its command ({argv[0] if argv else 'none'}) is not {FORMS}"


class Form(str, enum.Enum):
    MODULE = "module"  # one of ours, through BOOT (the built-in runner)
    SCRIPT = "script"  # a user's script: python PATH ARGS
    USER_MODULE = "usermodule"  # a user's module: python -m MODULE ARGS (the folder it runs in first on sys.path)


@dataclass(frozen=True)
class Program:
    form: Form
    target: str  # a module's name, or a script's path as given
    args: tuple[str, ...]

    @classmethod
    def of(cls, argv: list[str] | tuple[str, ...], python: str) -> "Program | None":
        """The program `argv` runs, where a fork of `python` can run it; None where it cannot (not Python,
        another Python than the task core's, options it would not keep): that program starts cold."""
        return cls.parse(argv) if len(argv) >= 2 and _same_python(argv[0], python) else None

    @staticmethod
    def cold(argv: list[str] | tuple[str, ...], python: str) -> str:
        """Why of() finds no program a fork can run in `argv`, in words for its user ('' where it finds one)."""
        if Program.of(argv, python) is not None:
            return ""
        if len(argv) < 2 or not _PYTHON.match(os.path.basename(argv[0])):
            return not_a_form(argv)
        if not _same_python(argv[0], python):
            return (f"its command's Python ({shutil.which(argv[0]) or argv[0]}) is not the one its task core runs "
                    f"({python}): name that one in `command` for warm restarts")
        return f"its command's options are not {FORMS}"

    @classmethod
    def parse(cls, argv: list[str] | tuple[str, ...]) -> "Program | None":
        """The program `argv` runs, by its form alone (its Python is checked on its host, by of())."""
        if len(argv) < 2 or not _PYTHON.match(os.path.basename(argv[0])):
            return None
        rest = list(argv[1:])
        while rest and rest[0] == "-u":  # unbuffered: the core sets PYTHONUNBUFFERED for every task anyway
            rest.pop(0)
        if len(rest) >= 3 and rest[0] == "-c" and rest[1] == BOOT:
            return cls(Form.MODULE, rest[2], tuple(rest[3:]))
        if len(rest) >= 2 and rest[0] == "-m" and not rest[1].startswith("-"):
            return cls(Form.USER_MODULE, rest[1], tuple(rest[2:]))
        if rest and not rest[0].startswith("-") and rest[0].endswith(".py"):
            return cls(Form.SCRIPT, rest[0], tuple(rest[1:]))
        return None

    def encode(self) -> dict[str, Any]:
        return {"form": self.form.value, "target": self.target, "args": list(self.args)}

    @classmethod
    def decode(cls, data: dict[str, Any]) -> "Program":
        args = data["args"]
        if not isinstance(data["target"], str) or not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError("not a program")
        return cls(Form(data["form"]), data["target"], tuple(args))

    def argv(self, python: str) -> list[str]:
        """The command line that runs it cold, as its task's does."""
        flags = {Form.MODULE: ["-c", BOOT], Form.USER_MODULE: ["-m"], Form.SCRIPT: []}[self.form]
        return [python, *flags, self.target, *self.args]

    @property
    def ours(self) -> str | None:
        """Our module it runs (the built-in runner's), whose imports a fork server may do ahead: never a user's."""
        return self.target if self.form is Form.MODULE else None

    def run(self) -> None:
        """The program in this process, as `python` would have run it: `__main__`, sys.argv and sys.path[0] as
        `python -c BOOT M`, `python -m M` and `python PATH` make them (a script's `__file__` absolute)."""
        if self.form is Form.MODULE:
            import runpy

            sys.argv = ["-c", *self.args]
            runpy.run_module(self.target, run_name="__main__", alter_sys=True)
        elif self.form is Form.USER_MODULE:
            import importlib.util
            import runpy

            sys.path.insert(0, os.getcwd())
            if importlib.util.find_spec(self.target) is None:  # as `python -m` says it, not a traceback
                print(f"{sys.executable}: No module named {self.target}", file=sys.stderr)
                raise SystemExit(1)
            sys.argv = ["-m", *self.args]
            runpy.run_module(self.target, run_name="__main__", alter_sys=True)
        else:
            path = os.path.abspath(self.target)
            try:
                with open(path, "rb") as f:
                    source = f.read()
            except OSError as exc:  # as `python PATH` says it, with its exit code
                print(f"{sys.executable}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}", file=sys.stderr)
                raise SystemExit(2) from None
            code = compile(source, path, "exec")
            main = types.ModuleType("__main__")
            main.__file__ = path
            main.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = main
            sys.path.insert(0, os.path.dirname(path))
            sys.argv = [self.target, *self.args]
            exec(code, main.__dict__)


def run_and_exit(program: Program) -> None:
    """Run `program` and end this process as the interpreter ends one: its exit code (SystemExit's, 1 after an
    uncaught exception, told as Python tells it), its threads joined, its atexit functions run."""
    code = 0
    try:
        program.run()
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException as exc:  # noqa: BLE001 (any, as the interpreter's own top level)
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:  # from the program's own frames on,
            tb = tb.tb_next  # as `python` prints it (a log's tail keeps the traceback's start)
        traceback.print_exception(type(exc), exc, tb)
        code = 1
    try:
        # private, so not in the stub: it joins the non-daemon threads, as at the interpreter's end
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _same_python(program: str, python: str) -> bool:
    """Whether `program` is the core's own interpreter, or one beside it (a virtualenv's python3 and python):
    only there is this package importable as the core imports it."""
    found = shutil.which(program)
    if not found:
        return False
    mine = os.path.abspath(python)
    return os.path.abspath(found) == mine or os.path.dirname(os.path.abspath(found)) == os.path.dirname(mine)
