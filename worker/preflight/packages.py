"""What a host has of each backend's packages, read from their installed metadata (nothing is imported):
the versions the preflight compares across hosts, and on JAX what is missing."""

from __future__ import annotations

import importlib.metadata
import platform
import socket
import sys

from worker.host.env import Backend

PACKAGES = {Backend.TENSORFLOW: ("tensorflow", "tf-keras"), Backend.JAX: ("jax", "jaxlib", "keras")}
EXTRA = "pip install 'mgpu-cluster[jax]'"


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(backend: Backend = Backend.TENSORFLOW) -> dict[str, str | None]:
    """Python's and the backend's packages' versions (None: not installed)."""
    return {"python": platform.python_version(), **{dist: version(dist) for dist in PACKAGES[backend]}}


def missing_problem(backend: Backend, found: dict[str, str | None]) -> str | None:
    """On JAX, one paragraph naming what this host lacks of jax and Keras 3 (`found`: its versions()); on
    TensorFlow nothing (its versions are compared, and the training's import says the rest)."""
    if backend is not Backend.JAX:
        return None
    missing = [dist for dist in PACKAGES[backend] if not found.get(dist)]
    major = (found.get("keras") or "").split(".")[0]
    if major.isdigit() and int(major) < 3:
        missing.append(f"keras >= 3 (it has keras {found['keras']})")
    if not missing:
        return None
    return (f"{', '.join(missing)} not installed for {sys.executable} on host {socket.gethostname()}: backend = "
            f"\"jax\" needs JAX and Keras 3 on every host; install them there with {EXTRA} (Python >= 3.10; "
            "Keras 3.15 and newer need Python >= 3.11)")
