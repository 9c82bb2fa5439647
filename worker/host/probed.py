"""What a task's host says of it now: the row worker.task.probe writes (and a scheduler's engine makes from its
records), read back by the launcher once, where it arrives, each field checked (anything else: not known)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from worker.host.devices import GpuFigures
from worker.host.protocol import real

TEXT_MAX = 4096  # a path, a state word or an error: longer is not one


@dataclass(frozen=True)
class ProbeRow:
    dir: str | None = None  # the task's folder on its host
    pid: int | None = None
    alive: bool = False
    status: str | None = None  # psutil's word for the process (running, sleeping, stopped, ...)
    exit_code: int | None = None  # as the task's folder keeps it
    progress: dict[str, Any] | None = None  # Any: the training's own JSON, typed where shown (launcher.run.progress)
    cpu_percent: float | None = None
    rss: int | None = None  # bytes, the task's process tree
    gpus: list[GpuFigures] | None = None  # its own GPUs, device-wide figures
    time: float | None = None  # when the host looked (its clock)
    # what a scheduler's engine knows besides (launcher.engines.slurm.status)
    host: str | None = None  # the node it landed on
    port: int | None = None
    state: str | None = None  # a state the engine knows better (a task whose job is still queued: pending)
    job: dict[str, object] | None = None  # the scheduler's job as `status` shows it
    error: str | None = None  # why the host could not stop it (a stop's row)

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def parse(cls, data: object) -> ProbeRow:
        """The row of a host's JSON (untrusted): each field of the kind it must be, else not known."""
        if not isinstance(data, dict):
            return cls(error="not a task's row")
        gpus = data.get("gpus")
        found = [GpuFigures.parse(g) for g in gpus] if isinstance(gpus, list) else []
        job, progress = data.get("job"), data.get("progress")
        return cls(dir=_text(data.get("dir")), pid=_whole(data.get("pid")), alive=data.get("alive") is True,
                   status=_text(data.get("status")), exit_code=_whole(data.get("exit_code"), signed=True),
                   progress=progress if isinstance(progress, dict) else None,
                   cpu_percent=real(data.get("cpu_percent")), rss=_whole(data.get("rss")),
                   gpus=[g for g in found if g is not None] or None, time=real(data.get("time")),
                   host=_text(data.get("host")), port=_whole(data.get("port")), state=_text(data.get("state")),
                   job={str(k): v for k, v in job.items()} if isinstance(job, dict) else None,
                   error=_text(data.get("error")))


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and len(value) <= TEXT_MAX else None


def _whole(value: object, signed: bool = False) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and (signed or value >= 0) and abs(value) < 2**63:
        return value
    return None
