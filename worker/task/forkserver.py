"""A task's fork server: imports the framework once (TensorFlow with tf_keras, or Keras 3 on JAX) and our runner,
never the user's code, then forks each attempt's program from itself, so that no attempt, the first one aside,
pays for those imports. It lives while a task core of its task is connected, and holds no port, device or runtime.

    python -c BOOT worker.task.forkserver NAME [--idle] [--ours MODULE]

Each attempt is forked twice: a reaper (the task core's stand-in, which tells the core the trainer's pid and
exit status and stops the trainer if the core goes away) and, under it, the trainer, leading its own group, its
output on the core's pipe. A server that dies takes no attempt with it.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import math
import os
import resource
import select
import selectors
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import NamedTuple, cast

from worker.host import env
from worker.host.modules import modules_file, remembered
from worker.host.system import adopt_orphans, child_setup
from worker.task.program import Program, run_and_exit
from worker.task.lines import NOTE

READY = b"ready\n"
START_WAIT_S = 10.0  # with no core connected this long after its imports, it is not needed
REQUEST_MAX = 1 << 20
CLIENTS_MAX = 200  # cores of one task connected while its server imports (its attempt's and a standby's): a few
GONE_S = 2.0  # a server killed by its doorman has ended within this, but on a host out of memory


def name(run_id: str, index: int | str) -> str:
    """The server's name, per user, run and task; its address is the abstract one of that name (no file to leave
    behind). An abstract socket has no permissions, so the server serves only its own user (SO_PEERCRED)."""
    return f"mgpu-fork/{os.getuid()}/{run_id}/{index}"


def address(name: str) -> str:
    return "\0" + name


def peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


@dataclass(frozen=True)
class Request:
    """An attempt to fork: what it runs, with what environment, where, on which cores, the signal its trainer
    gets when its core dies, and the grace of what the trainer leaves behind (TERM, KILL after it)."""

    program: Program
    env: dict[str, str]
    cwd: str
    cpus: tuple[int, ...] | None
    parent_death: int
    grace: float

    def encode(self) -> bytes:
        return json.dumps({"program": self.program.encode(), "env": self.env, "cwd": self.cwd,
                           "cpus": list(self.cpus) if self.cpus else None, "parent_death": self.parent_death,
                           "grace": self.grace}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Request":
        data = json.loads(raw)
        env, cpus, grace = data["env"], data["cpus"], float(data["grace"])
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError("not an environment")
        if not (math.isfinite(grace) and grace >= 0):
            raise ValueError(f"a grace of {grace} s")
        return cls(Program.decode(data["program"]), env, str(data["cwd"]),
                   tuple(int(c) for c in cpus) if cpus else None, int(data["parent_death"]), grace)


# ---- priority: a server started while its task trains imports on the CPU time the training leaves
def _autogroup(nice: int) -> None:
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass


def _own_session(pid: int = 0) -> bool:
    """Whether the server leads a session (so a scheduler autogroup) of its own: started so where its Python
    cannot start a child in a process group alone (3.10). Where it shares its core's session, the autogroup is the
    training's too, and is never niced: that starved the training whenever another session wanted the CPU."""
    try:
        return os.getsid(pid) == (pid or os.getpid())
    except OSError:
        return False


def idle() -> bool:
    """Import at the idle priority where the trainer forked later can take the normal one back (root, or an
    RLIMIT_NICE that allows it); in a session of its own its autogroup niced too, as the kernel shares the CPU
    between sessions first."""
    if not _idle_thread():
        return False
    if _own_session():
        _autogroup(19)
    return True


