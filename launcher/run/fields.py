"""A dataclass made from JSON that may be corrupt: each field of its declared type and range, or a TypeError
naming the field (so a damaged record is refused where it is read, not deep inside `status`). Every number is
finite and within NUMBER_MAX, or within the Range its field's type is annotated with (Time, Count, ...)."""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Callable, Mapping, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


@dataclass(frozen=True)
class Range:
    """The values a number field takes, both ends included (in its type's Annotated metadata)."""

    low: float
    high: float


class OutOfRange(TypeError):
    """A number of the right type that is not finite, or not within its field's range."""


NUMBER_MAX = 2**53  # a number field without a Range: finite and at most this large (what a JSON reader keeps exact)
TIME_MAX = 253402300799.0  # 9999-12-31 23:59:59 UTC: the last second time.localtime and datetime show
Time = Annotated[float, Range(0.0, TIME_MAX)]  # seconds since the epoch
Seconds = Annotated[float, Range(0.0, TIME_MAX)]  # a duration
Count = Annotated[int, Range(0, 2**31 - 1)]  # indices, attempts, restarts: one run's counts
Pid = Annotated[int, Range(1, 2**22)]  # Linux' largest pid_max
Port = Annotated[int, Range(0, 65535)]
Percent = Annotated[float, Range(0.0, 100.0 * 8192)]  # of one CPU, over all of a machine's (Linux' NR_CPUS)

D = TypeVar("D", bound="DataclassInstance")
# Any: a field's JSON as read (untrusted), which its converter checks
Convert = Mapping[str, Callable[[Any], object]]


def build(cls: type[D], data: object, convert: Convert | None = None) -> D:
    """cls(**data) with every field checked; `convert` turns a field's JSON into its value (and checks it: the
    field's own reader, such as a record within the record)."""
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__}: not a JSON object")
    hints = typing.get_type_hints(cls, include_extras=True)
    convert = convert or {}
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            value = data[f.name]
            kwargs[f.name] = convert[f.name](value) if f.name in convert else \
                _checked(f"{cls.__name__}.{f.name}", value, hints[f.name])
    return cls(**kwargs)


def _checked(name: str, value: Any, want: object) -> Any:  # Any: untrusted JSON in; out, of the type `want` says
    origin, args = typing.get_origin(want), typing.get_args(want)
    if origin is Annotated:
        value = _checked(name, value, args[0])
        for bound in (m for m in args[1:] if isinstance(m, Range)):
            if not bound.low <= value <= bound.high:
                raise OutOfRange(f"{name}: {value!r:.40} is not within {bound.low:g}..{bound.high:g}")
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in args:
            try:
                return _checked(name, value, option)
            except (TypeError, ValueError) as exc:
                errors.append(exc)
        said = f"{name}: {type(value).__name__} is not {want}"
        raise next((e for e in errors if isinstance(e, OutOfRange)), TypeError(said))
    if want is type(None):
        if value is None:
            return value
    elif isinstance(want, type) and issubclass(want, enum.Enum):
        return want(value)  # ValueError for a value not of the enum
    elif want in (float, int):
        if isinstance(value, (float, int) if want is float else int) and not isinstance(value, bool):
            if not (abs(value) <= NUMBER_MAX and math.isfinite(value)):  # NaN compares False; 10**400 has no float
                raise OutOfRange(f"{name}: {value!r:.40} is not a finite number within {NUMBER_MAX:g}")
            return value
    elif origin is dict:
        if isinstance(value, dict):
            return {_checked(f"{name} key", k, args[0]): _checked(f"{name}[{k!r}]", v, args[1])
                    for k, v in value.items()} if args else value
    elif origin is list:
        if isinstance(value, list):
            return [_checked(f"{name}[]", v, args[0]) for v in value] if args else value
    elif typing.is_typeddict(want):
        if isinstance(value, dict):
            keys, required = typing.get_type_hints(want, include_extras=True), getattr(want, "__required_keys__")
            missing = next(iter(required - value.keys()), None)
            if missing is not None:
                raise TypeError(f"{name}: {missing!r} is missing")
            # a key it does not know (another version's) is left out, not read
            return {k: _checked(f"{name}[{k!r}]", v, keys[k]) for k, v in value.items() if k in keys}
    elif dataclasses.is_dataclass(want) and isinstance(want, type) and isinstance(value, dict):
        return build(want, value)  # a record within the record
    elif isinstance(want, type) and isinstance(value, origin or want):
        return value
    raise TypeError(f"{name}: {type(value).__name__} is not {getattr(want, '__name__', want)}")
