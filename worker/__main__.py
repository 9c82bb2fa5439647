"""`python -m worker --entrypoint MODULE:FUNCTION [...]`: run the built-in trainer on this task."""

from __future__ import annotations

import argparse
import io
import os
import sys

from worker.host import env  # the standard library alone: TensorFlow is not imported yet


def on_jax() -> bool:
    """Keras 3 on JAX (worker.keras3) where KERAS_BACKEND says so, else TensorFlow with tf_keras."""
    return os.environ.get(env.KERAS_BACKEND) == "jax"


if not on_jax():
    env.tf_defaults()  # before anything can import TensorFlow

from worker.host.protocol import EXIT_PREEMPTED
from worker.tensorflow.runner import run
from worker.training.checkpoints import Preempted
from worker.training.config import DEFAULT_BATCH_SIZE_PER_REPLICA, DEFAULT_EPOCHS, DEFAULT_LEARNING_RATE, RunConfig
from worker.training.entrypoint import WorkerError

ENVIRONMENT = """\
environment:
  TF_CONFIG          cluster and this task ({"cluster": {"worker": [...]}, "task": {...}});
                     unset: one process (MirroredStrategy over local GPUs, or CPU)
  MGPU_RUN_DIR       this task's folder: progress.json goes there (unset: no progress file)
  MGPU_TASK_INDEX    task number written to progress.json (default: from TF_CONFIG)
  MGPU_DATA          data path read by the bundled examples (worker.examples.*)
  MGPU_PROGRESS_INTERVAL  seconds between progress.json writes on batches (default 1)
  MGPU_TF_DATA_AUTOTUNE=1 tf.data autotune back on (benchmarks; fit may end seconds late)
  TF_FORCE_GPU_ALLOW_GROWTH  set to true unless set already or TF_GPU_ALLOCATOR is set
  KERAS_BACKEND=jax  Keras 3 on JAX instead (DataParallel over every device of every task), with
                     KERAS_DISTRIBUTION_JOB_ADDRESSES, _NUM_PROCESSES, _PROCESS_ID (keras.distribution)

SIGTERM: every worker finishes the step, all save a checkpoint at the same step, and the
process exits %d (preempted). Exit codes: 0 done, 2 a problem you can fix, 1 anything else.
""" % EXIT_PREEMPTED


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m worker",
        description="Train the model of an entrypoint on this task, together with the\n"
                    "other tasks of TF_CONFIG (MultiWorkerMirroredStrategy).",
        epilog=ENVIRONMENT, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entrypoint", required=True, metavar="MODULE:FUNCTION",
                   help="function returning a worker.Task, e.g. worker.examples.digits:task "
                        "(the current directory is importable)")
    p.add_argument("--epochs", type=int, metavar="N", help=f"epochs to train (default: the task's, "
                   f"else {DEFAULT_EPOCHS})")
    p.add_argument("--steps-per-epoch", type=int, metavar="N",
                   help="steps per epoch (default: the task's, else examples // global batch)")
    p.add_argument("--batch-size-per-replica", type=int, metavar="N",
                   help=f"batch per replica; global batch = this x replicas in sync "
                        f"(default: the task's, else {DEFAULT_BATCH_SIZE_PER_REPLICA})")
    p.add_argument("--learning-rate", type=float, metavar="F",
                   help=f"base learning rate (default: the task's, else {DEFAULT_LEARNING_RATE})")
    p.add_argument("--scale-learning-rate", action=argparse.BooleanOptionalAction, default=True,
                   help="multiply the learning rate by the replicas in sync, reached by a "
                        "linear warm-up (default: on)")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="BackupAndRestore folder, shared by the run's tasks "
                        "(default: $MGPU_RUN_DIR/../checkpoint, else ./checkpoint)")
    p.add_argument("--resume-from", metavar="DIR",
                   help="go on from the checkpoint in DIR (an earlier run's): its files are linked into "
                        "this run's checkpoint folder when that holds none (`up --resume`)")
    p.add_argument("--resume-run", metavar="RUN",
                   help="the run whose backup this run may start from (`up --resume RUN` gives it); without it, "
                        "a backup of another run in the checkpoint folder is refused")
    p.add_argument("--checkpoint-every-steps", type=positive, metavar="N",
                   help="also save a checkpoint every N global steps, so that a run killed "
                        "without notice resumes mid-epoch (default: the task's, else only at "
                        "epoch ends)")
    p.add_argument("--tensorboard", metavar="LOGDIR",
                   help="TensorBoard log folder (the chief writes it; others a temporary one)")
    p.add_argument("--mixed-precision", action="store_true", help="mixed_float16 policy")
    p.add_argument("--model-dir", metavar="DIR",
                   help="where the chief saves model.keras (default: $MGPU_RUN_DIR/.., else ./)")
    p.add_argument("--run-dir", metavar="DIR",
                   help="where progress.json goes (default: $MGPU_RUN_DIR, else none)")
    p.add_argument("--save-weights", metavar="PATH",
                   help="every task saves its final weights as .npz here; {task} becomes the "
                        "task index")
    p.add_argument("--collective", choices=("auto", "ring", "nccl"), default="auto",
                   help="collective implementation between workers (auto: NCCL with GPUs, "
                        "else RING)")
    p.add_argument("--local-replicas", type=positive, metavar="N",
                   help="replicas in this worker on a host without GPUs: the CPU split into N "
                        "logical devices (with GPUs: one replica per visible GPU; N must match)")
    return p


def main(argv: list[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):  # the interpreter's own (None without a stream)
            stream.reconfigure(line_buffering=True)
    args = parser().parse_args(argv)
    config = RunConfig(
        entrypoint=args.entrypoint, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
        batch_size_per_replica=args.batch_size_per_replica, learning_rate=args.learning_rate,
        scale_learning_rate=args.scale_learning_rate, checkpoint_dir=args.checkpoint_dir,
        resume_from=args.resume_from, resume_run=args.resume_run,
        checkpoint_every_steps=args.checkpoint_every_steps,
        tensorboard=args.tensorboard, mixed_precision=args.mixed_precision,
        model_dir=args.model_dir, run_dir=args.run_dir, save_weights=args.save_weights,
        collective=args.collective, local_replicas=args.local_replicas)
    train = run
    if on_jax():
        from worker.keras3.runner import run as train
    try:
        train(config)
    except (WorkerError, ImportError) as exc:
        print(f"worker: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except Preempted:
        return EXIT_PREEMPTED
    return 0


if __name__ == "__main__":
    if on_jax():
        from worker.keras3.group import exit_code_alone

        sys.exit(exit_code_alone(main))
    sys.exit(main())