def hurry(pid: int) -> None:
    """Process `pid` (a server) at the normal priority, every thread of it: what it does next is waited for."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in threads:
        try:
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
        except (OSError, ValueError):
            pass
    if _own_session(pid):
        try:
            with open(f"/proc/{pid}/autogroup", "w") as f:
                f.write("0")
        except OSError:
            pass


def unidle() -> None:
    if _own_session():
        _autogroup(0)
    _normal_thread()


_started_under: dict[str, str] = {}  # the framework settings the server was started with (its task's)
_imported_under: dict[str, str] = {}  # and those its imports were made under (the runner's defaults added)


def _imports(ours: str | None) -> None:
    """What every attempt's start imports; a failure is left for the program itself to meet and tell."""
    jax = os.environ.get(env.KERAS_BACKEND) == "jax"
    _started_under.update(env.framework_settings(os.environ))
    if not jax:
        env.tf_defaults()  # as the runner sets them, before TensorFlow
    _imported_under.update(env.framework_settings(os.environ))
    try:
        if jax:
            import keras  # noqa: F401  (and JAX under it)
        else:
            import tensorflow  # noqa: F401
        if ours == "worker":
            importlib.import_module("worker.keras3.runner" if jax else "worker.tensorflow.runner")
    except Exception:  # noqa: BLE001 (the program's own start will say what is wrong, in its words)
        pass
    _remembered()


def _remembered(beside: list[socket.socket] | None = None, listener: socket.socket | None = None) -> None:
    """The installed modules the task's last attempt imported late (a data loader's): never a user's own.
    `beside` (the cores connected, and the server's listener): an attempt may be training on these cores (the list
    is written at its first step, and a standby's core connects while it trains), so they are imported at the idle
    priority, on the CPU time the training leaves, while a sentinel answers for the server (_watch)."""
    modules = remembered()
    calm = beside is not None and bool(modules) and _idle_thread()  # a server started --idle is there already
    watch = _sentinel(beside, listener) if beside is not None and modules else None  # after: its hurry stays
    try:
        for module in modules:
            try:
                importlib.import_module(module)
            except BaseException:  # noqa: BLE001 (one that fails here is imported, or not, as the program does)
                continue
    finally:
        if calm:
            _normal_thread()
        if watch is not None:
            os.close(watch[0])
            os.waitpid(watch[1], 0)
    gc.freeze()  # what is imported stays out of every collection: a fork's pages stay shared with the server's


class Handle(NamedTuple):
    """The server as a helper forked from it (the doorman, the sentinel) knows it: a pidfd opened before the fork
    (the server's pid read after it may already name whoever adopted the helper, its core), and its pid."""
    pidfd: int
    pid: int


def _handle() -> Handle:
    return Handle(os.pidfd_open(os.getpid()), os.getpid())


def _sentinel(clients: list[socket.socket], listener: socket.socket | None) -> tuple[int, int] | None:
    """A process at the normal priority that answers for this server while it imports at the idle priority (see
    _watch); it ends when the imports do or the server does (the pipe's end it watches closed). Returns that
    pipe's other end and its pid; None where it cannot be forked."""
    made: list[int] = []
    try:
        server = _handle()
        made.append(server.pidfd)
        done, tell = os.pipe()
        made += [done, tell]
        pid = os.fork()
    except OSError:
        for fd in made:
            os.close(fd)
        return None
    if pid == 0:
        try:
            os.close(tell)
            _normal_thread()  # as the server does for it, whichever of them runs first
            _watch(done, clients, listener, server)
        finally:
            os._exit(0)
    os.close(server.pidfd)
    os.close(done)
    try:  # from here, not in the child: one forked at the idle priority may never run on a busy host
        os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        pass
    return tell, pid


def _gone(conn: socket.socket) -> bool:
    """Whether a readable core's connection is its going rather than a request (peeked: never a request lost)."""
    try:
        return not conn.recv(1, socket.MSG_PEEK)
    except OSError:
        return True


def _watch(done: int, clients: list[socket.socket], listener: socket.socket | None, server: Handle) -> None:
    """What the server would do at once, done while it imports, so that no core waits on the CPU time a training
    leaves (a core tells its end only once the server has let it go): a core that goes is let go (its socket shut,
    as the server's close would); once the last has gone the server is ended, as the doorman ends it (imports or
    not), unless a core waits to be let in; a core that asks for a fork hurries the server (hurry)."""
    left = list(clients)
    if not left:
        return  # none to answer (a core that connects later and cannot wait hurries the server itself)
    while left:
        ready = select.select([done, *(c.fileno() for c in left)], [], [])[0]
        if done in ready:
            return
        for conn in [c for c in left if c.fileno() in ready]:
            if not _gone(conn):
                hurry(server.pid)
                return
            left.remove(conn)
            if left:
                _let_go(conn)
            elif listener is not None and select.select([listener], [], [], 0)[0]:
                hurry(server.pid)  # a core connecting: it is served once the imports are done
                _let_go(conn)
                return
    _end(server)  # the last core hears of it as this process ends


