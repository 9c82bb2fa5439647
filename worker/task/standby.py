"""A warm start: the training's Python, started before it is needed. The task core runs the program of a
task's next attempt through this module while the current attempt trains; it imports what the program's
start would (TensorFlow with tf_keras, or Keras 3 on JAX; the built-in runner and the entrypoint's module),
says "ready", and waits (importing at the idle priority where it can take the normal one back, so a
standby costs the training no CPU time it would use). On "go" it runs the program as `python` would have, in this process: a restart
then pays for none of those imports. It holds no port and builds no runtime (no strategy, no device)
until "go", and the core's environment for it is the attempt's own, given before the start.

    python -c BOOT worker.task.standby module MODULE ARGS...   (our modules: python -c BOOT MODULE ARGS...)
    python -c BOOT worker.task.standby script PATH ARGS...     (python PATH ARGS...)
    python -c BOOT worker.task.standby usermodule MODULE ARGS... (python -m MODULE ARGS...)

The core's end of a socket pair is fd $MGPU_STANDBY_FD: "ready" goes out on it, "go" comes back.
"""

from __future__ import annotations

import enum
import importlib
import os
import re
import resource
import runpy
import shutil
import socket
import sys

from worker.host.modules import remembered
from worker.host.spawn import BOOT, module_argv

ENV_FD = "MGPU_STANDBY_FD"
ENV_GROUP = "MGPU_STANDBY_GROUP"  # "own": its core leads a session of its own (over SSH: sshd's), its autogroup
EXIT_NO_START = 70  # EX_SOFTWARE
READY, GO = b"ready\n", b"go\n"
MODULE = "worker.task.standby"
_PYTHON = re.compile(r"python(\d+(\.\d+)*)?\Z")


class Form(str, enum.Enum):
    MODULE = "module"  # one of ours, through BOOT (the built-in runner)
    SCRIPT = "script"  # a user's script: python PATH ARGS
    USER_MODULE = "usermodule"  # a user's module: python -m MODULE ARGS (the folder it runs in first on sys.path)


def warm_argv(argv: list[str], python: str) -> list[str] | None:
    """The program `argv` started through this module, or None where it cannot be (not Python, another
    Python than the task core's, options it would not keep): that program starts cold, as before."""
    if len(argv) < 2 or not _PYTHON.match(os.path.basename(argv[0])) or not _same_python(argv[0], python):
        return None
    rest = list(argv[1:])
    while rest and rest[0] == "-u":  # unbuffered: the core sets PYTHONUNBUFFERED for every task anyway
        rest.pop(0)
    head = module_argv(argv[0], MODULE)
    if len(rest) >= 2 and rest[0] == "-c" and rest[1] == BOOT:
        return head + [Form.MODULE.value, *rest[2:]] if len(rest) >= 3 else None
    if len(rest) >= 2 and rest[0] == "-m":
        return head + [Form.USER_MODULE.value, *rest[1:]]
    if rest and not rest[0].startswith("-") and rest[0].endswith(".py"):
        return head + [Form.SCRIPT.value, *rest]
    return None


def _same_python(program: str, python: str) -> bool:
    """Whether `program` is the core's own interpreter, or one beside it (a virtualenv's python3 and python):
    only there is this package importable as the core imports it."""
    found = shutil.which(program)
    if not found:
        return False
    mine = os.path.abspath(python)
    return os.path.abspath(found) == mine or os.path.dirname(os.path.abspath(found)) == os.path.dirname(mine)


def _warm(form: Form, target: str, args: list[str]) -> None:
    """Import what the program's start would; a failure is left for the program itself to meet and tell."""
    jax = os.environ.get("KERAS_BACKEND") == "jax"
    try:
        if jax:
            import keras  # noqa: F401  (and JAX under it)
        else:
            os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # as the runner sets it, before TensorFlow
            import tensorflow  # noqa: F401
        if form is Form.MODULE and target == "worker":
            if jax:
                import worker.keras3.runner  # noqa: F401
            else:
                import worker.runner  # noqa: F401
            entry = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--entrypoint"), None)
            if entry:
                from worker.entrypoint import resolve_entrypoint

                resolve_entrypoint(entry)
    except Exception:  # noqa: BLE001 (the program's own start will say what is wrong, in its words)
        pass
    for name in remembered():
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 (one that fails here is imported, or not, as the program does)
            continue


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _autogroup(nice: int) -> None:
    """The nice value of this process's autogroup (its session's share of the CPU against other sessions')."""
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass


def idle() -> tuple[bool, bool]:
    """Import at the idle priority (only on CPU time the training leaves), where this process may take its
    priority back at "go" (root, or an RLIMIT_NICE that allows nice 0); elsewhere at the normal one. In a
    session of its own (over SSH) its autogroup is niced too: the kernel shares the CPU between sessions
    first, so an idle process of another session would still take half of it."""
    own = os.environ.pop(ENV_GROUP, "") == "own"
    try:
        back = os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20
        if back:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            if own:
                _autogroup(19)
        return back, back and own
    except (OSError, AttributeError, ValueError):
        return False, False


def unidle(group: bool) -> None:
    """Every thread back to the normal priority (the ones the imports started were started idle too), and
    the autogroup where it was niced."""
    if group:
        _autogroup(0)
    for tid in _threads():
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            pass


def run(form: Form, target: str, args: list[str]) -> None:
    """The program, as `python` would have run it: `__main__`, its arguments in sys.argv."""
    if form is Form.MODULE:
        sys.argv = ["-c", *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif form is Form.USER_MODULE:
        sys.path.insert(0, os.getcwd())
        sys.argv = ["-m", *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        sys.argv = [target, *args]
        runpy.run_path(target, run_name="__main__")


def main() -> None:
    form, target, args = Form(sys.argv[1]), sys.argv[2], sys.argv[3:]
    link = socket.socket(fileno=int(os.environ.pop(ENV_FD)))
    os.set_inheritable(link.fileno(), False)
    idled, group = idle()
    _warm(form, target, args)
    try:
        link.sendall(READY)
    except OSError:
        pass  # the core may have said "go" and closed its end already: what it said is still here to read
    said = b""
    while GO not in said:
        try:
            data = link.recv(64)
        except OSError:
            data = b""
        if not data:  # the core went away before the start: never an exit that could pass for a success
            print("mgpu standby: the task core went away before the start; nothing was run", file=sys.stderr)
            os._exit(EXIT_NO_START)
        said += data
    link.close()
    if idled:
        unidle(group)
    run(form, target, args)


if __name__ == "__main__":
    main()
