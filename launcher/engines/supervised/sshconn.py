"""Opening an SSH connection to a host (fabric reads ~/.ssh/config; host keys checked), the one
paragraph that says why it failed, and reading a channel whose peer may be gone."""

from __future__ import annotations

import logging
import os
import socket
from typing import Iterator

import paramiko
from fabric import Connection

from launcher.errors import MgpuError
from launcher.spec.cluster import Host, Launch
from launcher.engines.supervised.hostkeys import check_host_keys, hostkey_name
from launcher.engines.supervised.transport import MAX_RECORD

logging.getLogger("paramiko").addHandler(logging.NullHandler())  # errors reach the user as HostUnreachable


class HostUnreachable(MgpuError):
    """A host cannot be reached, authenticated or trusted over SSH."""

    exit_code = 2


def open_connection(host: Host, launch: Launch, where: str) -> tuple[Connection, list[str]]:
    """An open connection to `host` and the known_hosts files its key was checked against."""
    timeout = launch.connect_timeout
    kwargs: dict[str, float | list[str]] = {"banner_timeout": timeout, "auth_timeout": timeout,
                                            "channel_timeout": timeout}
    if host.identity_file:
        kwargs["key_filename"] = [os.path.expanduser(host.identity_file)]
    try:  # fabric reads ~/.ssh/config: User, Port, IdentityFile, HostName, ProxyJump ...
        conn = Connection(host.address, user=host.user, port=host.ssh_port,
                          connect_timeout=max(1, round(timeout)), connect_kwargs=kwargs)
    except Exception as exc:  # a broken ~/.ssh/config, an unusable ProxyJump
        raise HostUnreachable(f"{where}: cannot set up SSH from your ssh config: {exc}") from None
    known_hosts = check_host_keys(conn, launch)
    try:
        conn.open()
    except Exception as exc:
        hop = conn  # the first hop that is not connected is the one that failed
        while isinstance(hop.gateway, Connection) and not hop.gateway.is_connected:
            hop = hop.gateway
        message = explain(host, launch, known_hosts, hop, exc, via=None if hop is conn else conn)
        close_quietly(conn)
        raise HostUnreachable(message) from None
    conn.transport.set_keepalive(5)
    return conn, known_hosts


def explain(host: Host, launch: Launch, known_hosts: list[str], conn: Connection, exc: Exception,
            via: Connection | None = None) -> str:
    """One paragraph: which host (or jump host on the way to it), what went wrong, what to do."""
    target = f"{conn.user}@{conn.host}" + (f" port {conn.port}" if int(conn.port) != 22 else "")
    name = f"host {host.name} ({target})" if host.name else f"host {target}"
    if via is not None:
        name = f"jump host {target} (ProxyJump on the way to {host.label})"
    port_opt = f"-p {conn.port} " if int(conn.port) != 22 else ""
    files = (known_hosts or ["~/.ssh/known_hosts"])[0]
    if isinstance(exc, paramiko.BadHostKeyException):
        return (f"{name}: its SSH host key has CHANGED since it was recorded in known_hosts (it now offers a "
                f"{exc.key.get_name()} key with fingerprint {exc.key.fingerprint}). That happens when a host is "
                "reinstalled, and also in a man-in-the-middle attack, so the connection was refused. If you trust "
                f"the new key, remove the old one with 'ssh-keygen -R {hostkey_name(conn)}' and connect once with "
                f"'ssh {port_opt}{conn.user}@{conn.host}'. accept_new_host_keys does not accept a changed key.")
    if isinstance(exc, paramiko.AuthenticationException):
        return (f"{name}: SSH authentication failed ({exc}). Check the user and key ('user' and 'identity_file' "
                "in the spec, or User and IdentityFile in ~/.ssh/config) and that the key is in the host's "
                f"authorized_keys; try 'ssh {port_opt}{conn.user}@{conn.host} true'.")
    if isinstance(exc, paramiko.SSHException) and "not found in known_hosts" in str(exc):
        return (f"{name}: its SSH host key is not in known_hosts ({files}), so the connection was refused "
                "(host keys are checked to stop man-in-the-middle attacks). Check the key, then record it with "
                f"'ssh-keyscan {port_opt}-H {conn.host} >> {files}' (or connect once with 'ssh {port_opt}"
                f"{conn.user}@{conn.host}'), or set accept_new_host_keys = true under [launch] to accept and "
                "record keys of hosts seen for the first time.")
    if isinstance(exc, (socket.timeout, TimeoutError)) or "timed out" in str(exc).lower():
        return (f"{name}: no SSH answer within connect_timeout = {launch.connect_timeout:g} s. Check that "
                "the host is up and reachable from this machine (address, firewall, VPN), or raise "
                "connect_timeout under [launch].")
    if isinstance(exc, (OSError, EOFError, paramiko.SSHException)):
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
            reason = "connection refused"
        return (f"{name}: cannot connect over SSH ({reason}). Check that the host is up, that sshd runs there "
                f"and listens on port {conn.port} (ssh_port in the spec), and try 'ssh {port_opt}"
                f"{conn.user}@{conn.host} true'.")
    return f"{name}: SSH failed: {type(exc).__name__}: {exc}"


def transport_of(conn: Connection) -> paramiko.Transport:
    """An open connection's paramiko Transport (fabric has no types: typed here, where we receive it)."""
    transport: paramiko.Transport = conn.transport
    return transport


def close_quietly(thing: paramiko.Channel | Connection) -> None:
    """Close a channel or connection whose peer may be gone: closing sends a message, and on a socket
    the peer has just reset that raises (EPIPE, EOFError), which must not end the thread that closes."""
    try:
        thing.close()
    except (OSError, EOFError, paramiko.SSHException):
        pass


def lines(channel: paramiko.Channel) -> Iterator[bytes]:
    """Lines (bytes) of a channel's output (stderr merged) until it closes."""
    buf = b""
    while True:
        try:
            chunk = channel.recv(65536)
        except (OSError, EOFError, paramiko.SSHException):
            chunk = b""
        if not chunk:
            if buf:
                yield buf
            return
        buf += chunk
        *complete, buf = buf.split(b"\n")
        yield from complete
        if len(buf) > MAX_RECORD:  # not one of our records: drop it rather than grow
            buf = b""