def _let_go(conn: socket.socket) -> None:
    """A core's connection shut, as the server's close would: the core, waiting for that, goes on."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


def _end(server: Handle) -> None:
    """The server ended now, imports or not, and waited for (bounded), before its last core hears of its end:
    hurried first, as one at the idle priority may wait seconds on a busy host to die."""
    hurry(server.pid)
    with contextlib.suppress(OSError):
        signal.pidfd_send_signal(server.pidfd, signal.SIGKILL)
    select.select([server.pidfd], [], [], GONE_S)


def _idle_thread() -> bool:
    """This thread at the idle priority, where it is at the normal one and may take it back (root, or an RLIMIT_NICE
    that allows it): whether it was changed. Its autogroup is left alone (idle() nices it where the server has a
    session of its own; a forked attempt trains in the server's session)."""
    try:
        if os.sched_getscheduler(0) != os.SCHED_OTHER or \
                os.geteuid() != 0 and resource.getrlimit(resource.RLIMIT_NICE)[0] < 20:
            return False
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError, ValueError):
        return False
    return True


def _normal_thread() -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        pass


# ---- an attempt
def _attempt(request: Request, out: int, link: socket.socket, idled: bool) -> None:
    """In the reaper (forked from the server): fork the trainer, tell its pid and ours, wait for it, stop what it
    left behind, tell its exit status. The reaper adopts the trainer's orphans (a daemon it double-forked), so the
    attempt's processes are its descendants, whatever their environment says (it is the server's, in a process
    forked without an exec). Its core gone (its end of `link` closed), the trainer gets its parent-death signal, as
    a cold one would, and what it left is killed at once."""
    os.setpgid(0, 0)  # the trainer's group is stopped alone: its reaper still tells its end
    adopt_orphans()
    trainer = os.fork()
    if trainer == 0:
        link.close()
        _trainer(request, out, idled)
    try:
        os.setpgid(trainer, trainer)
    except OSError:
        pass  # it set it itself
    try:
        link.sendall(f"pid {trainer} {os.getpid()}\n".encode())
    except OSError:
        pass
    from worker.host import procs  # psutil: in the reaper, not in the server every core connects to

    pidfd, grace = os.pidfd_open(trainer), request.grace
    while True:
        watched: list[socket.socket | int] = [link, pidfd]
        ready = select.select(watched, [], [], procs.COLLECT_EVERY_S)[0]
        if pidfd in ready:
            break
        if link not in ready:
            procs.collect_adopted()  # the trainer leads its group: its end is left for the waitpid below
            continue
        try:
            said = link.recv(64)
        except OSError:
            said = b""
        if not said:  # its core went away: what a cold trainer's parent-death signal does
            try:
                os.killpg(trainer, request.parent_death)
            except OSError:
                pass
            select.select([pidfd], [], [])
            grace = 0.0
            break
    _pid, status = os.waitpid(trainer, 0)
    _stop_left(out, grace)
    os.close(out)
    try:
        link.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
    except OSError:
        pass


def _stop_left(out: int, grace: float) -> None:
    """What the attempt left here (adopted by this reaper: daemons, a data server), told in its output and stopped."""
    from worker.host import procs

    left = procs.tree(os.getpid())
    if left:
        with contextlib.suppress(OSError):
            os.write(out, f"{NOTE}{procs.left_behind(left)}\n".encode())
        procs.stop(left, grace)


def _trainer(request: Request, out: int, idled: bool) -> None:
    """In the trainer: the attempt's process as a cold start makes it, then its program; never returns."""
    try:
        os.setpgid(0, 0)
        setup = child_setup(request.parent_death, list(request.cpus) if request.cpus else None)
        if setup is not None:
            setup()  # the reaper's death is its core's: the signal a cold trainer gets then
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        os.environ.clear()
        os.environ.update(request.env)
        os.chdir(request.cwd)
        if idled:
            unidle()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        if "numpy" in sys.modules:  # seeded from the OS at each cold start: not every attempt the server's state
            sys.modules["numpy"].random.seed()
        settled(request)
    except BaseException as exc:  # noqa: BLE001 (the attempt's start failed: said in its log, never the server's)
        os.write(2, f"mgpu fork server: cannot start the attempt: {exc}\n".encode())
        os._exit(127)
    run_and_exit(request.program)


