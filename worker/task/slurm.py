"""The on-host entry of Slurm tasks, started by `srun` on each node (no TensorFlow here).

    python -m worker.task.slurm --run-dir RUN --attempt N [--port P] [--grace S] [--preempt-grace S]
                                [--lifeline S] -- PROGRAM ARGS...

It builds the task's environment from the step (TF_CONFIG, or on JAX Keras' variables, from the step's
nodes in Slurm's order at their NodeAddr, rank from SLURM_PROCID, the run's id, backend and the
launcher's part from the run folder, layout.ENV) with the one builder (worker.host.env), and runs
PROGRAM under the task core, whose records go to the task's events file of the attempt
(worker.host.layout) for the launcher to follow (attempt = N + SLURM_RESTART_COUNT: a requeued job's
run is the next attempt). TERM or USR1 is a notice (USR1:
Slurm's signal before the time limit), unless a peer of this attempt already failed (then Slurm is
ending the step); INT or HUP stop it. With --lifeline S the task stops when the launcher's lifeline
(layout.ALIVE in the run folder) is older than S seconds: its launcher is gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from worker.host import env, layout
from worker.host.env import endpoint
from worker.task.channel import FileChannel
from worker.host.entries import SlurmArgs
from worker.task.core import EXIT_SETUP, TaskCore, TaskSetup
from worker.task.signals import Signals

PORT_BASE, PORT_SPAN = 20000, 10000


# --------------------------------------------------------------------------- pure

def default_port(job_id: int | str) -> int:
    """The TF port when the spec names none: from the job id, so two jobs sharing a node differ."""
    return PORT_BASE + int(job_id) % PORT_SPAN


def workers(nodes: list[str], addresses: dict[str, str], port: int) -> list[str]:
    """The cluster's workers in the step's node order (as Slurm lists them, never sorted), each at its
    node's address (its name where Slurm gave none) and `port`."""
    return [endpoint(addresses.get(n) or n, port) for n in nodes]


def tf_config(nodes: list[str], addresses: dict[str, str], port: int, rank: int) -> dict[str, Any]:
    return env.tf_config(workers(nodes, addresses, port), rank)


def parse_nodes(text: str) -> dict[str, str]:
    """{NodeName: NodeAddr} from `scontrol -o show node` (one node per line)."""
    found = {}
    for line in text.splitlines():
        fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
        if fields.get("NodeName"):
            found[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    return found


# --------------------------------------------------------------------------- asking Slurm

class SetupError(Exception):
    """Slurm's view of the step does not give this task a place in the cluster."""


def _scontrol(*args: str) -> str:
    try:
        proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SetupError(f"`scontrol {' '.join(args)}` failed: {exc}") from None
    if proc.returncode != 0:
        raise SetupError(f"`scontrol {' '.join(args)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def step_cluster(environ: dict[str, str]) -> tuple[list[str], dict[str, str], int, int]:
    """(nodes in Slurm's order, their addresses, this task's rank, job id) of the running step."""
    try:
        rank, job_id = int(environ["SLURM_PROCID"]), int(environ["SLURM_JOB_ID"])
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"]
    except (KeyError, ValueError) as exc:
        raise SetupError(f"not started by srun ({exc} missing from the environment)") from None
    nodes = _scontrol("show", "hostnames", nodelist).split()
    tasks = int(environ.get("SLURM_STEP_NUM_TASKS") or len(nodes))
    me = environ.get("SLURMD_NODENAME", "")
    if tasks != len(nodes) or rank >= len(nodes) or (me and nodes[rank] != me):
        raise SetupError(f"task {rank} of {tasks} runs on {me or '?'}, but the step's nodes are {nodes}: "
                         "mgpu-cluster needs one task per node, in node order (srun --ntasks-per-node=1)")
    return nodes, parse_nodes(_scontrol("-o", "show", "node", nodelist)), rank, job_id


def peer_failed(run: Path, attempt: int) -> bool:
    """Another task of this attempt already failed: a TERM now is Slurm ending the step
    (--kill-on-bad-exit), not a notice to save."""
    from worker.host import protocol

    try:
        folders = [p for p in run.iterdir() if layout.task_index(p.name) is not None]
    except OSError:
        return False
    for folder in folders:
        try:
            lines = layout.events_file(folder, attempt).read_bytes().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                ev = protocol.decode(line)
            except protocol.BadRecord:
                continue
            if isinstance(ev, protocol.Exit) and ev.code not in (0, protocol.EXIT_PREEMPTED) and not ev.notice:
                return True
    return False


def watch_lifeline(core: TaskCore, alive: Path, lifeline: float) -> None:
    """Stop the task once the launcher stopped touching `alive` (killed, or its machine went away)."""
    while not core.stopping.wait(2.0):
        try:
            age = time.time() - alive.stat().st_mtime
        except OSError:
            age = lifeline + 1
        if age > lifeline:
            return core.stop(f"no word from the launcher for over {lifeline:g} s ({alive} is {age:.0f} s old)")


def main(argv: list[str] | None = None) -> int:
    args = SlurmArgs.parse(argv, __doc__)
    program = list(args.program)
    run, environ = Path(args.run_dir).resolve(), dict(os.environ)
    rank = int(environ.get("SLURM_PROCID") or 0)
    attempt = args.attempt + int(environ.get("SLURM_RESTART_COUNT") or 0)
    signals = Signals(notice_ok=lambda: not peer_failed(run, attempt))  # before asking Slurm: a notice is kept
    node = environ.get("SLURMD_NODENAME", "")
    task_dir = layout.task_dir(run, rank)
    try:
        task_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        pass  # the core reports what it cannot write
    problem, task_env, port = "", {}, args.port or 0
    try:
        given = json.loads((run / layout.ENV).read_text())
        nodes, addresses, rank, job_id = step_cluster(environ)
        port = args.port or default_port(job_id)
        task_env = env.task_environment(dict(given["env"]), workers(nodes, addresses, port), rank,
                                        str(given["run_id"]), str(task_dir),
                                        backend=env.Backend(given.get("backend", env.Backend.TENSORFLOW)),
                                        cpu_devices=given.get("cpu_devices"))
    except (SetupError, OSError, ValueError, KeyError, TypeError) as exc:
        problem = f"cannot set up task {rank} on {node or '?'}: {exc}"
    setup = TaskSetup(run_dir=task_dir, attempt=attempt, argv=program, env=task_env, port=port or None,
                      grace=args.grace, preempt_grace=args.grace if args.preempt_grace is None else args.preempt_grace,
                      host=node, report_port=port, parent_death=signal.SIGKILL)
    core = TaskCore(setup, FileChannel(layout.events_file(task_dir, attempt)))
    if problem:
        core.prepare()
        return core.refuse(EXIT_SETUP, problem)
    signals.attach(core)
    if args.lifeline:
        threading.Thread(target=watch_lifeline, args=(core, run / layout.ALIVE, args.lifeline),
                         daemon=True).start()
    return core.run()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # don't wait for the watcher threads
