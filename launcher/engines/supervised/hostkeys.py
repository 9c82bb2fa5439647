"""SSH host keys: checked against known_hosts (fabric alone checks nothing); `accept_new_host_keys`
records the key of a host seen for the first time, as OpenSSH's `StrictHostKeyChecking accept-new`."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import paramiko
from fabric import Connection

from launcher.spec.cluster import Launch

_KNOWN_HOSTS_LOCK = threading.Lock()


class AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    """Accept a host's key on first contact and append it to the user's known_hosts.

    A key that differs from a recorded one is still refused (paramiko raises BadHostKeyException
    before any policy is asked)."""

    def __init__(self, path: str):
        self.path = path

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        with _KNOWN_HOSTS_LOCK:
            try:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                with os.fdopen(fd, "a") as f:
                    fcntl.flock(f, fcntl.LOCK_EX)
                    f.write(line)
            except OSError:
                pass  # accepted for this run even when it cannot be recorded


def known_hosts_files(conn: Connection) -> tuple[list[str], list[str]]:
    user = conn.ssh_config.get("userknownhostsfile", "~/.ssh/known_hosts ~/.ssh/known_hosts2")
    system = conn.ssh_config.get("globalknownhostsfile", "/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2")

    def expand(v: str | list[str]) -> list[str]:
        return [os.path.expanduser(p) for p in (v if isinstance(v, list) else v.split())]

    return expand(user), expand(system)


def check_host_keys(conn: Connection, launch: Launch) -> list[str]:
    """Load known_hosts into conn's client and refuse unknown keys (unless accept_new_host_keys);
    the known_hosts files, the one that records new keys first."""
    user, system = known_hosts_files(conn)
    client = conn.client
    for path in system + user:  # the user's files are only appended to (AcceptNewPolicy)
        if os.path.isfile(path):
            try:
                client.get_host_keys().load(path)
            except (OSError, paramiko.SSHException, ValueError):
                pass  # an unreadable file: its hosts count as unknown
    policy = AcceptNewPolicy(user[0]) if launch.accept_new_host_keys else paramiko.RejectPolicy()
    client.set_missing_host_key_policy(policy)
    if isinstance(conn.gateway, Connection):  # a ProxyJump host is checked the same way
        check_host_keys(conn.gateway, launch)
    return user + system


def hostkey_name(conn: Connection) -> str:
    return conn.host if int(conn.port) == 22 else f"[{conn.host}]:{conn.port}"
