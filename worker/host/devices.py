"""What one host gives a task: how many devices it will train on, its GPUs' use and memory now, and which
network interface carries its address (for NCCL_SOCKET_IFNAME). No TensorFlow import."""

from __future__ import annotations

import contextlib
import ipaddress
import os
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
        """One from its JSON (a task's supervisor sent it: untrusted), or None where it is not one, or its
        figures are out of range (`checked`)."""
        if not isinstance(data, dict) or set(data) != {"index", "util", "memory_used", "memory_total"}:
            return None
        values = [data["index"], data["util"], data["memory_used"], data["memory_total"]]
        if not all(v is None or type(v) is int and 0 <= v < 10 ** _WHOLE_MAX for v in values) or values[0] is None:
            return None
        figures, why = cls.checked(*values)
        return None if why else figures

    @classmethod
    def checked(cls, index: int, util: int | None, used: int | None,
                total: int | None) -> "tuple[GpuFigures, str]":
        """The figures kept in range (a use of 0-100 %, memory used no more than its total), and what was left
        out and why ('' where nothing was): a figure out of range is no figure of a GPU."""
        why = []
        if util is not None and util > UTIL_MAX:
            why.append(f"a use of {util} %")
            util = None
        if used is not None and total is not None and used > total:
            why.append(f"{used} MiB used of {total} MiB")
            used = total = None
        return cls(index, util, used, total), (f"GPU {index}: {' and '.join(why)}" if why else "")


@dataclass(frozen=True)
class GpuReading:
    """One nvidia-smi call read: its GPUs' figures, bounded and in range (None: no working nvidia-smi), and what
    was left out of what it printed, in words ('' where nothing was): said once by whoever shows the figures."""

    figures: list[GpuFigures] | None
    dropped: str = ""


GPU_FIGURES = "index,utilization.gpu,memory.used,memory.total"
GPUS_MAX = 64  # GPUs of one task a record carries: more is no host's
UTIL_MAX = 100  # percent
SMI_MAX_BYTES = 64 * 1024  # of nvidia-smi's output read: GPUS_MAX lines of figures fit many times over
GPU_EVERY_S = 10.0  # nvidia-smi takes tens of ms of a core: a task's GPUs are read this seldom
_WHOLE_MAX = 12  # digits of a figure: longer is no figure nvidia-smi gives


def _smi(query: str, timeout: float) -> tuple[int, str] | None:
    """nvidia-smi's exit code and the start of what it printed (SMI_MAX_BYTES at most: then 0); None where it is missing,
    cannot be run or is still running after `timeout`. It runs in a session of its own, killed whole (a wrapper
    script's children too, those that left its session as well) once read, timed out or when we die."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=child_setup(signal.SIGKILL))
    except OSError:
        return None
    late = threading.Event()

    def kill() -> None:
        import psutil  # where a reader is killed

        from worker.host.procs import tree

        for child in tree(proc.pid):  # a wrapper's child that left its session too
            with contextlib.suppress(psutil.Error):
                child.kill()
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)

    def timed_out() -> None:
        late.set()
        kill()

    timer = threading.Timer(timeout, timed_out)
    timer.start()
    try:
        assert proc.stdout is not None
        out = proc.stdout.read(SMI_MAX_BYTES)
        capped = len(out) >= SMI_MAX_BYTES
        if capped:
            kill()  # more than any host's GPUs print: what was read is read, as from an nvidia-smi that ended well
        code = 0 if capped else proc.wait()
    finally:
        timer.cancel()
        kill()  # whatever of its session is left
        if proc.stdout is not None:
            proc.stdout.close()
    return None if late.is_set() else (code, out.decode("utf-8", "replace"))


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
    return [int(x) for x in done[1].split() if _whole(x) is not None][:GPUS_MAX]


def read_gpus(timeout: float = 20) -> GpuReading:
    """Every GPU's use and memory, from one nvidia-smi call (its output is untrusted): at most GPUS_MAX GPUs,
    each figure whole and in range, what was left out said; no figures where nvidia-smi is missing, hangs past
    `timeout`, fails or cannot be run. A line without a whole index is left out."""
    done = _smi(GPU_FIGURES, timeout)
    if done is None or done[0] != 0:
        return GpuReading(None)
    found: dict[int, GpuFigures] = {}
    why: list[str] = []
    more = 0
    for line in done[1].splitlines():
        cells = line.split(",")
        index = _whole(cells[0]) if len(cells) == 4 else None
        if index is None or index in found:
            continue
        if len(found) == GPUS_MAX:
            more += 1
            continue
        found[index], dropped = GpuFigures.checked(index, _whole(cells[1]), _whole(cells[2]), _whole(cells[3]))
        if dropped:
            why.append(dropped)
    if more:
        why.insert(0, f"it listed {len(found) + more}{'+' if len(done[1]) >= SMI_MAX_BYTES else ''} GPUs, and a "
                      f"host holds at most {GPUS_MAX}: the first {GPUS_MAX} are kept")
    said = "; ".join(why[:4]) + (f"; and {len(why) - 4} more" if len(why) > 4 else "")
    return GpuReading(list(found.values()), f"nvidia-smi's figures left out ({said})" if said else "")


def gpu_figures(timeout: float = 20) -> list[GpuFigures] | None:
    """read_gpus' figures alone (a probe's: what it leaves out is said where the task runs)."""
    return read_gpus(timeout).figures


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
        self.dropped = ""  # the first reading's words on what it left out (the core says it once)
        threading.Thread(target=self._read, name="mgpu-gpus", daemon=True).start()

    @staticmethod
    def wanted() -> bool:
        """Whether there is anything to read: nvidia-smi on this host."""
        return shutil.which("nvidia-smi") is not None

    def _read(self) -> None:
        while True:
            reading = read_gpus(timeout=GPU_EVERY_S)
            self.latest = task_rows(reading.figures, self.visible)
            self.dropped = self.dropped or reading.dropped
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
