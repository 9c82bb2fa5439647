"""What one host gives a task: how many devices it will train on, its GPUs' use and memory now, and which
network interface carries its address (for NCCL_SOCKET_IFNAME). No TensorFlow import."""

from __future__ import annotations

import ipaddress
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from worker.host.system import child_setup


@dataclass(frozen=True)
class GpuFigures:
    """One GPU as nvidia-smi tells it now: device-wide figures (every process on it), None where it says none."""

    index: int
    util: int | None  # percent of the last sample period a kernel ran
    memory_used: int | None  # MiB
    memory_total: int | None  # MiB

    @classmethod
    def parse(cls, data: object) -> "GpuFigures | None":
        """One from its JSON (a task's supervisor sent it: untrusted), or None where it is not one."""
        if not isinstance(data, dict) or set(data) != {"index", "util", "memory_used", "memory_total"}:
            return None
        values = [data["index"], data["util"], data["memory_used"], data["memory_total"]]
        if not all(v is None or type(v) is int and 0 <= v < 10 ** _WHOLE_MAX for v in values) or values[0] is None:
            return None
        return cls(*values)


GPU_FIGURES = "index,utilization.gpu,memory.used,memory.total"
GPUS_MAX = 64  # GPUs of one task a record carries: more is no host's
GPU_EVERY_S = 10.0  # nvidia-smi takes tens of ms of a core: a task's GPUs are read this seldom
_WHOLE_MAX = 12  # digits of a figure: longer is no figure nvidia-smi gives


def _smi(query: str, timeout: float) -> subprocess.CompletedProcess[str] | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                              errors="replace", preexec_fn=child_setup(signal.SIGKILL))  # never outlives us
    except (OSError, subprocess.TimeoutExpired):
        return None


def _whole(cell: str) -> int | None:
    """A whole number from a cell of nvidia-smi's CSV (its output is not trusted): None for "[N/A]",
    "[Not Supported]" or anything else."""
    cell = cell.strip()
    return int(cell) if cell.isascii() and cell.isdigit() and len(cell) <= _WHOLE_MAX else None


def nvidia_smi(query: str, timeout: float = 20) -> list[int] | None:
    """One whole number per GPU for `query` ("index", "utilization.gpu"), or None where nvidia-smi is
    missing, hangs past `timeout` or cannot be run."""
    done = _smi(query, timeout)
    if done is None:
        return None
    return [int(x) for x in done.stdout.split() if _whole(x) is not None]


def gpu_figures(timeout: float = 20) -> list[GpuFigures] | None:
    """Every GPU's use and memory, from one nvidia-smi call; None where nvidia-smi is missing, hangs past
    `timeout`, fails or cannot be run. A line without a whole index is left out."""
    done = _smi(GPU_FIGURES, timeout)
    if done is None or done.returncode != 0:
        return None
    found: dict[int, GpuFigures] = {}
    for line in done.stdout.splitlines():
        cells = line.split(",")
        index = _whole(cells[0]) if len(cells) == 4 else None
        if index is not None and index not in found:
            found[index] = GpuFigures(index, _whole(cells[1]), _whole(cells[2]), _whole(cells[3]))
    return list(found.values())


def visible_gpus(value: str | None, have: list[int]) -> list[int]:
    """The GPUs of `have` (nvidia-smi's indices) that a process with CUDA_VISIBLE_DEVICES=`value` sees, as CUDA
    reads it: unset, all; the whole numbers listed up to the first entry that is not one ("" or "-1": none).
    An entry CUDA takes that is not a whole number (a GPU's UUID) ends the list here."""
    if value is None:
        return list(have)
    seen: list[int] = []
    for entry in value.split(","):
        index = _whole(entry)
        if index is None:
            break
        if index in have and index not in seen:
            seen.append(index)
    return seen


def gpu_indices() -> set[int] | None:
    """The GPUs nvidia-smi lists, or None without a working nvidia-smi."""
    found = nvidia_smi("index")
    return None if found is None else set(found)


def task_figures(figures: list[GpuFigures] | None, visible: str | None) -> list[GpuFigures] | None:
    """The figures of a process's own GPUs (its CUDA_VISIBLE_DEVICES, `visible`; None: unset), in its order;
    None where nvidia-smi gave none or it sees no GPU."""
    if not figures:
        return None
    by_index = {f.index: f for f in figures}
    return [by_index[i] for i in visible_gpus(visible, list(by_index))] or None


def task_rows(figures: list[GpuFigures] | None, visible: str | None) -> list[dict[str, Any]] | None:
    """task_figures as they travel (a Stats record, a probe's row, `status --json`'s `gpus`)."""
    mine = task_figures(figures, visible)
    return [asdict(f) for f in mine] if mine else None


class GpuMeter:
    """The use and memory of a task's own GPUs (those its CUDA_VISIBLE_DEVICES names), read by nvidia-smi every
    GPU_EVERY_S in a thread of its own (a hung nvidia-smi never holds up a beat); None where none is known."""

    def __init__(self, visible: str | None):
        self.visible = visible
        self.latest: list[dict[str, Any]] | None = None
        threading.Thread(target=self._read, name="mgpu-gpus", daemon=True).start()

    @staticmethod
    def wanted() -> bool:
        """Whether there is anything to read: nvidia-smi on this host."""
        return shutil.which("nvidia-smi") is not None

    def _read(self) -> None:
        while True:
            self.latest = task_rows(gpu_figures(timeout=GPU_EVERY_S), self.visible)
            time.sleep(GPU_EVERY_S)


def task_devices(task: dict[str, Any], have: set[int] | None) -> tuple[int | None, str | None]:  # Any: a spec's JSON
    """(replicas the task will run, why that is not known): its GPUs under its `gpus` setting
    ("all", "none", a list, or absent: what TensorFlow sees), else its `local_replicas` on the CPU.

    `have`: this host's GPUs (gpu_indices()). Where GPUs are asked for and nvidia-smi is missing,
    the count is None and the reason says so (no guess)."""
    gpus, local = task.get("gpus"), task.get("local_replicas") or 1
    if gpus in ("none", []):  # [] is CUDA_VISIBLE_DEVICES="": no GPU, as "none"
        return local, None
    if gpus is not None and have is None:
        named = "all its GPUs" if gpus == "all" else f"GPUs {gpus}"
        return None, f"the task asks for {named}, but this host has no nvidia-smi to count them"
    if isinstance(gpus, list):
        return len(set(gpus) & (have or set())), None
    if have:  # "all", or nothing said: TensorFlow takes every GPU it sees
        return len(have), None
    return local, None


def is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip.split("%")[0]).is_loopback
    except ValueError:
        return False


def resolve(address: str) -> list[str]:
    """The IPs `address` resolves to here (nothing where it does not)."""
    try:
        infos = socket.getaddrinfo(address.strip("[]"), None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def interface_for(address: str) -> dict[str, Any]:
    """{"interface": the name of the interface holding one of `address`'s IPs here (or None),
    "ips": those IPs, "loopback": whether they are all loopback}."""
    import psutil

    ips = resolve(address)
    found = None
    by_ip = {a.address.split("%")[0]: name for name, addrs in psutil.net_if_addrs().items()
             for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)}
    for ip in ips:
        if ip.split("%")[0] in by_ip:
            found = by_ip[ip.split("%")[0]]
            break
    return {"interface": found, "ips": ips, "loopback": bool(ips) and all(is_loopback(ip) for ip in ips)}
