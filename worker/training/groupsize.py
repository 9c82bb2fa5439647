"""The group a task finds itself in, against the one its launcher planned (MGPU_NUM_WORKERS, by the one environment
builder): a task in a group of another size stops at once, naming both, whatever caused it (a user's TF_CONFIG or
KERAS_* variables, a host's XLA_FLAGS, an outer environment), before it trains alone or hangs in a collective."""

from __future__ import annotations

import os
from typing import Mapping

from worker.training.errors import SettingError, WorkerError
from worker.host.env import NUM_WORKERS

PLANNED = NUM_WORKERS  # worker.host.env.task_environment's


class OtherGroup(WorkerError):
    """The task's group (its workers, or its replicas) is not the one its launcher planned."""


def planned_workers(environ: Mapping[str, str] | None = None) -> int | None:
    """The number of workers the launcher planned for this task's group; None where no launcher started it."""
    text = (os.environ if environ is None else environ).get(PLANNED, "").strip()
    if not text:
        return None
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise SettingError(f"{PLANNED} is {text!r}, not a number of workers: mgpu-cluster sets it for every task; "
                           "unset it where you start the training yourself")
    return int(text)


def check_workers(found: int, said_by: str, environ: Mapping[str, str] | None = None) -> None:
    """Stops (OtherGroup) when `found` workers, as `said_by` says, are not the workers the launcher planned."""
    planned = planned_workers(environ)
    if planned is not None and found != planned:
        raise OtherGroup(f"this task is in a group of {found} worker(s) ({said_by}), but mgpu-cluster planned "
                         f"{planned} ({PLANNED}): it would train {'alone' if found == 1 else 'in another group'}, "
                         "not with the others. Something in its environment overrides the launcher's (a spec's env "
                         "or the host's own setting of TF_CONFIG, KERAS_BACKEND or KERAS_DISTRIBUTION_*): remove it "
                         "and start the run again")


def check_replicas(total: int, workers: int, local: int, said_by: str) -> None:
    """Stops (OtherGroup) when the group's `total` replicas are not `workers` x this task's `local` ones: a task
    elsewhere has another number of devices than this one, and every task must have as many."""
    if total != workers * local:
        raise OtherGroup(f"the group has {total} replica(s) in sync ({said_by}), but {workers} worker(s) with "
                         f"{local} each, as this task has, make {workers * local}: another task has another number of "
                         "devices. Every task needs as many: set [training] local_replicas (CPU) or each host's "
                         "gpus, and take XLA_FLAGS and CUDA_VISIBLE_DEVICES out of the hosts' environment")
