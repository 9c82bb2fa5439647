"""Reading cluster.toml: the file (UTF-8 TOML), then the spec's validation, each problem as one line
naming the file, the key's path and the reason ("did you mean ...?" for a typo)."""

from __future__ import annotations

import difflib
import re
import stat
import sys
from pathlib import Path
from typing import get_args

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from launcher.errors import SpecError
from launcher.spec.cluster import (ENGINE_TABLES, ONE_ENGINE, SPEC_KINDS, ClusterSpec, Host, HostOptions, HostsSpec,
                                   KubernetesSpec, Launch, Training)
from launcher.spec.kubernetes import Kubernetes
from launcher.spec.slurm import Slurm

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


Loc = tuple[int | str, ...]  # where pydantic found a problem


def _where(loc: Loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "function-before") or "[" in str(part):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


_SECTIONS: dict[str | int, type[BaseModel]] = {"hosts": Host, "defaults": HostOptions, "training": Training, "launch": Launch, "slurm": Slurm,
             "kubernetes": Kubernetes}


def _near_key(loc: Loc, kind: type[BaseModel]) -> str:
    """A ' (did you mean ...?)' hint for an unknown key, or '': among the keys of the table that holds it (also
    one inside a table: a toleration, a secret_env entry), Kubernetes' camelCase read as snake_case."""
    model = _SECTIONS.get(loc[0], kind) if len(loc) > 1 else kind
    for part in loc[1:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        types: list[object] = [field.annotation] if field else []
        while types:  # the table in Optional[list[Toleration]], dict[str, SecretKey], ...
            held = types.pop()
            if isinstance(held, type) and issubclass(held, BaseModel):
                model, types = held, []
            else:
                types += get_args(held)
    key = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", str(loc[-1])).lower()  # tolerationSeconds: toleration_seconds
    close = difflib.get_close_matches(key, list(model.model_fields), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _misplaced(loc: Loc, kind: type[BaseModel]) -> str:
    """A hint for a top-level key (`sync`) written below a [table] header, where TOML puts it into that table."""
    key, table = str(loc[-1]), str(loc[0])
    if len(loc) < 2 or key not in kind.model_fields or key in _SECTIONS:
        return ""
    header = f"[[{table}]]" if table == "hosts" else f"[{table}]"
    return (f": '{key}' belongs at the top of the file, above the first [table] line (every key after {header} "
            f"belongs to that table); move it up there")


def _message(err: ErrorDetails, kind: type[BaseModel]) -> str:
    loc = tuple(err["loc"])
    if err["type"] == "extra_forbidden":
        return f"{_where(loc)}: unknown key{_misplaced(loc, kind) or _near_key(loc, kind)}"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        msg = "required key is missing"
    elif err["type"] == "finite_number":
        msg = f"{err['input']} is not a finite number"
    return f"{_where(loc)}: {msg}" if loc else msg


def parse_spec(data: dict[str, object], source: str = "<spec>") -> ClusterSpec:
    """The spec of its kind: the one table of ENGINE_TABLES that `data` holds says which."""
    tables = [t for t in ENGINE_TABLES if t in data]
    if len(tables) != 1:
        raise SpecError(f"{source} is not a valid cluster spec:\n  {ONE_ENGINE}")
    kind = SPEC_KINDS[tables[0]]
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        lines = [_message(e, kind) for e in exc.errors()]
        raise SpecError(f"{source} is not a valid cluster spec:\n  " + "\n  ".join(lines)) from None


def load_spec(path: str | Path, base: Path | None = None) -> ClusterSpec:
    """The spec in `path`; a local host runs in `base` (default: the file's folder) unless its workdir says
    otherwise, and a relative workdir is relative to it, so that `check`, `logs` or `down` from another folder
    find the same files."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise SpecError(f"{path} is not a regular file (a FIFO, socket or device); give the path of a cluster.toml "
                        "file.")
    try:
        text = path.read_bytes().decode("utf-8")
    except IsADirectoryError:
        raise SpecError(f"{path} is a directory; give the path of a cluster.toml file.") from None
    except FileNotFoundError:
        raise SpecError(f"{path} does not exist; see cluster.example.toml for a starting point.") from None
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path} is not UTF-8 text (byte {exc.start}); save it as UTF-8.") from None
    except OSError as exc:
        raise SpecError(f"{path} cannot be read: {exc.strerror}.") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path} is not valid TOML: {exc}.") from None
    spec = parse_spec(data, str(path))
    if isinstance(spec, KubernetesSpec):  # a JobSet named by its file where it names none: the same name each render
        return spec.model_copy(update={"kubernetes": spec.kubernetes.named(path.stem)})
    if not isinstance(spec, HostsSpec):
        return spec
    root = base.resolve() if base else path.resolve().parent  # as the record keeps it (symlinks resolved)
    hosts = [h.model_copy(update={"workdir": str(root / h.workdir)}) if h.is_local and h.workdir
             and not h.workdir.startswith(("/", "~")) else h for h in spec.hosts]
    spec = spec.model_copy(update={"hosts": hosts})
    spec._folder = str(root)  # one rule for a local host: its default folder, and a relative workdir's base
    return spec
