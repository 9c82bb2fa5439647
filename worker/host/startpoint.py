"""Where a run starts: fresh, or from run X's backup at epoch N, step S. The checkpoint folder's owner file (the
run whose backup it holds, and where that backup stands) is read here by the doctor, the runner and the launcher,
and one rule says which run may take which backup. No TensorFlow import; the folder's files are untrusted."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from worker.host.env import RUN_ID

OWNER = "owner.json"  # {"run", "epoch", "step", "steps_done"}: written by the chief with each backup
FINISHED = "finished.json"  # {"run": id} whose training ended, every task's model saved (worker.training.checkpoints)
BACKUPS = ("chief", "keras3")  # the backup's folder in the checkpoint folder: tf_keras's, Keras 3's
SPARES = "spares"  # spares/<task>: a task's whole copy of each backup on a host other than the chief's (the same layout)
FILE_MAX = 4096  # bytes of an owner or finished file read


class Refused(Exception):
    """A run that must not start from what the checkpoint folder holds; the message says why and what to do."""


@dataclass(frozen=True)
class StartPoint:
    """Where a run starts: `run` None is fresh; else run `run`'s backup, trained up to `steps_done` global steps,
    resumed at step `step` (1-based) of epoch `epoch`."""

    run: str | None = None
    epoch: int = 1
    step: int = 1
    steps_done: int = 0

    @property
    def fresh(self) -> bool:
        return self.run is None

    def words(self) -> str:
        return "starts fresh" if self.fresh else f"resumes run {self.run} at epoch {self.epoch}, step {self.step}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Found:
    """What a checkpoint folder holds: a backup, the run that owns it (None: no owner file, or one unreadable),
    and the run whose training finished there (finished.json)."""

    folder: str
    backup: bool = False
    owner: StartPoint | None = None
    finished: str | None = None
    live: bool = False  # the owner's run has processes on this host now: it trains there (or is between attempts)

    def to_json(self) -> dict[str, Any]:
        return {"folder": self.folder, "backup": self.backup, "finished": self.finished,
                "owner": self.owner.to_json() if self.owner else None, "live": self.live}

    @classmethod
    def from_json(cls, data: object) -> "Found | None":
        """As `to_json` wrote it (a doctor's report: untrusted); None for anything else."""
        if not isinstance(data, dict) or not isinstance(data.get("folder"), str):
            return None
        finished = data.get("finished")
        return cls(folder=data["folder"], backup=data.get("backup") is True, owner=_owner(data.get("owner")),
                   finished=finished if isinstance(finished, str) and finished else None, live=data.get("live") is True)


def _owner(data: object) -> StartPoint | None:
    if not isinstance(data, dict) or not isinstance(data.get("run"), str) or not data["run"]:
        return None
    numbers = [data.get(k) for k in ("epoch", "step", "steps_done")]
    counts = [n for n in numbers if isinstance(n, int) and not isinstance(n, bool) and n >= 0]
    if len(counts) != len(numbers):
        return None
    return StartPoint(data["run"][:200], *counts)


def _json(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read(FILE_MAX).decode("utf-8"))
    except (OSError, ValueError):
        return None


def look(folder: str, claims: bool = False) -> Found:
    """What `folder` holds (nothing where it does not exist); with `claims` (where a run's start is decided: the
    doctor, the runners), whether its owner's run lives on this host (a scan of its processes)."""
    def has_files(path: str) -> bool:
        try:
            return os.path.isdir(path) and bool(os.listdir(path))
        except OSError:
            return False

    from worker.host.procs import run_lives

    finished = _json(os.path.join(folder, FINISHED))
    run = finished.get("run") if isinstance(finished, dict) else None
    owner = _owner(_json(os.path.join(folder, OWNER)))
    return Found(folder=folder, backup=any(has_files(os.path.join(folder, b)) for b in BACKUPS), owner=owner,
                 finished=run if isinstance(run, str) and run else None,
                 live=claims and owner is not None and owner.run is not None and owner.run != os.environ.get(RUN_ID)
                 and run_lives(owner.run))


def look_first(folders: list[str], claims: bool = False) -> Found:
    """What the run starts from, of `folders` (its checkpoint folder, then the one --resume-from adopts): the
    first that holds files, as the runner adopts (worker.training.config.adopt_checkpoint); `claims`: as look's."""
    for folder in folders:
        try:
            if os.path.isdir(folder) and os.listdir(folder):
                return look(folder, claims)
        except OSError:
            continue
    return look(folders[0], claims)


def write_owner(folder: str, point: StartPoint) -> None:
    """The owner file, whole (a rename); a failure to write is left to the backup's own (a full disk)."""
    path = os.path.join(folder, OWNER)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(f"{path}.partial", "w", encoding="utf-8") as f:
            json.dump(point.to_json(), f)
        os.replace(f"{path}.partial", path)
    except OSError:
        pass


def decide(found: Found, run: str, resume: str | None, epochs: int | None, spec: str = "SPEC") -> StartPoint:
    """Where run `run` starts from what `found` holds; `resume`: the run it was asked to go on from (`up --resume
    RUN`), `epochs`: how many it trains (None: not known here), `spec`: its spec file as the user names it.
    Refused: another run's backup or finished training not asked for, a resumed run with nothing left to train.
    Its own backup (a restart) is resumed."""
    where = found.folder
    fresh = ("or start fresh: remove that folder (on every host that has it) or set [training] checkpoint_dir to "
             "another one")
    if found.owner is not None and found.live and found.owner.run != run:  # claimed by a run that trains now
        raise Refused(f"the checkpoint folder {where} is in use by run {found.owner.run}, which is running on this "
                      "host now; two runs never share a checkpoint folder (one would restore the other's backup "
                      f"and train on from it). Wait for that run to end or stop it ('mgpu-cluster down "
                      f"{found.owner.run}'), or set [training] checkpoint_dir to another folder.")
    if found.backup:
        owner = found.owner
        if owner is None:
            raise Refused(f"the checkpoint folder {where} holds a backup that no run claims (it has no {OWNER}: "
                          "written by hand, or by an older mgpu-cluster), and a new run does not take a checkpoint "
                          f"it was not given; nothing was started. Remove that folder to start fresh, or set "
                          "[training] checkpoint_dir to another one.")
        if owner.run == run:
            return owner
        if owner.run != resume:
            raise Refused(f"the checkpoint folder {where} holds run {owner.run}'s backup (at epoch {owner.epoch}, "
                          f"step {owner.step}), and a new run does not take another run's checkpoint unless asked; "
                          f"nothing was started. Go on from it with 'mgpu-cluster up {spec} --resume {owner.run}', "
                          f"{fresh}.")
        if epochs is not None and owner.epoch > epochs:
            raise Refused(f"--resume {owner.run}: its backup in {where} is at the end of epoch {owner.epoch - 1}, "
                          f"and this run trains {epochs} epoch(s): nothing is left to train, so it is refused (not "
                          f"run to a 'succeeded' that trained nothing). Give more epochs ('-- --epochs N') to go "
                          f"on training it, {fresh}.")
        return owner
    if found.finished and found.finished != run:
        if found.finished == resume:
            raise Refused(f"--resume {resume}: that run's training finished ({FINISHED} in {where}) and its backup "
                          f"was removed: nothing is left to train, so it is refused; its model is saved. To train "
                          f"again, {fresh.removeprefix('or ')}.")
        raise Refused(f"the checkpoint folder {where} holds run {found.finished}'s finished training ({FINISHED}), "
                      "and a new run does not train into another run's checkpoint folder unless asked; nothing was "
                      f"started. {fresh.removeprefix('or ').capitalize()}.")
    return StartPoint()


@dataclass(frozen=True)
class Options:
    """The built-in runner's options that say where a run starts, as a task's command line gives them."""

    checkpoint_dir: str | None = None
    resume_from: str | None = None
    resume_run: str | None = None
    epochs: int | None = None

    @property
    def folders(self) -> list[str]:
        """The folders whose contents a run starts from: its checkpoint folder, and the one --resume-from adopts
        (where the first is empty); none where the run's own new folder is its checkpoint folder."""
        return [f for f in (self.checkpoint_dir, self.resume_from) if f]


def options(argv: Iterable[str]) -> Options:
    """The last of each option in `argv` (as argparse takes it); --flag=value too."""
    found: dict[str, str] = {}
    argv = list(argv)
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in ("--checkpoint-dir", "--resume-from", "--resume-run", "--epochs"):
            if eq:
                found[name] = value
            elif i + 1 < len(argv):
                found[name] = argv[i + 1]
    epochs = found.get("--epochs", "")
    return Options(found.get("--checkpoint-dir"), found.get("--resume-from"), found.get("--resume-run"),
                   int(epochs) if epochs.isdigit() else None)
