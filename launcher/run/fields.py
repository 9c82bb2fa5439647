"""A dataclass made from JSON that may be corrupt: each field of its declared type, or a TypeError
naming the field (so a damaged record is refused where it is read, not deep inside `status`)."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any


def build(cls: type, data: Any, convert: dict[str, Any] | None = None):
    """cls(**data) with every field checked; `convert` turns a field's JSON into its value first."""
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__}: not a JSON object")
    hints = typing.get_type_hints(cls)
    convert = convert or {}
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            value = convert[f.name](data[f.name]) if f.name in convert else data[f.name]
            kwargs[f.name] = _checked(f"{cls.__name__}.{f.name}", value, hints[f.name])
    return cls(**kwargs)


def _checked(name: str, value: Any, want: Any) -> Any:
    origin, args = typing.get_origin(want), typing.get_args(want)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                return _checked(name, value, option)
            except (TypeError, ValueError):
                continue
        raise TypeError(f"{name}: {type(value).__name__} is not {want}")
    if want is type(None):
        if value is None:
            return value
    elif isinstance(want, type) and issubclass(want, enum.Enum):
        return want(value)  # ValueError for a value not of the enum
    elif want is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    elif want is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif origin is dict:
        if isinstance(value, dict):
            return {_checked(f"{name} key", k, args[0]): _checked(f"{name}[{k!r}]", v, args[1])
                    for k, v in value.items()} if args else value
    elif origin is list:
        if isinstance(value, list):
            return [_checked(f"{name}[]", v, args[0]) for v in value] if args else value
    elif isinstance(want, type) and isinstance(value, origin or want):
        return value
    raise TypeError(f"{name}: {type(value).__name__} is not {getattr(want, '__name__', want)}")
