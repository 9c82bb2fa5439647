"""The on-host entries' arguments, defined once: the launcher writes them (`argv()`), the entry reads them
(`parse()`). Each field is an option (`run_dir` is --run-dir; a bool is a switch), the program follows `--`.

worker.task.supervised (local and SSH hosts), worker.task.slurm (a Slurm step) and worker.task.pod (a
Kubernetes pod) take these; launcher/plan.py, engines/slurm/script.py and engines/kubernetes/render.py write them.
"""

from __future__ import annotations

import argparse
import enum
import types
import typing
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import ClassVar, TypeVar, Union

from worker.host.env import Backend

GRACE_S = 1.0  # seconds from a stop (TERM) to KILL where the launcher gives none
PROGRAM = "program"

E = TypeVar("E", bound="Entry")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(c) for c in text.split(",") if c.strip())


def _kind(hint: object) -> object:
    """The type an option holds: `int` of `int | None`."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _word(value: object) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


@dataclass(frozen=True, kw_only=True)
class Entry:
    """An entry's arguments. A field left at None or False is not written; one marked `quiet` is not written at its
    default either (the command stays as it was without it)."""

    module: ClassVar[str]
    program: tuple[str, ...]

    def argv(self) -> list[str]:
        """The arguments after `python -m <module>`."""
        out: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == PROGRAM or value is None or value is False or (f.metadata.get("quiet") and value == f.default):
                continue
            out += [_flag(f.name)] if value is True else [_flag(f.name), _word(value)]
        return [*out, "--", *self.program]

    @classmethod
    def parser(cls, description: str | None = None) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog=f"python -m {cls.module}", description=description,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.name != PROGRAM:
                _option(parser, f, _kind(hints[f.name]))
        parser.add_argument(PROGRAM, nargs=argparse.REMAINDER)
        return parser

    @classmethod
    def parse(cls: type[E], argv: list[str] | None, description: str | None = None) -> E:
        """The arguments of `argv` (None: the command line); argparse's usage error (exit 2) where they do not fit,
        or where no program follows."""
        parser = cls.parser(description)
        args = parser.parse_args(argv)
        program = args.program[1:] if args.program[:1] == ["--"] else args.program
        if not program:
            parser.error("give the program to run after --")
        given = {f.name: getattr(args, f.name) for f in fields(cls) if f.name != PROGRAM}
        return cls(program=tuple(program), **given)


def _option(parser: argparse.ArgumentParser, f: Field[object], kind: object) -> None:
    helps = str(f.metadata.get("help", ""))
    default = None if f.default is MISSING else f.default
    required = f.default is MISSING
    if kind is bool:
        parser.add_argument(_flag(f.name), action="store_true", help=helps)
    elif isinstance(kind, type) and issubclass(kind, enum.Enum):
        parser.add_argument(_flag(f.name), type=kind, default=default, choices=list(kind), help=helps)
    elif typing.get_origin(kind) is tuple:
        parser.add_argument(_flag(f.name), type=_ints, default=default, help=helps)
    elif kind in (int, float, str):
        parser.add_argument(_flag(f.name), type=kind, default=default, required=required, help=helps)
    else:  # pragma: no cover - a field of a kind the entries do not use
        raise TypeError(f"{f.name}: options of type {kind!r} are not supported")


def _opt(default: object = MISSING, help: str = "", quiet: bool = False) -> typing.Any:  # Any: as field() is typed
    return field(default=default, metadata={"help": help, "quiet": quiet})


@dataclass(frozen=True, kw_only=True)
class SupervisedArgs(Entry):
    """worker.task.supervised: our supervisor of one task on a local or SSH host."""

    module: ClassVar[str] = "worker.task.supervised"
    run_dir: str = _opt(help="the task's folder on this host")
    attempt: int = 0
    port: int | None = _opt(None, "the task's TF port: refuse to start if taken")
    grace: float = _opt(GRACE_S, "seconds between TERM and KILL")
    preempt_grace: float | None = _opt(None, "seconds between a notice (TERM/USR1 to us) and KILL (default: --grace)")
    env_stdin: bool = _opt(False, "read the task's environment from stdin's first line")
    cpus: tuple[int, ...] = _opt((), "comma-separated cores to pin the task to", quiet=True)
    lifeline: float | None = _opt(None, "stop the task when stdin stays silent this many seconds")
    warm: bool = _opt(False, "fork the attempt from the task's fork server (worker.task.forkserver), started where "
                             "none runs")
    standby: bool = _opt(False, "with --warm: hold the fork server now and start the attempt when the line 'go' "
                                "comes on stdin")
    detach: bool = _opt(False, "keep running when stdin closes")


@dataclass(frozen=True, kw_only=True)
class SlurmArgs(Entry):
    """worker.task.slurm: one task of a Slurm step, on its node."""

    module: ClassVar[str] = "worker.task.slurm"
    run_dir: str = _opt(help="the run's folder, shared by every node")
    attempt: int = 0
    grace: float = _opt(GRACE_S, "INT/HUP to KILL, seconds")
    preempt_grace: float | None = _opt(None, "TERM/USR1 (notice) to KILL, seconds")
    lifeline: float = _opt(0.0, "stop when the launcher's lifeline is this old", quiet=True)
    port: int | None = _opt(None, "TF port (default: from the job id)")


@dataclass(frozen=True, kw_only=True)
class PodArgs(Entry):
    """worker.task.pod: one task of a JobSet, in its pod."""

    module: ClassVar[str] = "worker.task.pod"
    run_id: str = _opt(help="the run's id (the JobSet's name)")
    run_dir: str = _opt(help="the run's folder (shared storage, or the pod's)")
    hosts: str = _opt(help="the workers' host names, with {i} for the index")
    workers: int = _opt(help="how many workers the JobSet runs")
    port: int = _opt(help="the TF port of every pod")
    grace: float = GRACE_S
    preempt_grace: float | None = None
    safe_path: bool = _opt(False, "PROGRAM keeps PYTHONSAFEPATH (our runner)")
    backend: Backend = _opt(Backend.TENSORFLOW, "what trains", quiet=True)
    cpu_devices: int | None = _opt(None, "on JAX: XLA's devices on the CPU")
