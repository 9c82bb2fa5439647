"""The on-host entry of local and SSH tasks: our supervisor, speaking to the launcher over a pipe.
It runs one task under the task core (worker.task.core); no TensorFlow here.

    python -m worker.task.supervised --run-dir DIR [--attempt N] [--port P] [--env-stdin] [--standby] -- PROGRAM ARGS...

Our stdout carries only `worker.host.protocol` records; the program's output goes to DIR/worker.log
whole and reaches the launcher inside Output records (long lines cut, a flood thinned), so the
training can neither forge an event nor slow one down. With --env-stdin the first line of stdin
is a JSON object of the task's environment (kept off every command line).

The task is stopped (TERM to its group, KILL after --grace; then every process that still
carries the task's run id in its environment) when our stdin reaches EOF (the launcher stopped
it, or went away) or on INT/HUP; TERM or USR1 is a notice (a host or scheduler taking the
machine) and gets --preempt-grace. With --lifeline N, silence on stdin for N seconds also stops
the task: a host cut off from the network never sees an EOF.

With --warm the attempt is forked from the task's fork server (worker.task.forkserver: Python, TensorFlow and
our runner imported once per task and host), started where none runs. With --standby too it is a standby: it
holds that server, says so in Standby records, and starts the attempt when the line "go" comes on stdin;
stopped before that, it leaves nothing and reports nothing.
"""

from __future__ import annotations

import json
import os
import select
import sys
import threading
import time
from pathlib import Path

from worker.host.protocol import BROKEN, GO, REGROUP, REGROUP_NOTICE
from worker.task.channel import PipeChannel
from worker.host.entries import SupervisedArgs
from worker.task.core import TaskCore, TaskSetup
from worker.task.signals import Signals


def read_env_line() -> tuple[dict[str, str] | None, bytes]:
    """The first line of stdin as the task's environment; the rest of what was read. None when stdin
    ends before a whole line: the launcher went away before the start."""
    buf = b""
    while b"\n" not in buf:
        data = os.read(0, 65536)
        if not data:
            return None, b""
        buf += data
    line, _, rest = buf.partition(b"\n")
    env = json.loads(line) if line.strip() else {}
    if not isinstance(env, dict):
        raise ValueError("the environment line is not a JSON object")
    return {str(k): str(v) for k, v in env.items()}, rest


def watch_stdin(sup: TaskCore, lifeline: float | None, said: bytes = b"") -> None:
    """EOF on stdin, or silence past the lifeline: the launcher (or the connection to it) is gone, or stops
    us (after BROKEN: a peer failed). A standby's supervisor also waits here for the line "go": its attempt
    begins."""
    last = time.monotonic()
    said = said[-16:]  # the last words said (the launcher's keepalives are empty lines)
    while True:
        if sup.setup.standby and not sup.warm_start.begun.is_set() and GO in said:
            sup.warm_start.begin()
        if REGROUP in said:  # a notice; the supervisor keeps listening (its lifeline, the EOF that follows)
            said = said.replace(REGROUP, b"")
            sup.stop("the launcher regroups the run: a lost host is back", notice=REGROUP_NOTICE)
        if lifeline and not select.select([0], [], [], 1.0)[0]:
            if time.monotonic() - last > lifeline:
                return sup.stop(f"no word from the launcher for {lifeline:g} s")
            continue
        try:
            data = os.read(0, 4096)  # the raw fd: a buffered reader's lock would block our exit
        except OSError:
            data = b""
        if not data:
            if BROKEN in said:
                return sup.stop("a peer failed: the launcher stops the group", broken=True)
            return sup.stop("the launcher stopped it, or went away")
        said = (said + data)[-16:]
        last = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    signals = Signals()  # first: a stop while we read the environment is kept, and then nothing starts
    args = SupervisedArgs.parse(argv, __doc__)
    env: dict[str, str] = {}
    rest = b""
    if args.env_stdin:
        try:
            read, rest = read_env_line()
        except (ValueError, OSError) as exc:
            SupervisedArgs.parser(__doc__).error(f"--env-stdin: {exc}")
        if read is None:  # not a task without its TF_CONFIG and run id: nothing at all
            print("mgpu supervisor: stdin ended before the task's environment; nothing was started",
                  file=sys.stderr)
            return 1
        env = read
    setup = TaskSetup(run_dir=Path(args.run_dir).resolve(), attempt=args.attempt, argv=list(args.program), env=env,
                      cpus=list(args.cpus) or None,
                      port=args.port, grace=args.grace,
                      preempt_grace=args.grace if args.preempt_grace is None else args.preempt_grace,
                      warm=args.warm and args.env_stdin and not args.detach,
                      standby=args.standby and args.warm and args.env_stdin and not args.detach)
    sup = TaskCore(setup, PipeChannel())
    signals.attach(sup)
    if not args.detach:
        threading.Thread(target=watch_stdin, args=(sup, args.lifeline, rest), daemon=True).start()
    return sup.run()


if __name__ == "__main__":
    code = main()
    os._exit(code)  # don't wait for the watcher threads
