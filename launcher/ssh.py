"""Tasks on remote hosts over SSH: one fabric connection per host, reused for everything in a run.

Every value that reaches the remote shell is quoted with shlex; the supervisor's stdin is the
SSH channel, so when the launcher or the connection goes away the remote task is stopped.
"""

from __future__ import annotations

import os
import queue
import shlex
import socket
import threading
from pathlib import Path

import paramiko
from fabric import Connection

from launcher.errors import MgpuError
from launcher.plan import TaskPlan
from launcher.spec import Host, Launch
from launcher.transport import Event, Handle, Transport, read_events

CALL_TIMEOUT_S = 60


class HostUnreachable(MgpuError):
    exit_code = 2


def shell_command(argv: list[str], cwd: str | None = None, env: dict[str, str] | None = None) -> str:
    """A POSIX shell line that runs argv in cwd with env; every value quoted, nothing interpreted."""
    line = shlex.join(["env", *(f"{k}={v}" for k, v in (env or {}).items()), *argv]) if env else shlex.join(argv)
    return f"cd {shlex.quote(cwd)} && exec {line}" if cwd else f"exec {line}"


class SSHHandle(Handle):
    def __init__(self, channel: paramiko.Channel):
        self.channel = channel

    def stop(self) -> None:
        try:
            self.channel.shutdown_write()  # EOF on the supervisor's stdin: it stops its task
        except (OSError, EOFError, paramiko.SSHException):
            pass


class SSHTransport(Transport):
    def __init__(self, host: Host, launch: Launch):
        self.host, self.launch = host, launch
        self.lock = threading.Lock()
        self.conn: Connection | None = None

    @property
    def where(self) -> str:
        user = f"{self.host.user}@" if self.host.user else ""
        port = f":{self.host.ssh_port}" if self.host.ssh_port else ""
        return f"{user}{self.host.address}{port}"

    def connection(self) -> Connection:
        with self.lock:
            if self.conn is not None and self.conn.is_connected:
                return self.conn
            kwargs = {"key_filename": [os.path.expanduser(self.host.identity_file)]} if self.host.identity_file else {}
            conn = Connection(self.host.address, user=self.host.user, port=self.host.ssh_port,
                              connect_timeout=int(max(1, self.launch.connect_timeout)), connect_kwargs=kwargs)
            client = conn.client
            known = conn.ssh_config.get("userknownhostsfile", "~/.ssh/known_hosts").split()
            for path in known:
                path = os.path.expanduser(path)
                if os.path.exists(path):
                    client.load_host_keys(path) if path == known[0] else client.get_host_keys().load(path)
            if self.launch.accept_new_host_keys:
                client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
            else:
                client.set_missing_host_key_policy(paramiko.RejectPolicy())
            try:
                conn.open()
            except paramiko.BadHostKeyException:
                raise HostUnreachable(
                    f"{self.where}: its host key has CHANGED since it was recorded in known_hosts. That can mean "
                    f"the host was reinstalled, or an attack. If you trust it, remove the old key with "
                    f"'ssh-keygen -R {self.host.address}' and connect again.") from None
            except paramiko.AuthenticationException as exc:
                raise HostUnreachable(
                    f"{self.where}: SSH authentication failed ({exc}). Check the user and key "
                    "('user', 'identity_file' in the spec or your ~/.ssh/config), e.g. with 'ssh "
                    f"{self.where}'.") from None
            except paramiko.SSHException as exc:
                if "not found in known_hosts" in str(exc):
                    raise HostUnreachable(
                        f"{self.where}: its host key is not in known_hosts, so the connection was refused. "
                        f"Check the key, then add it ('ssh-keyscan -H {self.host.address} >> ~/.ssh/known_hosts'), "
                        "or set accept_new_host_keys = true under [launch].") from None
                raise HostUnreachable(f"{self.where}: SSH failed: {exc}") from None
            except (OSError, socket.timeout, EOFError) as exc:
                reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
                raise HostUnreachable(
                    f"{self.where}: cannot connect over SSH within {self.launch.connect_timeout:g} s ({reason}). "
                    "Check that the host is up and sshd is reachable from here.") from None
            if self.launch.accept_new_host_keys:
                _remember_host_keys(client, known[0])
            conn.transport.set_keepalive(5)
            self.conn = conn
            return conn

    def call(self, plan: TaskPlan, argv: list[str], timeout: float) -> tuple[int, str, str]:
        conn = self.connection()
        try:
            r = conn.run(shell_command(argv, plan.cwd), hide=True, warn=True, in_stream=False, timeout=timeout)
        except Exception as exc:  # invoke's CommandTimedOut and transport errors alike
            raise HostUnreachable(f"{self.where}: command failed: {exc}") from None
        return r.exited, r.stdout, r.stderr

    def start(self, plan: TaskPlan, attempt: int, events: queue.Queue) -> Handle:
        transport = self.connection().transport
        channel = transport.open_session(timeout=self.launch.connect_timeout)
        channel.set_combine_stderr(True)
        channel.exec_command(shell_command(plan.supervisor_argv(attempt), plan.cwd, plan.env))

        def pump() -> None:
            exited = read_events(plan.index, _lines(channel), events)
            if not exited:
                events.put(Event(plan.index, "lost", f"the SSH connection to {self.where} ended with no exit report"))
            channel.close()

        threading.Thread(target=pump, daemon=True).start()
        return SSHHandle(channel)

    def _probe_call(self, plans: list[TaskPlan], flag: list[str]) -> list[dict]:
        import json

        python = plans[0].python
        code, out, err = self.call(plans[0], [python, "-m", "worker.probe", *flag, *[p.run_dir for p in plans]],
                                   CALL_TIMEOUT_S)
        if code != 0:
            raise HostUnreachable(f"{self.where}: worker.probe failed: {(err.strip().splitlines() or ['?'])[-1]}")
        return json.loads(out.strip().splitlines()[-1])

    def probe(self, plans: list[TaskPlan]) -> list[dict]:
        return self._probe_call(plans, [])

    def stop_tasks(self, plans: list[TaskPlan]) -> list[dict]:
        return self._probe_call(plans, ["--stop"])

    def close(self) -> None:
        with self.lock:
            if self.conn is not None:
                self.conn.close()
                self.conn = None


def _lines(channel: paramiko.Channel):
    """Lines of a channel's output (stderr merged) until it closes."""
    buf = b""
    while True:
        try:
            chunk = channel.recv(65536)
        except (OSError, EOFError, paramiko.SSHException):
            chunk = b""
        if not chunk:
            if buf:
                yield buf.decode("utf-8", "replace")
            return
        buf += chunk
        *complete, buf = buf.split(b"\n")
        for line in complete:
            yield line.decode("utf-8", "replace")


def _remember_host_keys(client: paramiko.SSHClient, path: str) -> None:
    """accept_new_host_keys: record keys learnt on first contact, as OpenSSH's accept-new does."""
    path = os.path.expanduser(path)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    keys = client.get_host_keys()
    try:
        keys.save(path)
    except OSError:
        pass
