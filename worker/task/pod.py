"""The on-host entry of Kubernetes pods (a JobSet rendered by `mgpu-cluster render`); no TensorFlow here.

    python -m worker.task.pod --run-id ID --run-dir RUN --hosts PATTERN --workers N --port P [--grace S]
                              [--preempt-grace S] [--backend jax [--cpu-devices N]] -- PROGRAM ARGS...

Its rank is Kubernetes' JOB_COMPLETION_INDEX; the cluster's workers are PATTERN.format(i=0..N-1) (the
JobSet's stable host names) at port P; the one builder (worker.host.env) makes TF_CONFIG (on JAX, Keras'
distribution variables, and XLA_FLAGS with N devices on the CPU). The task
core runs PROGRAM with its records in its task folder's events file (worker.host.layout). SIGTERM (a node drain,
a spot reclaim, a JobSet restart) is a notice: the group saves at one agreed step and exits 75.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from worker.task.channel import FileChannel
from worker.task.core import EXIT_SETUP, GRACE_S, TaskCore, TaskSetup
from worker.host import layout
from worker.host.env import Backend, endpoint, task_environment
from worker.task.signals import Signals

POD_OWN = ("TF_CONFIG", "MGPU_TASK_INDEX", "KERAS_DISTRIBUTION_PROCESS_ID", "XLA_FLAGS")  # the pod's value wins


def main(argv: list[str] | None = None) -> int:
    signals = Signals()  # first: as PID 1 a signal with no handler is dropped, a notice lost
    parser = argparse.ArgumentParser(prog="python -m worker.task.pod", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--run-dir", required=True, type=Path, help="the run's folder (shared storage, or the pod's)")
    parser.add_argument("--hosts", required=True, help="the workers' host names, with {i} for the index")
    parser.add_argument("--workers", required=True, type=int)
    parser.add_argument("--port", required=True, type=int)
    parser.add_argument("--grace", type=float, default=GRACE_S)
    parser.add_argument("--preempt-grace", type=float, default=None)
    parser.add_argument("--backend", type=Backend, default=Backend.TENSORFLOW, choices=list(Backend))
    parser.add_argument("--cpu-devices", type=int, default=None, help="on JAX: XLA's devices on the CPU")
    parser.add_argument("program", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        parser.error("give the program to run after --")
    rank = layout.index_of(os.environ.get("JOB_COMPLETION_INDEX", ""))
    if rank is None or rank >= args.workers:
        print(f"mgpu pod: JOB_COMPLETION_INDEX is {os.environ.get('JOB_COMPLETION_INDEX')!r}, not one of "
              f"0..{args.workers - 1}: this command runs in the pods of an Indexed Job (the JobSet that "
              "'mgpu-cluster render' writes)", file=sys.stderr)
        return EXIT_SETUP
    task_dir = layout.task_dir(args.run_dir, rank)
    try:
        task_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        pass  # the core reports what it cannot write
    attempt = len(layout.attempts(task_dir))  # a JobSet restart starts the pod afresh
    workers = [endpoint(args.hosts.format(i=i), args.port) for i in range(args.workers)]
    xla = {"XLA_FLAGS": os.environ["XLA_FLAGS"]} if "XLA_FLAGS" in os.environ else {}  # the builder adds to it
    own = task_environment(xla, workers, rank, args.run_id, str(task_dir), backend=args.backend,
                           cpu_devices=args.cpu_devices)
    # the container's env (the spec's, as rendered) stands, as on every engine, but for what only the pod knows
    env = {k: v if k in POD_OWN else os.environ.get(k, v) for k, v in own.items()}
    setup = TaskSetup(run_dir=task_dir, attempt=attempt, argv=program, env=env, port=args.port,
                      grace=args.grace, preempt_grace=args.grace if args.preempt_grace is None else args.preempt_grace,
                      host=args.hosts.format(i=rank).split(".")[0], report_port=args.port, echo=True)
    core = TaskCore(setup, FileChannel(layout.events_file(task_dir, attempt)))
    signals.attach(core)
    code = core.run()
    from worker.protocol import EXIT_PREEMPTED  # imported by the core once the task ran

    # the notice was a preemption whether or not the task managed to save: the JobSet's rule restarts on 75
    return EXIT_PREEMPTED if core.notice and code != 0 else code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
