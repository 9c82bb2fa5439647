"""What every part of the spec shares: the strict frozen model, value types, and checks of names and text."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

LOCAL_ADDRESSES = frozenset({"localhost", "127.0.0.1"})

Port = Annotated[int, Field(ge=1, le=65535)]
PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
EnvName = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
Entrypoint = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def nul_at(data, where: str = "") -> str | None:
    """The key path of the first string (key or value) in `data` that holds a NUL, or None. A NUL reaches
    no process (not in an argument, a path, nor the environment), so no spec value may hold one."""
    if isinstance(data, str):
        return where if "\x00" in data else None
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
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


def env_names(env):
    """An env table's names must be variable names (the values: any text, NULs refused spec-wide)."""
    for key in env or {}:
        if not EnvName.match(key):
            raise ValueError(f"{key!r} is not a valid environment variable name")
    return env
