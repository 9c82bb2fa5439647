"""What every part of the spec shares: the strict frozen model, value types, and checks of names and text."""

from __future__ import annotations

import re
from typing import Annotated, Iterable, Mapping, Optional, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from worker.host.env import owner

LOCAL_ADDRESSES = frozenset({"localhost", "127.0.0.1"})

# Every number of the spec is finite and bounded by what its consumer takes (no inf, nan or 301-digit value
# reaches a process, a script or a manifest); the bounds are named here, once.
WEEK_S = 7 * 24 * 3600  # timeouts and graces: far below threading.TIMEOUT_MAX and Kubernetes' int32 seconds
INT32_MAX = 2**31 - 1  # epochs, steps, batch sizes: TensorFlow's int32 (epochs x steps fits its int64 step count)
RESTARTS_MAX = 10_000  # restarts (or preemptions) of one run
DEVICES_MAX = 1024  # GPUs or replicas of one worker, far above any machine
CPUS_MAX = 8192  # Linux's largest NR_CPUS: a CPU index beyond it overflows sched_setaffinity

Port = Annotated[int, Field(ge=1, le=65535)]
Seconds = Annotated[float, Field(gt=0, le=WEEK_S, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=1, le=INT32_MAX)]
Restarts = Annotated[int, Field(ge=0, le=RESTARTS_MAX)]
Devices = Annotated[int, Field(ge=0, le=DEVICES_MAX)]
GpuIndex = Annotated[int, Field(ge=0, lt=DEVICES_MAX)]
CpuIndex = Annotated[int, Field(ge=0, lt=CPUS_MAX)]
EnvName = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
Entrypoint = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*\Z")
SECRET = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)  # env names whose values are hidden


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def nul_at(data: object, where: str = "") -> str | None:
    """The key path of the first string (key or value) in `data` that holds a NUL, or None. A NUL reaches
    no process (not in an argument, a path, nor the environment), so no spec value may hold one."""
    if isinstance(data, str):
        return where if "\x00" in data else None
    items: Iterable[tuple[object, object]] = (data.items() if isinstance(data, dict) else enumerate(data)
                                               if isinstance(data, list) else ())
    for key, value in items:
        path = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else str(key)
        if isinstance(key, str) and "\x00" in key:
            return path
        found = nul_at(value, path)
        if found is not None:
            return found
    return None


def _no_control(value: str) -> bool:
    return not any(ord(c) < 32 or ord(c) == 127 for c in value)


Env = TypeVar("Env", bound=Optional[Mapping[str, object]])


def env_names(env: Env) -> Env:
    """An env table's names must be variable names, none of those the launcher sets itself (worker.host.env's
    OWNED; the values: any text, NULs refused spec-wide)."""
    for key, value in (env.items() if env is not None else ()):
        if not EnvName.match(key):
            raise ValueError(f"{key!r} is not a valid environment variable name")
        owned = owner(key, value if isinstance(value, str) else "")
        if owned is not None:
            what, use = owned
            raise ValueError(f"{key}: mgpu-cluster sets {what} for every task itself, from {use}; a value in env "
                             "would override it, and the task would train in another group or on other devices "
                             f"than the launcher planned and its preflight checked. Remove it from env and use {use}")
    return env
