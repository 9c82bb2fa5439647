"""Tasks on remote hosts over SSH: one fabric connection per host, reused for everything in a run.

Every value that reaches the remote shell is quoted with shlex (`shell_command`); host keys are
checked as the connection opens (sshconn, hostkeys).

Each remote task's supervisor reads the SSH channel as its stdin: it stops its task when the
channel reaches EOF (the launcher stopped the task, or exited, or the connection closed) or when
the launcher's keepalive newlines (every KEEPALIVE_S) stop arriving for `launch.lifeline` seconds
(the host was cut off: no EOF will ever come, and sshd would not notice for hours).
"""

from __future__ import annotations

import json
import posixpath
import threading
import time
from typing import BinaryIO

import paramiko
from fabric import Connection

from launcher.plan import TaskPlan
from launcher.spec.cluster import Host, Launch
from launcher.engines.base import ProbeRow, Sink, pump
from launcher.engines.supervised.sshconn import HostUnreachable, close_quietly, lines, open_connection, transport_of
from launcher.engines.supervised.shell import shell_command
from launcher.engines.supervised.sftp import sync_over_sftp
from launcher.engines.supervised.transport import Handle, LogUnreadable, SyncCounts, Transport, env_line
from worker.host import layout
from worker.host.clock import Deadline
from worker.host.files import READ_MAX_BYTES, last_lines, tail_bytes
from worker.host.spawn import module_argv
from worker.host.protocol import BROKEN, GO, REGROUP

CALL_TIMEOUT_S = 60.0
KEEPALIVE_S = 2.0  # a newline to each remote task's supervisor
POLL_S = 0.02
# sshd may send a command's exit status before the last of its output: the rest is read until the channel's end of
# file, this long at most (a background child that holds the output open never ends it)
TAIL_S = 2.0


class SSHHandle(Handle):
    def __init__(self, channel: paramiko.Channel, owner: "SSHTransport"):
        self.channel, self.owner = channel, owner

    def stop(self, broken: bool = False) -> None:
        self.owner.forget(self.channel)
        try:
            if broken:
                self.channel.sendall(BROKEN)
            self.channel.shutdown_write()  # EOF on the supervisor's stdin: the supervisor stops its task
        except (OSError, EOFError, paramiko.SSHException):
            pass

    def begin(self) -> bool:
        return self._say(GO)

    def regroup(self) -> bool:
        return self._say(REGROUP)

    def _say(self, word: bytes) -> bool:
        try:
            self.channel.sendall(word)
            return True
        except (OSError, EOFError, paramiko.SSHException):
            return False

    def wait(self, timeout: float) -> bool:
        return self.channel.status_event.wait(timeout) or self.channel.closed


