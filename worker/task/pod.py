"""The on-host entry of Kubernetes pods (a JobSet rendered by `mgpu-cluster render`); no TensorFlow here.

    python -m worker.task.pod --run-id ID --run-dir RUN --hosts PATTERN --workers N --port P [--grace S]
                              [--preempt-grace S] [--backend jax [--cpu-devices N]] [--safe-path] -- PROGRAM ARGS...

Its rank is Kubernetes' JOB_COMPLETION_INDEX; the cluster's workers are PATTERN.format(i=0..N-1) (the
JobSet's stable host names) at port P; the one builder (worker.host.env) makes TF_CONFIG (on JAX, Keras'
distribution variables, and XLA_FLAGS with N devices on the CPU). The task core runs PROGRAM with its records
in its task folder's events file (worker.host.layout). SIGTERM (a node drain, a spot reclaim, a JobSet restart)
is a notice: the group saves at one agreed step and exits 75. The pod starts with PYTHONSAFEPATH=1 (no
worker.py of the workdir before our package); PROGRAM keeps it with --safe-path (our runner).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from worker.task.channel import FileChannel
from worker.host.entries import PodArgs
from worker.task.core import EXIT_SETUP, TaskCore, TaskSetup
from worker.host import layout
from worker.host.env import POD_INDEX, SAFE_PATH, endpoint, inherited, task_environment
from worker.host.spawn import module_argv
from worker.task.signals import Signals


def guarded(program: list[str], safe_path: bool) -> list[str]:
    """PROGRAM as it runs: our runner (`python -m worker`, --safe-path) keeps PYTHONSAFEPATH, and on a Python
    that ignores it (< 3.11) starts through the boot that drops the workdir from sys.path (worker.host.spawn); a
    program of the spec's own gets Python's usual sys.path (a script's folder first)."""
    if not safe_path:
        os.environ.pop(SAFE_PATH, None)
    elif sys.version_info < (3, 11) and program[1:3] == ["-m", "worker"]:
        return [*module_argv(program[0], "worker"), *program[3:]]
    return program


def main(argv: list[str] | None = None) -> int:
    signals = Signals()  # first: as PID 1 a signal with no handler is dropped, a notice lost
    args = PodArgs.parse(argv, __doc__)
    program = list(args.program)
    rank = layout.index_of(os.environ.get(POD_INDEX, ""))
    if rank is None or rank >= args.workers:
        print(f"mgpu pod: {POD_INDEX} is {os.environ.get(POD_INDEX)!r}, not one of "
              f"0..{args.workers - 1}: this command runs in the pods of an Indexed Job (the JobSet that "
              "'mgpu-cluster render' writes)", file=sys.stderr)
        return EXIT_SETUP
    task_dir = layout.task_dir(Path(args.run_dir), rank)
    try:
        task_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        pass  # the core reports what it cannot write
    attempt = len(layout.attempts(task_dir))  # a JobSet restart starts the pod afresh
    workers = [endpoint(args.hosts.format(i=i), args.port) for i in range(args.workers)]
    program = guarded(program, args.safe_path)
    # the container's env (the spec's, as rendered) stands, as on every engine, but for what the builder owns
    env = task_environment(inherited(os.environ), workers, rank, args.run_id, str(task_dir), backend=args.backend,
                           cpu_devices=args.cpu_devices)
    setup = TaskSetup(run_dir=task_dir, attempt=attempt, argv=program, env=env, port=args.port,
                      grace=args.grace, preempt_grace=args.grace if args.preempt_grace is None else args.preempt_grace,
                      host=args.hosts.format(i=rank).split(".")[0], report_port=args.port, echo=True)
    core = TaskCore(setup, FileChannel(layout.events_file(task_dir, attempt)))
    signals.attach(core)
    code = core.run()
    from worker.host.protocol import EXIT_PREEMPTED  # imported by the core once the task ran

    # the notice was a preemption whether or not the task managed to save: the JobSet's rule restarts on 75
    return EXIT_PREEMPTED if core.notice and code != 0 else code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
