"""The task's place in its group under Keras 3 on JAX: the CPU split into devices (before JAX is imported), the
group joined (`keras.distribution.initialize`), DataParallel over every device, and small values gathered."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, MutableMapping

from worker.training.errors import SettingError, WorkerError
from worker.training.groupsize import check_replicas, check_workers
from worker.host.env import HOST_ADDRESS, NUM_PROCESSES, PROCESS_ID, TASK_INDEX
from worker.host.env import XLA_CPU_DEVICES as HOST_DEVICES_FLAG
from worker.host.env import XLA_FLAGS
from worker.host.protocol import EXIT_PREEMPTED


def split_host(local_replicas: int | None, environ: MutableMapping[str, str] = os.environ) -> None:
    """N > 1 local replicas: XLA's host platform as N devices, unless XLA_FLAGS names a count already (the task's
    environment does). Only before JAX is imported; with GPUs it changes nothing (JAX trains on them)."""
    flags = environ.get(XLA_FLAGS, "")
    if local_replicas and local_replicas > 1 and HOST_DEVICES_FLAG not in flags:
        environ[XLA_FLAGS] = f"{flags} {HOST_DEVICES_FLAG}={local_replicas}".strip()


def _whole(name: str, default: int, environ: MutableMapping[str, str]) -> int:
    text = environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise SettingError(f"{name} is {text!r}, not a whole number: set it as keras.distribution.initialize "
                           "reads it, or unset it to train in one process")
    return int(text)


def task_index(environ: MutableMapping[str, str] = os.environ) -> int:
    """MGPU_TASK_INDEX where the launcher set it, else KERAS_DISTRIBUTION_PROCESS_ID, else 0."""
    return _whole(TASK_INDEX, _whole(PROCESS_ID, 0, environ), environ)


@dataclass(frozen=True)
class Group:
    """This process among the group's: its index (0 is the chief), how many, and the devices."""

    index: int
    size: int
    local_devices: int
    devices: int  # over every process: the replicas in sync

    @property
    def chief(self) -> bool:
        return self.index == 0

    def gather(self, value: int) -> list[int]:
        """Every process's `value`, in process order (a collective: every process must call it)."""
        if self.size <= 1:
            return [int(value)]
        import numpy as np
        from jax.experimental import multihost_utils

        return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.int64(value))).reshape(-1)]


def join(keras: Any, local_replicas: int | None) -> Group:
    """Joins the group that KERAS_DISTRIBUTION_* describe (none, or one process: train alone) and sets a
    DataParallel distribution over every device of every process."""
    import jax

    size = _whole(NUM_PROCESSES, 1, os.environ)
    check_workers(size, f"keras.distribution: {NUM_PROCESSES} {os.environ.get(NUM_PROCESSES, '').strip() or 'unset'}")
    if size > 1:
        # our own SIGTERM handler takes notices (worker.keras3.checkpoints); JAX's would replace it
        # jax's Config.update has no annotations
        jax.config.update("jax_enable_preemption_service", False)  # type: ignore[no-untyped-call]
        if os.environ.get(HOST_ADDRESS):
            bind_gloo(os.environ[HOST_ADDRESS])
        try:
            keras.distribution.initialize()
        except AssertionError:  # Keras' seed all-reduce (a pmap over every process's CPUs) where their devices differ
            check_replicas(jax.device_count(), jax.process_count(), jax.local_device_count(), "jax.device_count()")
            raise
    local = jax.local_device_count()
    if local_replicas and local != local_replicas:
        raise WorkerError(f"--local-replicas {local_replicas}, but this task has {local} {jax.default_backend()} "
                          f"device(s): with GPUs, make it the number of visible GPUs; on CPU, set XLA_FLAGS="
                          f"{HOST_DEVICES_FLAG}={local_replicas} (or leave XLA_FLAGS to the runner)")
    devices = keras.distribution.list_devices()
    check_replicas(len(devices), jax.process_count(), local, "keras.distribution.list_devices()")
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices, auto_shard_dataset=False))
    return Group(index=jax.process_index(), size=jax.process_count(), local_devices=local, devices=len(devices))


def bind_gloo(address: str) -> None:
    """JAX makes gloo's TCP collectives without a host name, so gloo listens where this host's name resolves: on
    many hosts 127.0.0.1 or 127.0.1.1, which the peers cannot reach (Connection refused). Give it the task's own
    address. jaxlib's function takes `hostname=`, but JAX does not pass it: a private API, checked so that a JAX
    that moves it fails here, loudly, not in a peer's timeout."""
    import functools

    from jax._src import xla_bridge

    make = getattr(getattr(xla_bridge, "_jax", None), "make_gloo_tcp_collectives", None)
    if make is None or "hostname" not in (make.__doc__ or ""):
        raise WorkerError("this JAX no longer builds gloo's collectives as mgpu-cluster expects "
                          "(jax._src.xla_bridge._jax.make_gloo_tcp_collectives(hostname=)); pin jax to a version "
                          "mgpu-cluster supports (0.10.x)")
    if not isinstance(make, functools.partial):  # once per process
        bound = functools.partial(make, hostname=address)
        # a private module that xla_bridge imports and does not export (checked above)
        xla_bridge._jax.make_gloo_tcp_collectives = bound  # type: ignore[attr-defined]


@contextlib.contextmanager
def alone(keras: Any) -> Iterator[None]:
    """Inside, no distribution: what one process does alone (the chief's saves) creates no variable laid out over
    every device, which JAX would check against the other processes (a collective they are not in)."""
    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        yield
    finally:
        keras.distribution.set_distribution(distribution)


def exit_code_alone(main: Callable[[], int]) -> int:
    """`main()`'s exit code; a process that fails (any other code than 0 or 75, or an exception) leaves at once.
    JAX's exit waits at its shutdown barrier for every peer, and a peer blocked in a collective with this one
    never comes: the task core would see this exit only when JAX's timeouts end the peers."""
    try:
        code = main()
    except SystemExit as exc:  # argparse's
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 (shown as Python would, then gone)
        traceback.print_exc()
        code = 1
    if code not in (0, EXIT_PREEMPTED):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
