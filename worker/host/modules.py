"""The installed modules a training process had imported at its first step, kept in its task's folder: the task's
fork server (worker.task.forkserver) imports them too, so a restart pays for none of the imports the training does
late (a data loader's). Never the user's own modules: their module-level code runs once per attempt, at its start,
as in a cold start. Standard library only."""

from __future__ import annotations

import functools
import os
import re
import sys
import sysconfig
from pathlib import Path

from worker.host import env, layout
from worker.host.files import write_private

# a module's dotted name, none of its parts private
_MODULE = re.compile(r"^[A-Za-z][A-Za-z0-9]*(_[A-Za-z0-9]+)*(\.[A-Za-z][A-Za-z0-9]*(_[A-Za-z0-9]+)*)*\Z")
MODULES_MAX = 20000
# the frameworks the standby imports itself, as the program would: their lazy parts are theirs to load, when and
# in the order they choose (a list of names would import Keras 3's modules beside tf_keras's, for one)
FRAMEWORKS = {"tensorflow", "tf_keras", "keras", "jax", "jaxlib", "tensorboard", "tensorflow_estimator", "ml_dtypes",
              "flax", "optax", "orbax", "torch", "worker"}


def remember(folder: str | None) -> None:
    """Write the modules this training process has imported (in import order) to its task's folder, for its
    next standby: the imports it does later, lazily (a data loader's), are paid for before a restart too."""
    if not folder:
        return
    names = [m for m, module in list(sys.modules.items())
             if _MODULE.match(m) and m.partition(".")[0] not in FRAMEWORKS and installed(module)]
    try:
        write_private(Path(folder, layout.MODULES), "\n".join(names[:MODULES_MAX]) + "\n")
    except OSError:
        pass  # a full disk: the next standby imports less, nothing more


def installed(module: object) -> bool:
    """Whether `module` is Python's own or an installed package's (its file under the interpreter's library folders),
    not a module of the user's folder, whose import may have effects outside its process (a log file opened)."""
    path = getattr(module, "__file__", None)
    if not isinstance(path, str):
        return getattr(getattr(module, "__spec__", None), "origin", None) in ("built-in", "frozen")
    return os.path.realpath(path).startswith(_roots())


@functools.lru_cache(maxsize=1)
def _roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.realpath(paths[key]) + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")
                  if paths.get(key)})


def modules_file() -> str:
    """Where this task's training writes the list (its folder, by the environment)."""
    return os.path.join(os.environ.get(env.RUN_DIR, ""), layout.MODULES)


def remembered() -> list[str]:
    """The modules the task's last attempt imported (a file the training wrote: untrusted, bounded, checked)."""
    try:
        with open(modules_file(), "rb") as f:
            raw = f.read(MODULES_MAX * 64)
    except OSError:
        return []
    names = raw.decode("ascii", "replace").splitlines()[:MODULES_MAX]
    return [n for n in names if _MODULE.match(n) and n.partition(".")[0] not in FRAMEWORKS and n not in sys.modules]
