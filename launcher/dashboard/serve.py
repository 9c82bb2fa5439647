"""`mgpu-cluster dashboard`: bind the address (a port in use is one paragraph), print where the page is with
its token (new at each start, on every address), serve until Ctrl-C."""

from __future__ import annotations

import errno
import secrets
import socket

from launcher.errors import MgpuError

EXTRA = "pip install 'mgpu-cluster[dashboard]'"


class DashboardError(MgpuError):
    exit_code = 2


def _bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise DashboardError(f"dashboard: cannot use --host {host}: {exc.strerror}. Give an address of this "
                             "machine (127.0.0.1, the default, or 0.0.0.0 for every interface).") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        why = (f"port {port} is in use on {host} (another dashboard, or another program); give another one: "
               f"mgpu-cluster dashboard --port {port + 1}" if exc.errno == errno.EADDRINUSE else
               f"{exc.strerror or exc}; check --host and --port")
        raise DashboardError(f"dashboard: cannot listen on {host}:{port}: {why}.") from None
    return sock


def url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/"


def serve(host: str, port: int) -> None:
    try:
        import uvicorn

        from launcher.dashboard.app import create
        from launcher.dashboard.guard import loopback
    except ImportError as exc:
        raise DashboardError(f"dashboard: {exc.name or 'a package it needs'} is not installed; the dashboard "
                             f"comes with an extra: {EXTRA}") from None
    token = secrets.token_urlsafe(24)
    sock = _bind(host, port)
    print(f"dashboard: {url(host, port)}?token={token} (read-only, from the run records; only this token reads "
          f"them: this URL hands it to the page; /metrics: 'Authorization: Bearer {token}'; Ctrl-C stops it)",
          flush=True)
    config = uvicorn.Config(create(token, loopback(host)), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=2)
    uvicorn.Server(config).run(sockets=[sock])
