"""The preflight's device and network verdicts, from what each task's host reported (pure).

MultiWorkerMirroredStrategy needs the same number of local replicas on every worker; a worker whose
address is loopback on its own host while its peers are elsewhere talks to them on the wrong
interface; a remote task gets NCCL_SOCKET_IFNAME naming the interface that carries its address.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from launcher.engines.base import TaskCheck
from worker.host.env import NCCL_IFNAME

Entry = Mapping[str, Any]  # Any: a task's entry of a doctor's report (its host's JSON), read key by key in from_report


@dataclass(frozen=True)
class TaskDevices:
    """What one task's host said: its replicas (None: not known, `unknown` says why) and the
    network interface that carries its address (None: not found), and whether that address is
    loopback there."""

    index: int
    label: str  # e.g. "task 0 (gpu-a:20000)"
    devices: int | None = None
    unknown: str | None = None
    interface: str | None = None
    loopback: bool = False
    address: str = ""
    ips: tuple[str, ...] = ()


def device_problems(tasks: list[TaskDevices]) -> dict[int, str]:
    """{task index: problem} where the workers would not train on equal numbers of devices."""
    if len(tasks) < 2:
        return {}
    problems = {t.index: (f"cannot count this task's devices: {t.unknown}. Every worker needs the same "
                          "number of local replicas (MultiWorkerMirroredStrategy): name the host's GPUs as a "
                          "list in 'gpus', or install nvidia-smi there")
                for t in tasks if t.devices is None}
    known = [t for t in tasks if t.devices is not None]
    if len({t.devices for t in known}) > 1:
        listing = ", ".join(f"{t.label}: {t.devices}" for t in known)
        paragraph = (f"the workers would train on different numbers of devices ({listing}). "
                     "MultiWorkerMirroredStrategy needs the same number of local replicas on every worker: "
                     "give every host as many GPUs with its 'gpus' setting (CUDA_VISIBLE_DEVICES), or the same "
                     "[training] local_replicas on CPU hosts")
        for t in known:
            problems.setdefault(t.index, paragraph)
    return problems


def loopback_warnings(tasks: list[TaskDevices]) -> list[str]:
    """A line per task whose address is loopback on its own host while some peer's is not."""
    if not any(not t.loopback for t in tasks):
        return []
    return [f"warning: {t.label}: its address {t.address!r} resolves to a loopback address on its host "
            f"({', '.join(t.ips)}) while its peers are on other hosts; they cannot reach it there, and NCCL "
            "would pick the wrong interface: use the host's network name or IP in the spec (or fix its "
            "/etc/hosts entry)" for t in tasks if t.loopback]


def nccl_env(tasks: Iterable[TaskDevices], remote: Callable[[int], bool],
             env: Callable[[int], dict[str, str]]) -> dict[int, str]:
    """{task index: interface} to set as NCCL_SOCKET_IFNAME: remote tasks whose interface was found
    and whose env does not set it already."""
    return {t.index: t.interface for t in tasks
            if t.interface and remote(t.index) and NCCL_IFNAME not in env(t.index)}


def from_report(index: int, label: str, address: str, entry: Entry) -> TaskDevices:
    """A task's entry of a worker.preflight.doctor report as TaskDevices."""
    net = entry.get("network") or {}
    return TaskDevices(index=index, label=label, devices=entry.get("devices"), unknown=entry.get("devices_unknown"),
                       interface=net.get("interface"), loopback=bool(net.get("loopback")), address=address,
                       ips=tuple(net.get("ips") or ()))


def apply(checks: list[TaskCheck], entries: Mapping[int, Entry], say: Callable[[str], None]) -> None:
    """The verdicts onto the preflight's checks (problems), its output (warnings) and the remote
    tasks' env (NCCL_SOCKET_IFNAME). `entries`: each reporting task's doctor entry, by index."""
    by_index = {c.plan.index: c for c in checks}
    tasks = [from_report(i, by_index[i].plan.label, by_index[i].plan.host.address, e)
             for i, e in sorted(entries.items()) if "devices" in e]
    if len(tasks) != len(checks):  # a host that did not report (it has its own problem already)
        return
    for i, problem in device_problems(tasks).items():
        by_index[i].problems.append(problem)
    for line in loopback_warnings(tasks):
        say(line)
    found = nccl_env(tasks, lambda i: not by_index[i].plan.host.is_local, lambda i: by_index[i].plan.env)
    for i, interface in found.items():
        by_index[i].env[NCCL_IFNAME] = interface  # a finding: kept in the run record, given at each start
