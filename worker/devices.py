"""What one host gives a task: how many devices it will train on, and which network interface
carries its address (for NCCL_SOCKET_IFNAME). Read by the doctor; no TensorFlow import."""

from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess


def nvidia_smi(query: str, timeout: float = 20) -> list[int] | None:
    """One whole number per GPU for `query` ("index", "utilization.gpu"), or None where nvidia-smi is
    missing, hangs past `timeout` or cannot be run."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [int(x) for x in out.split() if x.strip().isdigit()]


def gpu_indices() -> set[int] | None:
    """The GPUs nvidia-smi lists, or None without a working nvidia-smi."""
    found = nvidia_smi("index")
    return None if found is None else set(found)


def task_devices(task: dict, have: set[int] | None) -> tuple[int | None, str | None]:
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
        return len(set(gpus) & have), None
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
    return list(dict.fromkeys(info[4][0] for info in infos))


def interface_for(address: str) -> dict:
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