def settled(request: Request) -> None:
    """The attempt computes what a cold one computes: a framework reads its settings (JAX_ENABLE_X64, XLA_FLAGS,
    TF_*) once, when it is imported, and the server imported it under its own. Where the attempt's environment
    differs from those, or its program changes one after a framework is imported (a script that sets
    JAX_ENABLE_X64 before `import jax`, as JAX documents), the process starts its program again cold (an exec:
    the same pid, output and folder), saying why."""
    imported = " and ".join(m for m in env.FRAMEWORK_MODULES if m in sys.modules)
    if not imported:
        return
    differs = sorted(k for k in {*_started_under, *env.framework_settings(request.env)}
                     if _started_under.get(k) != request.env.get(k))
    if differs:
        _cold(request, f"its environment's {differs[0]} is not what its fork server imported {imported} under")

    class Settled(os._Environ):  # type: ignore[type-arg]  # os.environ's own class, generic in the stub alone
        def __setitem__(self, key: str, value: str) -> None:
            if env.is_framework_setting(key) and _imported_under.get(key) != value:
                _cold(request, f"the training set {key}={value!r} after its fork server had imported {imported} "
                               f"under {_imported_under.get(key)!r}")
            super().__setitem__(key, value)

        def __delitem__(self, key: str) -> None:
            if env.is_framework_setting(key) and key in _imported_under:
                _cold(request, f"the training removed {key} after its fork server had imported {imported} under it")
            super().__delitem__(key)

    os.environ.__class__ = Settled


def _cold(request: Request, why: str) -> None:
    """The program started again cold in this process, as its task starts it; never returns."""
    os.write(2, f"{NOTE}this attempt starts cold: {why} (a framework reads its settings when it is imported)\n"
                .encode())
    argv = request.program.argv(sys.executable)
    try:
        os.execve(argv[0], argv, request.env)
    except OSError as exc:
        os.write(2, f"mgpu fork server: cannot start the attempt cold: {exc}\n".encode())
        os._exit(127)


# ---- the server
def _welcome(listener: socket.socket) -> socket.socket | None:
    """A core's connection, or None: another user's process gets no fork."""
    try:
        conn, _ = listener.accept()
    except OSError:
        return None
    if peer(conn)[1] != os.getuid():
        conn.close()
        return None
    return conn


def _doorman(listener: socket.socket, line: socket.socket, server: Handle) -> None:
    """In a process forked before the imports (a thread could not run: an import holds the interpreter's lock for
    seconds at the idle priority): the cores that connect while the server imports, and the server's end as soon
    as its last one has gone, so that letting go of it never waits for the imports. On the server's word (a byte on
    `line`) it hands the cores over and ends; the server gone (`line` closed), it ends. Never returns."""
    clients: list[socket.socket] = []
    ever, started_at = False, time.monotonic()
    while True:
        readable = select.select([listener, line, *clients], [], [], 1.0)[0]
        if line in readable:
            try:
                word = line.recv(1)
            except OSError:
                word = b""
            if word:
                socket.send_fds(line, [b"%d" % len(clients)], [c.fileno() for c in clients[:CLIENTS_MAX]])
            os._exit(0)
        if listener in readable and (conn := _welcome(listener)) is not None:
            clients.append(conn)
            ever = True
        for conn in [c for c in clients if c in readable]:
            if _gone(conn):  # a core says nothing before "ready": readable is its going
                clients.remove(conn)
                if clients:
                    conn.close()
        if not clients and (ever or time.monotonic() - started_at > START_WAIT_S):
            _end(server)  # its last core gone (or none came)
            os._exit(0)