class SSHTransport(Transport):
    """Every task of one host: one SSH connection, opened on first use, shared by all threads."""

    can_hold = True

    def __init__(self, host: Host, launch: Launch):
        self.host, self.launch = host, launch
        self.lock, self.channels_lock = threading.Lock(), threading.Lock()
        self.conn: Connection | None = None
        self.channels: set[paramiko.Channel] = set()  # live task channels that get keepalives
        self.held: dict[int, paramiko.Channel] = {}  # preflight checks waiting to become supervisors
        self.keepalive: threading.Thread | None = None
        self.closed = threading.Event()
        self.connect_s: float | None = None
        self.known_hosts: list[str] = []
        self.extra: list[Connection] = []  # more connections, when sshd's MaxSessions is reached

    # ---- naming
    @property
    def target(self) -> str:
        """user@host:port as it is really used (after ~/.ssh/config), else as the spec says."""
        c = self.conn
        if c is not None:
            return f"{c.user}@{c.host}" + (f":{c.port}" if int(c.port) != 22 else "")
        user = f"{self.host.user}@" if self.host.user else ""
        port = f":{self.host.ssh_port}" if self.host.ssh_port else ""
        return f"{user}{self.host.address}{port}"

    @property
    def where(self) -> str:
        return f"host {self.host.name} {self.target}" if self.host.name else f"host {self.target}"

    # ---- connecting
    def connect(self) -> float:
        """Open the connection now (preflight); seconds it took (0 when already open)."""
        t0 = time.monotonic()
        self.connection()
        return time.monotonic() - t0

    def connection(self) -> Connection:
        """The host's connection, opened on first use (and again after it was lost)."""
        with self.lock:
            if self.conn is not None and self.conn.is_connected:
                return self.conn
            if self.closed.is_set():
                raise HostUnreachable(f"{self.where}: the connection was closed")
            t0 = time.monotonic()
            self.conn = self._open()
            self.connect_s = time.monotonic() - t0
            return self.conn

    def _open(self) -> Connection:
        conn, self.known_hosts = open_connection(self.host, self.launch, self.where)
        return conn

    def _drop(self) -> None:
        """Forget a connection that stopped answering; the next use reconnects (or fails fast)."""
        with self.lock:
            conn, self.conn = self.conn, None
        if conn is not None:
            threading.Thread(target=close_quietly, args=(conn,), daemon=True).start()  # never block on a dead peer

    def _session(self, timeout: float, overflow: bool = False) -> paramiko.Channel:
        """A new session channel: on the host's connection, else (sshd refused one more session on it:
        MaxSessions, 10 by default) on another connection to the same host."""
        timeout = min(timeout, self.launch.connect_timeout)
        if not overflow:
            transport = transport_of(self.connection())
            try:
                return transport.open_session(timeout=timeout)
            except (paramiko.SSHException, EOFError, OSError) as exc:
                if not transport.is_active() or "Timeout" in str(exc):
                    self._drop()
                    raise HostUnreachable(f"{self.where}: the SSH connection stopped answering ({exc}); "
                                          "the host may be down or cut off") from None
        with self.lock:
            for conn in self.extra:
                try:
                    if conn.is_connected:
                        return transport_of(conn).open_session(timeout=timeout)
                except (paramiko.SSHException, EOFError, OSError):
                    continue
            if self.closed.is_set():
                raise HostUnreachable(f"{self.where}: the connection was closed")
            conn = self._open()
            self.extra.append(conn)
        try:
            return transport_of(conn).open_session(timeout=timeout)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise HostUnreachable(f"{self.where}: cannot open an SSH session: {exc}") from None

    def _exec(self, command: str, timeout: float, combine_stderr: bool = False) -> paramiko.Channel:
        """A channel that runs `command` (its stdin still open)."""
        for overflow in (False, True):
            ch = self._session(timeout, overflow)
            ch.set_combine_stderr(combine_stderr)
            try:
                ch.exec_command(command)
                return ch
            except (paramiko.SSHException, EOFError, OSError) as exc:
                close_quietly(ch)
                if overflow or not ch.get_transport().is_active():
                    raise HostUnreachable(f"{self.where}: cannot run a command over SSH: {exc}") from None
        raise AssertionError("unreachable")

    # ---- short commands
    def run(self, command: str, timeout: float = CALL_TIMEOUT_S, stdin: bytes = b"") -> tuple[int, str, str]:
        """Run a shell line on the host, `stdin` its input: (exit code, stdout, stderr), within `timeout` seconds."""
        code, out, err = self.run_bytes(command, timeout, stdin)
        return code, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")

    def run_bytes(self, command: str, timeout: float = CALL_TIMEOUT_S, stdin: bytes = b"") -> tuple[int, bytes, bytes]:
        """As run(), its output as the bytes the command wrote."""
        deadline = Deadline.after(timeout)
        ch = self._exec(command, timeout)
        out, err = bytearray(), bytearray()

        def drain() -> None:
            while ch.recv_ready():
                out.extend(ch.recv(65536))
            while ch.recv_stderr_ready():
                err.extend(ch.recv_stderr(65536))

        try:
            ch.sendall(stdin)
            ch.shutdown_write()  # no one types: the command sees EOF on stdin
            while not ch.status_event.wait(POLL_S):
                drain()
                if deadline.passed:
                    raise HostUnreachable(f"{self.where}: '{command[:80]}' did not finish within {timeout:g} s")
            tail = Deadline.after(min(deadline.left(), TAIL_S))
            while not ch.eof_received and not tail.passed:
                drain()
                time.sleep(POLL_S)
            drain()
            code = ch.recv_exit_status()
            if code == -1 and not ch.get_transport().is_active():
                raise EOFError("the connection closed while the command ran")
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self._drop()
            raise HostUnreachable(f"{self.where}: SSH command failed: {exc}") from None
        finally:
            close_quietly(ch)
        return code, bytes(out), bytes(err)

    def call(self, plan: TaskPlan, argv: list[str], timeout: float, stdin: bytes = b"") -> tuple[int, str, str]:
        return self.run(shell_command(argv, plan.cwd), timeout, stdin)

    def call_and_hold(self, plan: TaskPlan, argv: list[str], timeout: float) -> tuple[int, str, str]:
        """As call(), for a command that prints one line and then waits (`worker.preflight.doctor --hold`): that
        line, with the channel kept for start(); or, when it ended instead, what call() would give."""
        deadline = Deadline.after(timeout)
        ch = self._exec(shell_command(argv, plan.cwd), timeout)
        out, err = bytearray(), bytearray()
        try:
            while b"\n" not in out:
                if ch.recv_ready():
                    out.extend(ch.recv(65536))
                elif ch.recv_stderr_ready():
                    err.extend(ch.recv_stderr(65536))
                elif ch.exit_status_ready():
                    while ch.recv_ready():
                        out.extend(ch.recv(65536))
                    while ch.recv_stderr_ready():
                        err.extend(ch.recv_stderr(65536))
                    code = ch.recv_exit_status()
                    close_quietly(ch)
                    return code, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
                elif deadline.passed:
                    close_quietly(ch)
                    raise HostUnreachable(f"{self.where}: the host check did not answer within {timeout:g} s")
                else:
                    time.sleep(POLL_S)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            close_quietly(ch)
            self._drop()
            raise HostUnreachable(f"{self.where}: SSH command failed: {exc}") from None
        with self.channels_lock:
            self.held[plan.index] = ch
        return 0, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")

    # ---- tasks
    def start(self, plan: TaskPlan, attempt: int, sink: Sink, standby: bool = False) -> Handle:
        with self.channels_lock:
            held = self.held.pop(plan.index, None) if attempt == 0 and not standby else None
        try:
            if held is not None and not held.exit_status_ready():
                held.set_combine_stderr(True)
                held.sendall(b"go\n")  # its preflight check becomes its supervisor: no second shell, no Python
                channel = held
            else:
                raise OSError("no held check")
        except (OSError, EOFError, paramiko.SSHException):
            if held is not None:
                close_quietly(held)
            argv = plan.supervisor_argv(attempt, lifeline=self.launch.lifeline, standby=standby)
            channel = self._exec(shell_command(argv, plan.cwd), self.launch.start_timeout, combine_stderr=True)
        try:
            channel.sendall(env_line(plan))  # the environment travels on stdin, never on a command line
        except (OSError, EOFError, paramiko.SSHException):
            pass  # the pump reports what became of it
        with self.channels_lock:
            self.channels.add(channel)
            if self.keepalive is None:
                self.keepalive = threading.Thread(target=self._keepalive, daemon=True)
                self.keepalive.start()

        def run() -> None:
            try:
                pump(plan.index, lines(channel), sink,
                     lambda: f"the SSH connection to {self.where} ended with no exit report (the host went down, "
                             "or its sshd or the task's processes were killed)")
            finally:
                self.forget(channel)
                close_quietly(channel)

        threading.Thread(target=run, daemon=True).start()
        return SSHHandle(channel, self)

    def forget(self, channel: paramiko.Channel) -> None:
        with self.channels_lock:
            self.channels.discard(channel)

    def _keepalive(self) -> None:
        while not self.closed.wait(KEEPALIVE_S):
            with self.channels_lock:
                channels = list(self.channels)
            for ch in channels:
                try:
                    ch.send(b"\n")
                except (OSError, EOFError, paramiko.SSHException):
                    self.forget(ch)

    def _probe_call(self, plans: list[TaskPlan], flag: list[str], timeout: float) -> list[ProbeRow]:
        argv = [*module_argv(plans[0].python, "worker.task.probe"), *flag, *[p.run_dir for p in plans]]
        code, out, err = self.call(plans[0], argv, timeout)
        try:  # its last line is the report (a login script may print before it): the host's JSON, read here
            rows = json.loads((out.strip().splitlines() if code == 0 else [])[-1])
            if not isinstance(rows, list) or len(rows) != len(plans):
                raise ValueError("not one row per task")
            return [ProbeRow.parse(row) for row in rows]
        except (IndexError, ValueError):
            raise HostUnreachable(f"{self.where}: worker.task.probe failed: "
                                  f"{(err.strip().splitlines() or ['no report'])[-1]}") from None

    def read_log(self, plan: TaskPlan, offset: int, tail: int | None) -> tuple[bytes, int]:
        path = layout.file(plan.run_dir, layout.WORKER_LOG)
        if tail is not None:  # its size, then its end: the last lines are cut from it here
            argv = ["sh", "-c", 'stat -c %s "$1" && tail -c "$2" "$1"', "sh", path, str(tail_bytes(tail))]
        else:
            argv = ["sh", "-c", 'test -r "$1" || { ls "$1" >/dev/null; exit 1; }; tail -c "+$2" "$1" | head -c "$3"',
                    "sh", path, str(offset + 1), str(READ_MAX_BYTES)]
        code, out, err = self.run_bytes(shell_command(argv, plan.cwd), CALL_TIMEOUT_S)
        if code != 0:
            raise LogUnreadable((err.decode("utf-8", "replace").strip().splitlines() or ["no such file"])[-1])
        if tail is None:
            return out, offset + len(out)
        size, _, data = out.partition(b"\n")
        return last_lines(data, tail), int(size.strip() or 0)

    def probe(self, plans: list[TaskPlan]) -> list[ProbeRow]:
        return self._probe_call(plans, [], CALL_TIMEOUT_S)

    def stop_tasks(self, plans: list[TaskPlan]) -> list[ProbeRow]:
        return self._probe_call(plans, ["--stop"], CALL_TIMEOUT_S)

    def sync(self, files: list[tuple[str, str]], workdir: str | None) -> SyncCounts:
        try:
            return sync_over_sftp(self.connection().sftp(), files, workdir)
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise HostUnreachable(f"{self.where}: sync to {workdir or 'the login folder'} failed: {exc}") from None

    def open_file(self, path: str, write: bool = False) -> BinaryIO:
        sftp: paramiko.SFTPClient = self.connection().sftp()
        if write:
            folder, missing = posixpath.dirname(path), []
            while folder not in ("", "/"):
                try:
                    sftp.stat(folder)
                    break
                except FileNotFoundError:
                    missing.append(folder)
                    folder = posixpath.dirname(folder)
            for folder in reversed(missing):
                sftp.mkdir(folder, mode=0o700)
        f = sftp.open(path, "wb" if write else "rb")
        if write:
            f.set_pipelined(True)  # writes go out without waiting for each one's answer
        else:
            f.prefetch()
        return f  # type: ignore[return-value]  # an SFTPFile reads and writes bytes as a binary file does

    def close(self) -> None:
        self.closed.set()
        with self.channels_lock:
            held, self.held = list(self.held.values()), {}
        for ch in held:  # EOF: a check that was kept for a start that did not come ends itself
            close_quietly(ch)
        with self.lock:
            conns, self.conn, self.extra = [self.conn, *self.extra], None, []
        for conn in conns:
            if conn is not None:
                close_quietly(conn)
