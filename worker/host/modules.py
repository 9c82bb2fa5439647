"""The modules a training process had imported at its first step, kept in its task's folder: the task's next
standby (worker.task.standby) imports them too, so a restart pays for none of the imports the training does
late (a data loader's). Standard library only."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from worker.host import layout
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
    names = [m for m in list(sys.modules) if _MODULE.match(m) and m.partition(".")[0] not in FRAMEWORKS]
    try:
        write_private(Path(folder, layout.MODULES), "\n".join(names[:MODULES_MAX]) + "\n")
    except OSError:
        pass  # a full disk: the next standby imports less, nothing more


def remembered() -> list[str]:
    """The modules the task's last attempt imported (a file the training wrote: untrusted, bounded, checked)."""
    try:
        with open(os.path.join(os.environ.get("MGPU_RUN_DIR", ""), layout.MODULES), "rb") as f:
            raw = f.read(MODULES_MAX * 64)
    except OSError:
        return []
    names = raw.decode("ascii", "replace").splitlines()[:MODULES_MAX]
    return [n for n in names if _MODULE.match(n) and n.partition(".")[0] not in FRAMEWORKS and n not in sys.modules]