def _door(listener: socket.socket) -> tuple[socket.socket, int]:
    """The doorman started (see _doorman): its end of the line and its pid."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server = _handle()
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            _doorman(listener, theirs, server)
        finally:
            os._exit(0)
    os.close(server.pidfd)
    theirs.close()
    return ours, pid


def _handover(line: socket.socket, doorman: int) -> list[socket.socket]:
    """The cores that connected while the server imported, from its doorman, which then ends."""
    clients: list[socket.socket] = []
    try:
        line.sendall(b"x")
        _said, fds, _flags, _addr = socket.recv_fds(line, 64, CLIENTS_MAX)
        clients = [socket.socket(fileno=fd) for fd in fds]
    except OSError:
        pass
    line.close()
    os.waitpid(doorman, 0)
    return clients


class Server:
    def __init__(self, listener: socket.socket, idled: bool, clients: list[socket.socket]):
        self.listener, self.idled = listener, idled
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ)
        self.clients: set[socket.socket] = set()
        self.ever = bool(clients)  # handed over by the doorman: they came while it imported
        self.modules_seen: tuple[int, int] | None = None  # (mtime, size) of the modules list last imported
        for conn in clients:
            self.ready(conn)

    def serve(self) -> None:
        ready_at = time.monotonic()
        while self.clients or not self.ever and time.monotonic() - ready_at < START_WAIT_S:
            for key, _ in self.selector.select(timeout=1.0):
                if key.fileobj is self.listener:
                    conn = _welcome(self.listener)
                    if conn is not None:
                        self.ever = True
                        self.ready(conn)
                else:
                    self.heard(cast(socket.socket, key.fileobj))  # what ready() registered: a client
            self.reap()
            self.learn()

    def learn(self) -> None:
        """The modules list, imported once its attempt has written it anew (at its first step), not at the next
        core's connection: that one comes with a restart, whose attempt would train beside these imports and,
        forked before them, not have them."""
        try:
            seen = os.stat(modules_file())
            mark: tuple[int, int] | None = (seen.st_mtime_ns, seen.st_size)
        except OSError:
            mark = None
        if mark != self.modules_seen:
            self.modules_seen = mark
            if mark is not None:
                _remembered(list(self.clients), self.listener)

    def ready(self, conn: socket.socket) -> None:
        _remembered([*self.clients, conn], self.listener)
        try:
            conn.sendall(READY)
        except OSError:
            conn.close()
            return
        self.clients.add(conn)
        self.selector.register(conn, selectors.EVENT_READ)

    def heard(self, conn: socket.socket) -> None:
        try:
            raw, fds, _flags, _addr = socket.recv_fds(conn, REQUEST_MAX, 2)
        except OSError:
            raw, fds = b"", []
        if not raw:
            self.selector.unregister(conn)
            self.clients.discard(conn)
            if self.clients:
                conn.close()
            # else the last core's connection is closed by this process's end: that core knows it is gone
            for fd in fds:
                os.close(fd)
            return
        try:
            if len(fds) == 2:
                self.fork(Request.decode(raw), fds[0], fds[1])
        except (ValueError, KeyError, TypeError, OSError, RecursionError) as exc:
            print(f"mgpu fork server: a request refused: {exc}", file=sys.stderr, flush=True)
        finally:  # the reaper has its own
            for fd in fds:
                os.close(fd)

    def fork(self, request: Request, out: int, link: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            try:
                self.selector.close()
                self.listener.close()
                for conn in self.clients:
                    conn.close()
                _attempt(request, out, socket.socket(fileno=link), self.idled)
            finally:
                os._exit(0)

    @staticmethod
    def reap() -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return


def main(argv: list[str]) -> int:
    name, idled, ours = argv[0], False, None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(address(name))
    except OSError:
        return 0  # one serves this task already
    listener.listen(16)
    clear = child_setup(0)  # it lives while any core is connected, the one that started it or another (a standby)
    if clear is not None:
        clear()
    line, doorman = _door(listener)  # before the imports and the idle priority
    if "--idle" in argv:
        idled = idle()
    if "--ours" in argv[:-1]:
        ours = argv[argv.index("--ours") + 1]
    _imports(ours)
    Server(listener, idled, _handover(line, doorman)).serve()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown of the framework: its last core waits for this end


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
